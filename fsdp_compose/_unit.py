"""A unit: the parameters of one ``fully_shard`` call, communicated together.

A unit all-gathers all of its parameters with one collective into one flat buffer
and reduce-scatters all of its gradients with one collective. It knows *how* to
unshard, reshard and reduce; the scheduler decides *when*.

[Note: unsharded storage]
Each unit owns one flat ``unsharded`` buffer of ``W * S`` elements (``S`` = one
rank's padded row) laid out parameter-major: parameter p occupies ``W * slot_p``
elements starting at ``W * offset_p``, and its unsharded ``nn.Parameter`` is a view
of the first ``numel_p`` of them. The buffer is created once; resharding frees it
by resizing its storage to zero bytes and unsharding resizes it back and refills
it. Autograd may have saved the unsharded parameters for backward, and this keeps
those saved references valid across a reshard/unshard cycle (the refill does not
bump the version counter: it restores the same values).

The all-gather output is rank-major (``(W, S)``: row r is rank r's slots), so one
copy (``split_with_sizes_copy``) moves each parameter's ``(W, slot_p)`` block into
place. Gradients go the other way with one ``chunk_cat``.

With a shard world of one and no dtype cast, the unsharded parameter simply
aliases the local shard (no buffer, no copy): a one-rank run costs what the
unwrapped model costs.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _collectives, _compat
from ._collectives import AllGatherComm, PendingCollective, ReduceScatterComm
from ._mesh import MeshInfo, post_forward_subgroup
from ._policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._sharded_param import ShardedParam

logger = logging.getLogger("fsdp_compose")

_BYTE_ALIGNMENT = 16  # slot alignment when a unit mixes dtypes and buffers are bytes


class ShardState(Enum):
    """Where a unit's parameter data currently lives."""

    SHARDED = "sharded"  # only the sharded DTensors exist; they are registered
    UNSHARDED = "unsharded"  # full parameters allocated and registered
    PARTIALLY_SHARDED = "partially_sharded"  # after forward, sharded over a smaller group


class Phase(Enum):
    """What the unit is doing in the current step."""

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


@dataclass
class _Slot:
    param: ShardedParam | None  # None: alignment gap
    offset: int  # within one rank's row, in buffer elements
    size: int  # per-rank padded slot, in buffer elements


class Unit:
    """The parameter group of one :func:`fully_shard` call.

    Args:
        params: the unit's managed parameters, in registration order.
        modules: the annotated module(s) of this unit.
        mesh_info: data-parallel layout.
        reshard_after_forward: True/False, or an int group size; the root's
            default (None) is resolved by the scheduler.
        mp_policy: mixed precision for this unit.
        offload_policy: offloading for this unit.
    """

    def __init__(
        self,
        params: list[ShardedParam],
        modules: tuple[nn.Module, ...],
        mesh_info: MeshInfo,
        reshard_after_forward: bool | int,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
    ) -> None:
        self.params = params
        self.modules = modules
        self.mesh_info = mesh_info
        self.mp_policy = mp_policy
        # On a CPU mesh everything already lives on the CPU: offloading is a no-op.
        self.offload = (
            isinstance(offload_policy, CPUOffloadPolicy) and mesh_info.device.type != "cpu"
        )
        # Pinned host shards make the device-to-host gradient copies asynchronous.
        self.pin_memory = self.offload and bool(getattr(offload_policy, "pin_memory", False))
        self.name = type(modules[0]).__name__  # refined to the module's FQN at lazy init
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.gradient_divide_factor: float | None = None
        self.reduce_scatter_unused_params = False
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.force_sum_reduction = False  # set_force_sum_reduction_for_comms
        self.unshard_in_backward = True
        # set_separate_reduce_scatter_group: reduce-scatters on their own group.
        self._reduce_scatter_group: dist.ProcessGroup | None = None
        # How collectives on each group are issued (gloo fast paths or the public
        # ones), decided at lazy init: see [Note: collectives per backend].
        self._route = self._rs_route = _collectives.PUBLIC_ROUTE
        self._post_forward_route = _collectives.PUBLIC_ROUTE
        # set_custom_all_gather / set_custom_reduce_scatter: user collectives.
        self.custom_all_gather: AllGatherComm | None = None
        self.custom_reduce_scatter: ReduceScatterComm | None = None
        # Explicit prefetch targets (set_modules_to_*_prefetch); None: implicit order.
        self.forward_prefetch: list[Unit] | None = None
        self.backward_prefetch: list[Unit] | None = None
        self.state = ShardState.SHARDED
        self.phase = Phase.IDLE
        self._post_forward_group: dist.ProcessGroup | None = None
        self._post_forward_rank = 0
        self._post_forward_size = 1
        self._initialized = False
        self.set_reshard_after_forward(reshard_after_forward)

        self._pending_gather: PendingCollective | None = None
        self._gather_output: torch.Tensor | None = None  # (world, row) while gathering
        self._gather_world = 0
        self._post_forward_shard: torch.Tensor | None = None
        self._unsharded: torch.Tensor | None = None  # flat buffer, see [Note: unsharded storage]
        self._alias = False
        # Parked: gathered data kept after a no-grad forward, but the sharded
        # parameters registered, so model.parameters() still gives the shards the
        # optimizer must hold. The next use re-registers without communication.
        self._parked = False
        self._gathered_versions: list[int] = []
        self._unsharded_version = 0  # of the flat buffer right after the copy-out
        # HSDP with set_requires_all_reduce(False): reduce-scattered (not yet
        # all-reduced) gradient sums per parameter, added in at the next all-reduce.
        self._partial_reduce: dict[ShardedParam, torch.Tensor] = {}

    # ------------------------------------------------------------------
    # configuration
    # ------------------------------------------------------------------

    def set_reshard_after_forward(self, value: bool | int) -> None:
        if self.state is ShardState.PARTIALLY_SHARDED:
            self.reshard()
        self.reshard_after_forward = value
        self._post_forward_group = None
        if not isinstance(value, bool):
            group, rank = post_forward_subgroup(self.mesh_info, value)
            self._post_forward_group, self._post_forward_rank = group, rank
            self._post_forward_size = value
            if self._initialized:
                self._post_forward_route = _collectives.route_of(group)
            if any(p.shard_dim != 0 for p in self.params):
                raise ValueError(
                    "reshard_after_forward as an int needs every parameter sharded on dim 0; "
                    "shard_placement_fn chose another dim for "
                    f"{[p.fqn for p in self.params if p.shard_dim != 0]}"
                )

    @property
    def trainable_params(self) -> list[ShardedParam]:
        return [p for p in self.params if p.sharded_param.requires_grad]

    @property
    def unsharded_nbytes(self) -> int:
        """Bytes the unsharded parameters occupy (what the rate limiter budgets)."""
        if not self._initialized:
            self.lazy_init()
        if self._alias:
            return 0
        return self._world * self._row * self._buffer_dtype.itemsize

    @property
    def shard_group(self) -> dist.ProcessGroup:
        return self.mesh_info.shard_group

    @property
    def reduce_scatter_group(self) -> dist.ProcessGroup | None:
        """The group of gradient reduce-scatters if not the shard group."""
        return self._reduce_scatter_group

    @reduce_scatter_group.setter
    def reduce_scatter_group(self, group: dist.ProcessGroup | None) -> None:
        self._reduce_scatter_group = group
        if self._initialized:
            self._decide_routes()

    def _decide_routes(self) -> None:
        self._route = _collectives.route_of(self.shard_group)
        self._rs_route = (
            self._route
            if self._reduce_scatter_group is None
            else _collectives.route_of(self._reduce_scatter_group)
        )
        if self._post_forward_group is not None:
            self._post_forward_route = _collectives.route_of(self._post_forward_group)

    # ------------------------------------------------------------------
    # lazy initialisation: dtypes and buffer layout
    # ------------------------------------------------------------------

    def invalidate(self) -> None:
        """Forces layout and views to be rebuilt (after ``_apply``/dtype changes)."""
        if self.state is not ShardState.SHARDED:
            self.reshard()
        self._initialized = False
        for p in self.params:
            p.unsharded_param = None

    def lazy_init(self) -> None:
        if self._initialized:
            return
        # The buffers and views made here outlive this call: made inside
        # torch.inference_mode() (an evaluation first), they would be inference
        # tensors, unusable for training ever after.
        with torch.inference_mode(False):
            self._lazy_init()

    def _lazy_init(self) -> None:
        for p in self.params:
            p.resync_sharded_param()
        on_meta = [p.fqn for p in self.params if p.sharded_param.is_meta]
        if on_meta:
            raise RuntimeError(
                f"fully_shard unit {self.name!r} has parameters on the meta device: {on_meta} "
                "(built there and never materialized, or moved there after fully_shard). "
                "Materialize them before the first forward, e.g. "
                "model.to_empty(device=...) and then re-initialize the parameters "
                "(reset_parameters() / your init function) or load a state dict."
            )
        wrong = [
            (p.fqn, str(p.local_shard.device))
            for p in self.params
            if p.local_shard.device.type != (p.offload_device or self.mesh_info.device).type
        ]
        if wrong:
            raise RuntimeError(
                f"fully_shard unit {self.name!r} expects its sharded parameters on "
                f"{self.mesh_info.device} (the mesh's device"
                f"{', or the CPU when offloaded' if self.offload else ''}) but found {wrong}. "
                "Do not move a sharded module to another device after fully_shard; build the "
                "mesh on the intended device instead."
            )
        self._init_dtypes()
        self._decide_routes()
        self._init_layout()
        self._initialized = True

    def _init_dtypes(self) -> None:
        mp = self.mp_policy
        for p in self.params:
            p.orig_dtype = p.sharded_param.dtype
            cast = mp.param_dtype is not None and p.orig_dtype.is_floating_point
            p.compute_dtype = mp.param_dtype if cast else p.orig_dtype  # type: ignore[assignment]
        trainable = self.trainable_params
        if mp.reduce_dtype is not None:
            self.reduce_dtype: torch.dtype | None = mp.reduce_dtype
        else:
            dtypes = {p.compute_dtype for p in trainable}
            if len(dtypes) > 1:
                raise ValueError(
                    f"fully_shard unit {self.name!r} has trainable parameters of different "
                    f"dtypes {sorted(map(str, dtypes))}, but a unit reduces its gradients in one "
                    "collective: give them one dtype, set MixedPrecisionPolicy(reduce_dtype=...), "
                    "or put them in separate fully_shard units."
                )
            self.reduce_dtype = next(iter(dtypes)) if dtypes else None

    def _init_layout(self) -> None:
        info = self.mesh_info
        world = info.shard_size
        dtypes = {p.compute_dtype for p in self.params}
        uniform = len(dtypes) == 1
        self._uniform = uniform
        self._buffer_dtype = next(iter(dtypes)) if uniform else torch.uint8
        slots: list[_Slot] = []
        row = 0
        for p in self.params:
            if uniform:
                size = p.chunk_numel
            else:
                misalign = row % _BYTE_ALIGNMENT
                if misalign:
                    slots.append(_Slot(None, row, _BYTE_ALIGNMENT - misalign))
                    row += _BYTE_ALIGNMENT - misalign
                size = p.chunk_numel * p.compute_dtype.itemsize
            slots.append(_Slot(p, row, size))
            row += size
        self._slots = slots
        self._row = row
        self._world = world
        self._alias = (
            world == 1
            and not self.offload
            and all(p.compute_dtype == p.orig_dtype for p in self.params)
        )
        self._fused_copy_out = all(p.shard_dim == 0 for p in self.params)
        # Whether the all-gather over the shard group takes this rank's row of its
        # output as input (NCCL; gloo by broadcasts) or a separate send buffer.
        self._gather_in_place = world == 1 or _collectives.gathers_in_place(
            self.shard_group, row * self._buffer_dtype.itemsize, info.device
        )
        # This rank's shards fill its row without gaps (same dtype, no padding in
        # its slots): copy-in is one concatenation.
        self._dense_copy_in = uniform and all(
            s.param is not None and s.param.local_numel == s.size for s in slots
        )
        self._copy_out_sizes: dict[int, list[int]] = {}
        device = info.device
        if self._alias:
            self._unsharded = None
            for p in self.params:
                p.unsharded_param = p.wrap_unsharded(p.local_shard)
            return
        # Views are created while the storage exists (slicing checks bounds), then
        # the storage is freed until the first unshard.
        flat = torch.empty(world * row, dtype=self._buffer_dtype, device=device)
        self._unsharded = flat
        for slot in slots:
            sp = slot.param
            if sp is None:
                continue
            start = world * slot.offset
            if uniform:
                view = flat[start : start + sp.orig_numel]
            else:
                view = flat[start : start + sp.orig_numel * sp.compute_dtype.itemsize].view(
                    sp.compute_dtype
                )
            sp.unsharded_param = sp.wrap_unsharded(view.view(sp.orig_size))
        # Persistent destination views of the copy-out, per gathering world size.
        self._copy_out_targets: dict[int, list[torch.Tensor]] = {}
        self._copy_out_views(world)
        if self._post_forward_group is not None:
            self._copy_out_views(self._post_forward_size)
        _free_storage(flat)

    def _copy_out_views(self, world: int) -> list[torch.Tensor]:
        views = self._copy_out_targets.get(world)
        if views is None:
            assert self._unsharded is not None
            scale = self._world // world
            views = [
                self._unsharded[self._world * s.offset : self._world * (s.offset + s.size)].view(
                    world, s.size * scale
                )
                for s in self._slots
            ]
            self._copy_out_targets[world] = views
        return views

    # ------------------------------------------------------------------
    # unshard / reshard
    # ------------------------------------------------------------------

    @property
    def gather_in_flight(self) -> bool:
        return self._pending_gather is not None

    def unshard(self) -> None:
        """Issues the all-gather of the unit's parameters (asynchronously).

        A no-op if the parameters are already unsharded or being gathered.
        """
        if self.state is ShardState.UNSHARDED or self._pending_gather is not None:
            return
        self.lazy_init()
        if self._alias:
            self._pending_gather = _DONE
            return
        device = self.mesh_info.device
        comm = self.custom_all_gather
        if comm is not None and self._world > 1:
            self._unshard_with(comm)
            return
        if self.state is ShardState.PARTIALLY_SHARDED:
            assert self._post_forward_group is not None and self._post_forward_shard is not None
            world, group, in_place = self._post_forward_size, self._post_forward_group, False
            route = self._post_forward_route
            send = self._post_forward_shard
            out = torch.empty(world * send.numel(), dtype=send.dtype, device=device)
        else:
            world, group, in_place = self._world, self.shard_group, self._gather_in_place
            route = self._route
            out = torch.empty(world * self._row, dtype=self._buffer_dtype, device=device)
            if in_place:  # NCCL, and gloo by broadcasts: copy straight into this rank's row
                send = out.view(world, self._row)[self.mesh_info.shard_rank]
            else:
                # gloo's own all-gather is slower in place (input a view of the
                # output; 6.3 ms vs 4.5 ms for 7 MiB at W=2): send a copy.
                send = torch.empty(self._row, dtype=self._buffer_dtype, device=device)
            self._copy_in(send)
        self._gather_output, self._gather_world = out, world
        if world == 1:
            self._pending_gather = _DONE
        else:
            self._pending_gather = _collectives.all_gather(
                out, send, group, self.name, in_place=in_place, route=route
            )

    def _unshard_with(self, comm: AllGatherComm) -> None:
        """``unshard`` through a custom all-gather: like FSDP2, the output comes from
        ``comm.allocate`` and this rank's input is its row of that output."""
        device = self.mesh_info.device
        if self.state is ShardState.PARTIALLY_SHARDED:
            assert self._post_forward_group is not None and self._post_forward_shard is not None
            world, group, rank = (
                self._post_forward_size,
                self._post_forward_group,
                self._post_forward_rank,
            )
            row_numel, dtype = self._post_forward_shard.numel(), self._post_forward_shard.dtype
        else:
            world, group, rank = self._world, self.shard_group, self.mesh_info.shard_rank
            row_numel, dtype = self._row, self._buffer_dtype
        out = _allocated(comm, world * row_numel, dtype, device, f"{self.name}'s custom all-gather")
        send = out.view(world, row_numel)[rank]
        if self.state is ShardState.PARTIALLY_SHARDED:
            assert self._post_forward_shard is not None
            send.copy_(self._post_forward_shard)
        else:
            self._copy_in(send)
        self._gather_output, self._gather_world = out, world
        self._pending_gather = _collectives.all_gather(out, send, group, self.name, comm=comm)

    @property
    def _rs_what(self) -> str:
        return f"{self.name}'s custom reduce-scatter"

    def _copy_in(self, row: torch.Tensor) -> None:
        """Writes each local shard (cast to its compute dtype) into its slot of
        ``row``; padding is left as is (never read back). No autograd: neither
        side requires grad, so no ``no_grad`` context is needed (hot path)."""
        self._gathered_versions = [p.data_version() for p in self.params]
        if self._dense_copy_in:
            srcs = [self._copy_in_source(p).view(-1) for p in self.params]
            torch.cat(srcs, out=row) if len(srcs) > 1 else row.copy_(srcs[0])
            return
        dsts, srcs = [], []
        byte_mode = not self._uniform
        for slot in self._slots:
            p = slot.param
            if p is None or p.local_numel == 0:
                continue
            if byte_mode:
                item = p.compute_dtype.itemsize
                dst = row[slot.offset : slot.offset + p.local_numel * item].view(p.compute_dtype)
            else:
                dst = row[slot.offset : slot.offset + p.local_numel]
            dsts.append(dst)
            srcs.append(self._copy_in_source(p).reshape(-1))
        if dsts:
            torch._foreach_copy_(dsts, srcs)

    def _copy_in_source(self, p: ShardedParam) -> torch.Tensor:
        src = p.local_shard
        if self.offload:
            src = src.to(self.mesh_info.device, non_blocking=True)
        return src.contiguous()

    def wait_unshard(self) -> None:
        """Waits for the pending all-gather and registers the unsharded parameters."""
        pending = self._pending_gather
        if pending is None:
            return
        pending.wait()
        self._pending_gather = None
        if not self._alias:
            self._copy_out()
            assert self._unsharded is not None
            self._unsharded_version = self._unsharded._version
        self._post_forward_shard = None
        self._register_unsharded()
        self.state = ShardState.UNSHARDED

    def _copy_out(self) -> None:
        out, world = self._gather_output, self._gather_world
        self._gather_output = None
        assert out is not None and self._unsharded is not None
        _alloc_storage(self._unsharded)
        scale = self._world // world
        # Refilling storage autograd may have saved is not a modification: keep
        # the version (see [Note: unsharded storage]). Nothing here requires grad.
        version = self._unsharded._version
        try:
            rows = out.view(world, -1)
            if self._fused_copy_out:
                sizes = self._copy_out_sizes.get(world)
                if sizes is None:
                    sizes = self._copy_out_sizes[world] = [s.size * scale for s in self._slots]
                torch.split_with_sizes_copy(rows, sizes, dim=1, out=self._copy_out_views(world))
            else:  # some parameter is sharded on a dim > 0 (needs a permuted copy)
                self._copy_out_per_param(rows, scale)
        finally:
            _compat.restore_version(self._unsharded, version)

    def _copy_out_per_param(self, rows: torch.Tensor, scale: int) -> None:
        with torch.no_grad():  # writes through the unsharded parameters (leaves)
            for slot in self._slots:
                p = slot.param
                if p is None:
                    continue
                block = rows[:, slot.offset * scale : (slot.offset + slot.size) * scale]
                if block.dtype != p.compute_dtype:  # byte buffers: reinterpret
                    block = block.view(p.compute_dtype)
                if p.shard_dim == 0:
                    flat = p.unsharded_local.view(-1)
                    full = p.orig_numel // p.chunk_numel
                    flat[: full * p.chunk_numel].view(full, -1).copy_(block[:full])
                    rest = p.orig_numel - full * p.chunk_numel
                    if rest:
                        flat[full * p.chunk_numel :].copy_(block[full, :rest])
                else:
                    p.unsharded_local.copy_(p.unsharded_from_rank_chunks(block))

    def params_changed_since_unshard(self) -> bool:
        """True if a sharded parameter was written (e.g. by the optimizer) after the
        unsharded copy was gathered, so the unsharded copy is stale."""
        if self._alias or not self._gathered_versions:
            return False
        return any(p.data_version() != v for p, v in zip(self.params, self._gathered_versions))

    def park(self) -> None:
        """Registers the sharded parameters but keeps the unsharded data for the
        next use (see ``_parked``)."""
        if self.state is ShardState.UNSHARDED and not self._parked:
            for p in self.params:
                p.register(p.sharded_param)
            self._parked = True

    def ensure_registered(self) -> None:
        """Registers the unsharded parameters again if the unit was parked."""
        if self._parked:
            self._register_unsharded()

    def _register_unsharded(self) -> None:
        self._parked = False
        for p in self.params:
            unsharded = p.unsharded_param
            assert unsharded is not None
            requires_grad = p.sharded_param.requires_grad
            if unsharded.requires_grad != requires_grad:
                unsharded.requires_grad_(requires_grad)
            p.register(unsharded)

    def reshard(self, *, to_post_forward_group: bool = False) -> None:
        """Frees the unsharded parameters and registers the sharded ones.

        With ``to_post_forward_group`` (``reshard_after_forward=int``), keeps this
        rank's share of the parameters for its smaller group so that backward
        all-gathers within that group only.
        """
        if self._pending_gather is not None:
            # Gathered but never used (a mistargeted prefetch): the collective still
            # writes into the buffer, so it must complete before the buffer is freed.
            self._pending_gather.wait()
            self._pending_gather = None
            self._gather_output = None
            if self.state is ShardState.PARTIALLY_SHARDED and not to_post_forward_group:
                self._post_forward_shard = None
                self.state = ShardState.SHARDED
            return
        if self.state is ShardState.SHARDED:
            return
        if self.state is ShardState.PARTIALLY_SHARDED:
            if not to_post_forward_group:
                self._post_forward_shard = None
                self.state = ShardState.SHARDED
            return
        if self._unsharded is not None and self._unsharded._version != self._unsharded_version:
            warnings.warn(
                f"fsdp_compose: parameters of unit {self.name!r} were modified in place while "
                "unsharded (e.g. under torch.no_grad() during forward); resharding discards the "
                "change. Modify parameters outside forward/backward, where they are the sharded "
                "DTensors that the optimizer updates.",
                stacklevel=3,
            )
        keep_share = to_post_forward_group and self._post_forward_group is not None
        if keep_share:
            self._post_forward_shard = self._pack_post_forward_shard()
        for p in self.params:
            p.register(p.sharded_param)
        self._parked = False
        if self._unsharded is not None:
            _free_storage(self._unsharded)
        self.state = ShardState.PARTIALLY_SHARDED if keep_share else ShardState.SHARDED

    def abandon_gather(self) -> None:
        """Forgets a gather whose collective failed (its wait raised): there is
        nothing to wait for any more, only state to clear."""
        self._pending_gather = None
        self._gather_output = None

    def _pack_post_forward_shard(self) -> torch.Tensor:
        # This rank keeps rows [i*k, (i+1)*k) of every parameter block, k = W / N:
        # exactly what an all-gather over its N-rank group must contribute to
        # rebuild the (W, S) rank-major gather layout in backward.
        assert self._unsharded is not None
        k = self._world // self._post_forward_size
        i = self._post_forward_rank
        pieces = [
            self._unsharded[
                self._world * s.offset + i * k * s.size : self._world * s.offset
                + (i + 1) * k * s.size
            ]
            for s in self._slots
        ]
        return torch.cat(pieces)

    # ------------------------------------------------------------------
    # gradients
    # ------------------------------------------------------------------

    def accumulate_unsharded_grads(self) -> None:
        """Without gradient sync, keeps gradients unsharded for the next backward,
        upcast to the reduce dtype if that differs from the compute dtype."""
        for p in self.trainable_params:
            up = p.unsharded_param
            if up is None or up.grad is None:
                continue
            if self.reduce_dtype is None or up.grad.dtype == self.reduce_dtype:
                continue
            grad = p.local_grad(up.grad)  # kept as a plain (TP-local) tensor
            up.grad = None
            if p.accumulated_grad is None:
                p.accumulated_grad = grad.to(self.reduce_dtype)
            else:
                p.accumulated_grad.add_(grad)

    def has_unsharded_grads(self) -> bool:
        return any(
            p.accumulated_grad is not None
            or (p.unsharded_param is not None and p.unsharded_param.grad is not None)
            for p in self.trainable_params
        )

    def discard_unsharded_grads(self) -> None:
        for p in self.params:
            p.accumulated_grad = None
            if p.unsharded_param is not None:
                p.unsharded_param.grad = None
        self._partial_reduce.clear()

    def merge_partial_reduce(
        self, params: list[ShardedParam], sizes: list[int], output: torch.Tensor
    ) -> None:
        """Adds gradient sums kept from steps without all-reduce into ``output``."""
        if not self._partial_reduce:
            return
        offset = 0
        for p, size in zip(params, sizes):
            kept = self._partial_reduce.pop(p, None)
            if kept is not None:
                output[offset : offset + p.local_numel].add_(kept)
            offset += size

    def keep_partial_reduce(
        self, params: list[ShardedParam], sizes: list[int], output: torch.Tensor
    ) -> None:
        offset = 0
        for p, size in zip(params, sizes):
            piece = output[offset : offset + p.local_numel]
            kept = self._partial_reduce.get(p)
            self._partial_reduce[p] = piece.clone() if kept is None else kept.add_(piece)
            offset += size

    def take_unsharded_grads(self) -> tuple[list[ShardedParam], list[torch.Tensor]]:
        """Removes and returns the unsharded gradients (including those accumulated
        without sync) of the parameters that received one."""
        params, grads = [], []
        for p in self.trainable_params:
            up = p.unsharded_param
            grad = p.local_grad(up.grad) if up is not None and up.grad is not None else None
            if p.accumulated_grad is not None:
                if grad is not None:
                    p.accumulated_grad.add_(grad)
                grad, p.accumulated_grad = p.accumulated_grad, None
            if grad is None:
                if not self.reduce_scatter_unused_params or up is None:
                    continue
                # Keep the collective's size identical on ranks where this
                # parameter got no gradient (conditional branches, MoE).
                grad = torch.zeros(p.orig_size, dtype=p.compute_dtype, device=self.mesh_info.device)
            if up is not None:
                up.grad = None
            params.append(p)
            grads.append(grad)
        return params, grads

    def reduce_grads(
        self, params: list[ShardedParam], grads: list[torch.Tensor], *, all_reduce: bool
    ) -> PendingReduction | None:
        """Packs ``grads`` and issues their reduce-scatter (one collective), then
        (HSDP) all-reduce; returns the pending reduction, or None if nothing to do."""
        if not params:
            return None
        info = self.mesh_info
        world = info.shard_size
        if self._alias and not info.is_hsdp and self.gradient_divide_factor is None:
            # One rank, no casts: the unsharded gradient is the sharded gradient.
            for p, g in zip(params, grads):
                _assign_sharded_grad(p, g)
            return None
        reduce_dtype = self.reduce_dtype or grads[0].dtype
        pre, post = _divide_factors(
            info.data_parallel_size, reduce_dtype, self.gradient_divide_factor
        )
        sizes = [p.chunk_numel for p in params]
        row = sum(sizes)
        comm = self.custom_reduce_scatter if world > 1 else None
        if comm is not None:  # like FSDP2: both buffers come from the comm
            packed = _allocated(comm, world * row, reduce_dtype, info.device, self._rs_what)
        else:
            packed = torch.empty(world * row, dtype=reduce_dtype, device=info.device)
        # Gradients from autograd do not require grad: no no_grad context needed.
        chunks = [g if p.shard_dim == 0 else p.rank_chunks(g, world) for p, g in zip(params, grads)]
        if len({c.dtype for c in chunks}) > 1:
            # Mixed compute dtypes (reduce_dtype set): the fused pack takes one input dtype.
            chunks = [c.to(reduce_dtype) for c in chunks]
        _compat.chunk_cat(chunks, world, packed.view(world, row))
        if pre != 1:
            packed.div_(pre)
        if world == 1:
            output, rs = packed, None
        else:
            if comm is not None:
                output = _allocated(comm, row, reduce_dtype, info.device, self._rs_what)
            else:
                output = torch.empty(row, dtype=reduce_dtype, device=info.device)
            group = self.reduce_scatter_group or self.shard_group
            rs = _collectives.reduce_scatter(
                output, packed, group, self.name, comm=comm, route=self._rs_route
            )
        replicate_group = info.replicate_group if all_reduce else None
        return PendingReduction(self, params, sizes, output, rs, replicate_group, post)


def _allocated(
    comm: AllGatherComm | ReduceScatterComm,
    numel: int,
    dtype: torch.dtype,
    device: torch.device,
    what: str,
) -> torch.Tensor:
    """A communication buffer from a custom comm's ``allocate``, checked."""
    buffer = comm.allocate((numel,), dtype=dtype, device=device)
    if (
        not isinstance(buffer, torch.Tensor)
        or buffer.numel() != numel
        or buffer.dtype != dtype
        or buffer.device != device
        or not buffer.is_contiguous()
    ):
        got = (
            f"a {'contiguous' if buffer.is_contiguous() else 'non-contiguous'} tensor of "
            f"{buffer.numel()} {buffer.dtype} elements on {buffer.device}"
            if isinstance(buffer, torch.Tensor)
            else type(buffer).__name__
        )
        raise ValueError(
            f"{what}: allocate() returned {got}, but {numel} contiguous {dtype} elements "
            f"on {device} were asked for"
        )
    return buffer.view(-1)


class PendingReduction:
    """A unit's gradients on their way: reduce-scatter, then (HSDP) all-reduce,
    then division and hand-off to the sharded parameters' ``.grad``."""

    def __init__(
        self,
        unit: Unit,
        params: list[ShardedParam],
        sizes: list[int],
        output: torch.Tensor,
        reduce_scatter: PendingCollective | None,
        replicate_group: dist.ProcessGroup | None,
        post_divide: float,
    ) -> None:
        self.unit = unit
        self._params = params
        self._sizes = sizes
        self._output: torch.Tensor | None = output
        self._reduce_scatter = reduce_scatter
        self._replicate_group = replicate_group
        self._all_reduce: PendingCollective | None = None
        self._post_divide = post_divide
        self._scattered = False
        # HSDP without all-reduce this step: keep the sums for a later all-reduce.
        self._keep_partial = unit.mesh_info.is_hsdp and replicate_group is None
        self.done = False

    def _hook_sees_average(self, dtype: torch.dtype) -> bool:
        # FSDP2 reduces float32/bfloat16 with ReduceOp.AVG unless a divide factor
        # or force-sum is set, so its all-reduce hook receives the average; with
        # SUM it receives the sum and divides after the hook. Same here.
        unit = self.unit
        return (
            unit.gradient_divide_factor is None
            and not unit.force_sum_reduction
            and dtype in (torch.float32, torch.bfloat16)
        )

    def advance(self) -> None:
        """Completes the reduce-scatter (freeing its full-size buffers) and starts
        the replicate all-reduce if there is one, without waiting for the latter."""
        if self._scattered or self.done:
            return
        if self._reduce_scatter is not None:
            self._reduce_scatter.wait()
            self._reduce_scatter = None
        self._scattered = True
        assert self._output is not None
        if self._keep_partial:
            return
        self.unit.merge_partial_reduce(self._params, self._sizes, self._output)
        if self._replicate_group is not None:
            self._all_reduce = _collectives.all_reduce(
                self._output, self._replicate_group, self.unit.name
            )

    def finish(self) -> None:
        """Completes the reduction and accumulates into the sharded ``.grad``."""
        if self.done:
            return
        self.advance()
        if self._all_reduce is not None:
            self._all_reduce.wait()
            self._all_reduce = None
        output = self._output
        assert output is not None
        with torch.no_grad():
            if self._keep_partial:
                self.unit.keep_partial_reduce(self._params, self._sizes, output)
            else:
                hook, post = self.unit.all_reduce_hook, self._post_divide
                if hook is not None and post != 1 and self._hook_sees_average(output.dtype):
                    output.div_(post)
                    post = 1
                if hook is not None:
                    hook(output)
                if post != 1:
                    output.div_(post)
                offset, copies_in_flight = 0, False
                for p, size in zip(self._params, self._sizes):
                    local = output[offset : offset + p.local_numel].view(p.local_shape)
                    copies_in_flight |= _assign_sharded_grad(p, local, self.unit.pin_memory)
                    offset += size
                if copies_in_flight:
                    # The optimizer reads the offloaded gradients on the CPU right
                    # after backward returns: block until the copies have landed.
                    _device_sync_point(self.unit.mesh_info.device).synchronize()
        self._release()

    def discard(self) -> None:
        """Waits for in-flight collectives (their buffers must outlive them) and
        drops the result."""
        for pending in (self._reduce_scatter, self._all_reduce):
            if pending is not None:
                pending.wait()
        self._reduce_scatter = self._all_reduce = None
        self._release()

    def _release(self) -> None:
        self.done = True
        self._output = None
        self._params = []


def _assign_sharded_grad(
    p: ShardedParam, local_grad: torch.Tensor, pin_memory: bool = False
) -> bool:
    """Stores (or accumulates) a reduced local gradient as ``p``'s sharded ``.grad``
    in the parameter's original dtype, on the CPU when offloaded.

    Returns True if an asynchronous device-to-host copy is still in flight; the
    caller must synchronize before the CPU reads the gradient.
    """
    if local_grad.dtype != p.orig_dtype:
        local_grad = local_grad.to(p.orig_dtype)  # cast on the device, before the copy
    param = p.sharded_param
    existing = param.grad
    in_flight = False
    if p.offload_device is not None:
        # Asynchronous only into a fresh pinned gradient that nothing reads on the
        # CPU before the caller's synchronization: accumulating into an existing
        # gradient, or a post-accumulate-grad hook (optimizer in backward), would
        # read the destination while the copy may still be running.
        in_flight = (
            pin_memory
            and existing is None
            and not getattr(param, "_post_accumulate_grad_hooks", None)
        )
        local_grad = local_grad.to(p.offload_device, non_blocking=in_flight)
    if local_grad.shape != p.local_shape:
        local_grad = local_grad.reshape(p.local_shape)
    if existing is None:
        param.grad = p.make_sharded_grad(local_grad)
    else:
        _compat.local_tensor(existing).add_(local_grad)
    # Like autograd's AccumulateGrad, run the hooks registered with
    # register_post_accumulate_grad_hook (e.g. optimizer-in-backward).
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    if hooks:
        for hook in tuple(hooks.values()):
            hook(param)
    return in_flight


def _device_sync_point(device: torch.device) -> torch.Event:
    """An event recorded on ``device``'s current stream (after all work issued so far)."""
    module = getattr(torch, device.type)
    return module.current_stream(device).record_event()


@functools.cache
def _divide_factors(world: int, dtype: torch.dtype, custom: float | None) -> tuple[float, float]:
    """How to average over ``world`` ranks: (divide before the sum, divide after).

    Full precision divides once, after the sum (closest to a single-process mean).
    Low precision splits the division around the sum to avoid both overflow and
    underflow, using powers of two so the pre-division is exact.
    """
    if custom is not None:
        return 1.0, float(custom)
    if dtype.itemsize >= 4:
        return 1.0, float(world)
    pre = 1
    while world % (pre * 2) == 0 and world / (pre * 2) >= pre * 2:
        pre *= 2
    return float(pre), world / pre


def _alloc_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def _free_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


class _Done(PendingCollective):
    """A pending collective that was complete when issued (one-rank groups)."""

    def __init__(self) -> None:
        super().__init__(None)
        self._done = True

    def wait(self) -> None:
        return


_DONE = _Done()


def unit_summary(units: Sequence[Unit]) -> str:
    """One line per unit, for logs and error messages."""
    return "\n".join(f"  {u.name}: {len(u.params)} params, state={u.state.value}" for u in units)
