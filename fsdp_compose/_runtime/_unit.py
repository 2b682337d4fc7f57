"""A unit: the parameters of one ``fully_shard`` call, all-gathered and reduce-scattered
together (one collective each). It knows *how* to unshard, reshard and reduce; the
scheduler decides *when*."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _collectives, _compat, _ownership
from ._collectives import (
    AllGather,
    DefaultAllGather,
    DefaultReduceScatter,
    PendingCollective,
    ReduceScatter,
)
from ._events import Events, GatherInput, ParamInfo, UnitEvent, UnitInfo, UnitOptionsInfo
from ._extensions import ExtensionGather, has_extension
from ._flat_buffer import FlatBuffer
from ._mesh import MeshInfo, post_forward_subgroup
from ._policies import MixedPrecisionPolicy
from ._reduce import GradientReducer
from ._sharded_param import ShardedParam

__all__ = ["ShardState", "TrainingState", "Unit", "UnitOptions", "check_step"]

_unit_ids = itertools.count()  # UnitInfo.id: unique in the process, never reused


@dataclasses.dataclass(frozen=True)
class UnitOptions:
    """A unit's user settings (``reshard_after_forward`` and the ``FSDPModule.set_*``
    ones); replaced whole by :meth:`Unit.configure`, so a reader holds one set."""

    reshard_after_forward: bool | int = True
    reshard_after_backward: bool = True
    requires_gradient_sync: bool = True
    requires_all_reduce: bool = True  # HSDP: all-reduce across replicas
    sharded_accumulation: bool = False  # set_gradient_accumulation: [Note: pending gradients]
    gradient_divide_factor: float | None = None  # None: the data-parallel size
    reduce_scatter_unused_params: bool = False
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    force_sum_reduction: bool = False  # set_force_sum_reduction_for_comms
    unshard_in_backward: bool = True
    keep_unsharded_storage: bool = False  # resharding frees nothing
    reduce_scatter_group: dist.ProcessGroup | None = None  # None: the shard group
    # This unit's Comm objects ([Note: Comm objects]).
    all_gather_comm: AllGather = dataclasses.field(default_factory=DefaultAllGather)
    reduce_scatter_comm: ReduceScatter = dataclasses.field(default_factory=DefaultReduceScatter)
    # Explicit prefetch targets (set_modules_to_*_prefetch); None: implicit order.
    forward_prefetch: tuple[Unit, ...] | None = None
    backward_prefetch: tuple[Unit, ...] | None = None


class ShardState(Enum):
    """Where a unit's parameter data currently lives."""

    SHARDED = "sharded"  # only the sharded DTensors exist; they are registered
    UNSHARDED = "unsharded"  # full parameters allocated and registered
    PARTIALLY_SHARDED = "partially_sharded"  # after forward, sharded over a smaller group

    __hash__ = object.__hash__  # as TrainingState's, below


_TRANSITIONS = {
    ShardState.SHARDED: (ShardState.UNSHARDED,),
    ShardState.UNSHARDED: (ShardState.SHARDED, ShardState.PARTIALLY_SHARDED),
    ShardState.PARTIALLY_SHARDED: (ShardState.UNSHARDED, ShardState.SHARDED),
}


class TrainingState(Enum):
    """Where a unit, or its root's step, is in the training step: FSDP2's
    ``TrainingState``, plus the two states of manual finalization (the root's only)."""

    IDLE = "idle"  # between forward and backward, or between steps
    FORWARD = "forward"  # from pre-forward to post-forward
    PRE_BACKWARD = "pre_backward"  # backward running: gradients being computed
    POST_BACKWARD = "post_backward"  # a unit: gradients handed to its reducer; a root: finalizing
    # Manual finalization (FSDPModule.set_manual_backward_finalization): backward is done
    # and its reductions wait for FSDPModule.finalize_backward, across later forwards too.
    AWAITING_FINALIZE = "awaiting_finalize"
    REDUCTION_PENDING = "reduction_pending"  # finalize_backward(async_op=True) not waited on

    # Members are singletons: hashed by identity, in C, rather than by Enum's Python-level
    # hash of the name (check_step looks a state up several times per unit per step).
    __hash__ = object.__hash__


# [Note: step state]
# A unit and its root's scheduler each hold a TrainingState, changed only through
# ``check_step`` against one of the tables below: a hook arriving in an order the
# runtime does not expect is reported at once, naming the unit (or root) and both
# states, instead of surfacing later as a hang or a lost gradient. A unit may run
# backward more than once per step (a module called twice in forward: PRE_BACKWARD
# again after POST_BACKWARD; a grouped unit's modules recomputed one by one inside
# backward by reentrant checkpointing: FORWARD after POST_BACKWARD), and finalization
# reaches units whose backward never ran (IDLE -> POST_BACKWARD), or none (IDLE ->
# IDLE). The root's step adds manual finalization: backward ends in AWAITING_FINALIZE
# (and forward passes that accumulate more gradients return to it) while
# ``FSDPModule.finalize_backward`` has not run, and an asynchronous finalize stays
# REDUCTION_PENDING until its handle is waited on.
# ``Scheduler.reset`` (``reset_iter_state``) returns every state to IDLE from anywhere.
_S = TrainingState
# From each state, the states a unit may go to next; then those of the root's step.
UNIT_STEPS = {
    _S.IDLE: (_S.IDLE, _S.FORWARD, _S.PRE_BACKWARD, _S.POST_BACKWARD),
    _S.FORWARD: (_S.IDLE,),
    _S.PRE_BACKWARD: (_S.POST_BACKWARD, _S.IDLE),
    _S.POST_BACKWARD: (_S.PRE_BACKWARD, _S.POST_BACKWARD, _S.IDLE, _S.FORWARD),
}
ROOT_STEPS = {
    _S.IDLE: (_S.IDLE, _S.FORWARD, _S.PRE_BACKWARD, _S.REDUCTION_PENDING),
    _S.FORWARD: (_S.IDLE, _S.AWAITING_FINALIZE),
    _S.PRE_BACKWARD: (_S.POST_BACKWARD,),
    _S.POST_BACKWARD: (_S.IDLE, _S.AWAITING_FINALIZE),
    _S.AWAITING_FINALIZE: (_S.FORWARD, _S.PRE_BACKWARD, _S.IDLE, _S.REDUCTION_PENDING),
    _S.REDUCTION_PENDING: (_S.IDLE,),
}


def check_step(table: dict[_S, tuple[_S, ...]], who: object, current: _S, to: _S) -> _S:
    """Returns ``to`` if ``table`` allows ``current -> to``; else raises an
    ``AssertionError`` naming ``who`` (a unit, or "the root"): a bug in the runtime
    ([Note: step state]). Called several times per unit per step, so ``who`` is
    formatted only when the check fails."""
    assert to in table[current], f"fsdp_compose: {who} went from {current.name} to {to.name}"
    return to


class Unit:
    """The parameter group of one :func:`fully_shard` call: its ``params`` (in
    registration order) of the annotated ``modules``, with the call's mesh and policies."""

    def __init__(
        self,
        params: list[ShardedParam],
        modules: tuple[nn.Module, ...],
        mesh_info: MeshInfo,
        reshard_after_forward: bool | int,
        mp_policy: MixedPrecisionPolicy,
        events: Events,
    ) -> None:
        self.params = params
        for param in params:  # so that the tools find the root of a parameter
            _ownership.record_unit(param, self)
        self.modules = modules
        self.mesh_info = mesh_info
        self.mp_policy = mp_policy
        # Any parameter on the host ([Note: per-parameter offload]; never on a CPU mesh).
        self.offload = any(p.offload_device is not None for p in params)
        self.name = type(modules[0]).__name__  # refined to the module's FQN at lazy init
        self.id = next(_unit_ids)
        self._info: UnitInfo | None = None  # what observers see; None: to be (re)built
        self.options = UnitOptions()
        self.state = ShardState.SHARDED
        self.training_state = TrainingState.IDLE  # [Note: step state]
        # The tree's event list (and step count), shared by its units: the call's own
        # until an enclosing fully_shard call adopts it (attach).
        self.events = events
        self.reducer = GradientReducer(self)
        self.reduce_dtype: torch.dtype | None = None  # set at lazy init
        # Also set at lazy init: the dtype unsynchronized gradients accumulate in (None:
        # the gradient's own; [Note: pending gradients] in _reduce.py).
        self.accumulate_dtype: torch.dtype | None = None
        # With reshard_after_forward=N: the N-rank group backward gathers in.
        self._post_forward_group: dist.ProcessGroup | None = None
        self._post_forward_rank = 0
        self.set_reshard_after_forward(reshard_after_forward)
        # Made at lazy init (None: not initialized): the flat buffer, or the
        # per-parameter gather of units with all-gather extension parameters.
        self.buffer: FlatBuffer | None = None
        self.extension: ExtensionGather | None = None
        self._pending_gather: PendingCollective | None = None
        self._gather_output: torch.Tensor | None = None  # (world, row) while gathering
        self._gather_world = 0
        self._post_forward_shard: torch.Tensor | None = None
        # Parked: the shards registered (for the optimizer) after a no-grad forward,
        # the gathered data kept for the next use.
        self._parked = False
        self._gathered_versions: list[int] = []

    def __repr__(self) -> str:
        return f"unit {self.name!r}"

    # -- configuration ---------------------------------------------------

    def attach(self, events: Events) -> None:
        """Reports to ``events`` from now on: those of the tree that an enclosing
        ``fully_shard`` call (or the root's lazy init) made this unit part of."""
        assert self.training_state is TrainingState.IDLE, f"unit {self.name!r} is in a step"
        self.events = events

    def enter(self, to: TrainingState) -> None:
        """Moves this unit to training state ``to`` ([Note: step state])."""
        self.training_state = check_step(UNIT_STEPS, self, self.training_state, to)

    def configure(self, **changes: Any) -> None:
        """Replaces the named :class:`UnitOptions` fields (but not
        ``reshard_after_forward``: :meth:`set_reshard_after_forward`)."""
        assert "reshard_after_forward" not in changes
        self.options = dataclasses.replace(self.options, **changes)
        self._info = None

    def set_reshard_after_forward(self, value: bool | int) -> None:
        # The scheduler reshards (its memory accounting follows every state change).
        assert self.state is not ShardState.PARTIALLY_SHARDED, (
            f"unit {self.name!r}: reshard (through the scheduler) before changing "
            "reshard_after_forward"
        )
        self._post_forward_group = None
        if not isinstance(value, bool):
            if any(p.extension for p in self.params):
                raise NotImplementedError(  # as in FSDP2
                    "reshard_after_forward as an int is not supported with parameters using "
                    f"all-gather extensions: {[p.fqn for p in self.params if p.extension]}"
                )
            if any(p.shard_dim != 0 for p in self.params):
                raise ValueError(
                    "reshard_after_forward as an int needs every parameter sharded on dim 0; "
                    "shard_placement_fn chose another dim for "
                    f"{[p.fqn for p in self.params if p.shard_dim != 0]}"
                )
            subgroup = post_forward_subgroup(self.mesh_info, value)
            self._post_forward_group, self._post_forward_rank = subgroup
        self.options = dataclasses.replace(self.options, reshard_after_forward=value)
        self._info = None

    @property
    def trainable_params(self) -> list[ShardedParam]:
        return [p for p in self.params if p.sharded_param.requires_grad]

    @property
    def aliases_shards(self) -> bool:
        """Whether the unsharded parameters are the local shards themselves (one
        rank, no cast): nothing to gather or free."""
        return self.buffer is not None and self.buffer.alias

    @property
    def unsharded_nbytes(self) -> int:
        """Bytes the unsharded parameters occupy (what the rate limiter budgets)."""
        gather = self.extension or self.buffer
        assert gather is not None, f"unit {self.name!r}: unsharded_nbytes before lazy_init"
        return gather.nbytes

    # -- what observers see ([Note: observer values]) ----------------------

    @property
    def info(self) -> UnitInfo:
        """This unit's description for observers, built when first asked for after a change."""
        return self._info if self._info is not None else self.describe()

    def describe(self) -> UnitInfo:
        """(Re)builds :attr:`info`: when asked for after a change, and at the root's lazy
        init, once names and FQNs are final."""
        options, mesh, mp = self.options, self.mesh_info, self.mp_policy
        plain = {f.name for f in dataclasses.fields(UnitOptionsInfo)}  # those UnitOptions has
        settings = UnitOptionsInfo(
            **{name: value for name, value in vars(options).items() if name in plain},
            param_dtype=mp.param_dtype,
            reduce_dtype=mp.reduce_dtype,
            offload=self.offload,
            custom_all_gather=not isinstance(options.all_gather_comm, DefaultAllGather),
            custom_reduce_scatter=not isinstance(options.reduce_scatter_comm, DefaultReduceScatter),
        )
        params = tuple(
            ParamInfo(
                p.fqn, tuple(p.orig_size), p.sharded_param.dtype, p.sharded_param.requires_grad
            )
            for p in self.params
        )
        replicate = mesh.replicate_group
        self._info = UnitInfo(
            self.id,
            self.name,
            params,
            settings,
            mesh.device,
            mesh.shard_group,
            tuple(dist.get_process_group_ranks(mesh.shard_group)),
            mesh.shard_rank,
            replicate,
            () if replicate is None else tuple(dist.get_process_group_ranks(replicate)),
        )
        return self._info

    def info_at(self, event: UnitEvent) -> UnitInfo:
        """:attr:`info` with the values ``event`` carries (see :class:`UnitInfo`)."""
        info = self.info
        if event in ("forward_begin", "backward_begin"):
            versions = tuple([p.data_version() for p in self.params])  # (no generator)
            return info.with_values(sharded_versions=versions)
        if event in ("gathered", "resharding"):
            flat = self.buffer.unsharded if self.buffer is not None else None
            version = None if flat is None else flat._version
            return info.with_values(unsharded_version=version)
        if event == "packed" and self.extension is not None:
            inputs = tuple(
                GatherInput(pg.param.fqn, tuple(tuple(s) for s in pg.sizes), tuple(pg.dtypes))
                for pg in self.extension.params
            )
            return info.with_values(all_gather_inputs=inputs)
        if event == "backward_end":
            missing = tuple(
                p.fqn
                for p in self.trainable_params
                if p.accumulated_grad is None
                and (p.unsharded_param is None or p.unsharded_param.grad is None)
            )
            return info.with_values(without_grad=missing)
        return info

    # -- lazy initialisation: dtypes and buffer layout -------------------

    def invalidate(self) -> None:
        """Forces layout and views to be rebuilt (after ``_apply``/dtype changes)."""
        assert self.state is ShardState.SHARDED and self._pending_gather is None, (
            f"unit {self.name!r} is {self.state.value}: reshard it (through the "
            "scheduler) before invalidating its layout"
        )
        self.extension = self.buffer = None
        self._info = None  # the dtypes may change
        for p in self.params:
            p.unsharded_param = None

    def lazy_init(self) -> None:
        if self.buffer is not None or self.extension is not None:
            return  # (every forward asks: nothing more on this path)
        # The buffers and views made here outlive this call: made inside
        # torch.inference_mode() (an evaluation first), they would be inference
        # tensors, unusable for training ever after; made inside a torch.func
        # transform, its wrappers (see _compat.without_functorch).
        with torch.inference_mode(False), torch._C._DisableFuncTorch():
            for p in self.params:
                p.resync_sharded_param()
                # As FSDP2, which looks at each all-gather: hooks set on a local shard
                # after fully_shard (patched onto the tensor) make it an extension too.
                p.extension = p.extension or (p.tp_spec is None and has_extension(p.local_shard))
                p.pad_local_shard()
            self._check_placement()
            if self.events.on_unit:
                self.events.unit("lazy_init", self.info_at)
            self._init_dtypes()
            if any(p.extension for p in self.params):
                world = self.mesh_info.shard_size
                self.extension = ExtensionGather(self.params, self.mp_policy, world)
            else:
                self.buffer = FlatBuffer(self.params, self.mesh_info, self.offload)
                self._free_unsharded()

    def _check_placement(self) -> None:
        """FSDP2's check at lazy init: every shard materialized, on the mesh's
        device (or the CPU, offloaded)."""
        on_meta = [p.fqn for p in self.params if p.sharded_param.is_meta]
        if on_meta:
            raise RuntimeError(
                f"fully_shard unit {self.name!r} has parameters on the meta device: {on_meta} "
                "(never materialized, or moved there after fully_shard). Before the first "
                "forward, call model.to_empty(device=...), then re-initialize them or load a "
                "state dict."
            )
        expected = self.mesh_info.device
        wrong = [
            (p.fqn, str(p.local_shard.device))
            for p in self.params
            if p.local_shard.device.type != (p.offload_device or expected).type
        ]
        if wrong:
            raise RuntimeError(
                f"fully_shard unit {self.name!r} expects its sharded parameters on the mesh's "
                f"device {expected}{' (or the CPU: offloaded)' if self.offload else ''}, found "
                f"{wrong}. Build the mesh on the intended device instead of moving the module."
            )

    def _init_dtypes(self) -> None:
        for p in self.params:
            p.orig_dtype = p.sharded_param.dtype
            # Packed quantized bytes in a float storage (bitsandbytes' quant_state;
            # FSDP2 casts them, into garbage) keep their dtype: their own state decodes.
            cast = p.param_dtype is not None and p.orig_dtype.is_floating_point
            cast = cast and "quant_state" not in p.attributes
            p.compute_dtype = p.param_dtype if cast else p.orig_dtype  # type: ignore[assignment]
        mp, trainable = self.mp_policy, self.trainable_params
        # reduce_dtype=None: FSDP2 2.15 reduces in the parameters' dtype, earlier
        # releases in the compute dtype; mixed dtypes in their promoted dtype.
        in_orig = _compat.REDUCE_IN_PARAM_DTYPE
        dtypes = {p.orig_dtype if in_orig else p.compute_dtype for p in trainable}
        if mp.grad_dtype is not None:  # every gradient is computed in it
            dtypes = {mp.grad_dtype}
        mixed = mp.reduce_dtype is None and len(dtypes) > 1 and not in_orig
        if mixed and mp.param_dtype_override_fn is None:  # as FSDP2 up to 2.14
            raise ValueError(
                f"fully_shard unit {self.name!r} has trainable parameters of different "
                f"dtypes {sorted(map(str, dtypes))}, but a unit reduces its gradients in one "
                "collective: give them one dtype, set MixedPrecisionPolicy(reduce_dtype=...), "
                "or put them in separate fully_shard units."
            )
        self.reduce_dtype = mp.reduce_dtype
        for dtype in dtypes if mp.reduce_dtype is None else ():
            self.reduce_dtype = torch.promote_types(self.reduce_dtype or dtype, dtype)
        # FSDP2 2.15: autograd hands gradients over in reduce_dtype; with the pending-
        # gradient API, in the explicit reduce_dtype only ([Note: pending gradients]).
        accumulate = mp.reduce_dtype if _compat.PENDING_GRADIENT_API else self.reduce_dtype
        # With MixedPrecisionPolicy.grad_dtype, autograd accumulates in that dtype.
        self.accumulate_dtype = accumulate = None if mp.grad_dtype else accumulate
        for p in self.params:
            cast = in_orig and accumulate not in (None, p.compute_dtype)
            p.grad_dtype = accumulate if cast else mp.grad_dtype
            p.sharded_grad_dtype = mp.grad_dtype or p.orig_dtype
            if mp.grad_dtype is not None and p.sharded_param.requires_grad:
                p.sharded_param.grad_dtype = mp.grad_dtype  # type: ignore[attr-defined]

    # -- unshard / reshard -----------------------------------------------

    @property
    def gather_in_flight(self) -> bool:
        return self._pending_gather is not None

    @property
    def holds_unsharded(self) -> bool:
        """Whether unsharded memory is allocated or being gathered into."""
        return self.state is ShardState.UNSHARDED or self._pending_gather is not None

    @_compat.without_functorch
    def unshard(self) -> None:
        """Issues the all-gather of the unit's parameters (asynchronously); a no-op
        if they are already unsharded or being gathered."""
        if self.holds_unsharded:
            return
        self.lazy_init()
        buffer, info = self.buffer, self.mesh_info
        if buffer is not None and buffer.alias:
            self._pending_gather = _collectives.DONE
            return
        comm, world, group = self.options.all_gather_comm, info.shard_size, info.shard_group
        # Partially sharded: gather this rank's post-forward share in its group.
        shard = self._post_forward_shard if self.state is ShardState.PARTIALLY_SHARDED else None
        if shard is None:
            self._gathered_versions = [p.data_version() for p in self.params]
        if self.extension is not None:
            out, send = self.extension.pack(comm, info, self.name)
            if self.events.on_unit:
                self.events.unit("packed", self.info_at)
        else:
            assert buffer is not None
            rank, row = info.shard_rank, buffer.row
            if shard is not None:
                assert self._post_forward_group is not None
                group, rank, row = self._post_forward_group, self._post_forward_rank, shard.numel()
                world = self.options.reshard_after_forward
            out = buffer.gather_output(comm, self.name)
            send = out.view(world, row)[rank]  # as in FSDP2, the input is a row of the output
            if shard is None:
                send = buffer.copy_in(send)
            else:
                send.copy_(shard)
        self._gather_output, self._gather_world = out, world
        self._pending_gather = (
            _collectives.DONE
            if world == 1
            else _collectives.launch_unit(
                "all_gather", comm, out, send, group, self.name, self.events
            )
        )

    @_compat.without_functorch
    def wait_unshard(self) -> None:
        """Waits for the pending all-gather and registers the unsharded parameters
        (with none pending, registers them again if the unit was parked)."""
        pending = self._pending_gather
        if pending is None:
            if self._parked:
                self._register_unsharded()
            return
        pending.wait()
        self._pending_gather = None
        out, self._gather_output = self._gather_output, None
        if out is not None:  # None: the parameters alias the shards
            gather = self.extension or self.buffer
            assert gather is not None
            gather.copy_out(out, self._gather_world)
            if self.events.on_unit:
                self.events.unit("gathered", self.info_at)
        self._post_forward_shard = None
        self._register_unsharded()
        self._transition(ShardState.UNSHARDED)

    def params_changed_since_unshard(self) -> bool:
        """Whether a sharded parameter was written (e.g. by the optimizer) since the
        unsharded copy was gathered."""
        if self.aliases_shards or not self._gathered_versions:
            return False
        return any(p.data_version() != v for p, v in zip(self.params, self._gathered_versions))

    def park(self) -> None:
        """Registers the sharded parameters but keeps the unsharded data for the
        next use (see ``_parked``)."""
        if self.state is ShardState.UNSHARDED and not self._parked:
            for p in self.params:
                p.register(p.sharded_param)
            self._parked = True

    def _register_unsharded(self) -> None:
        self._parked = False
        for p in self.params:
            unsharded = p.unsharded_param
            assert unsharded is not None
            requires_grad = p.sharded_param.requires_grad
            if unsharded.requires_grad != requires_grad:
                unsharded.requires_grad_(requires_grad)
            p.register(unsharded)

    @_compat.without_functorch
    def reshard(self, *, to_post_forward_group: bool = False) -> None:
        """Frees the unsharded parameters and registers the sharded ones; with
        ``to_post_forward_group`` (``reshard_after_forward=int``) keeps this rank's
        share for its smaller group, within which backward then all-gathers."""
        if self._pending_gather is not None:
            # Gathered but never used (a mistargeted prefetch): the collective still
            # writes into the buffer, so it must complete before the buffer is freed.
            self._pending_gather.wait()
            self.abandon_gather()
        if self.state is not ShardState.UNSHARDED:
            if self.state is ShardState.PARTIALLY_SHARDED and not to_post_forward_group:
                self._post_forward_shard = None
                self._transition(ShardState.SHARDED)
            return
        if self.events.on_unit:
            self.events.unit("resharding", self.info_at)
        keep_share = to_post_forward_group and self._post_forward_group is not None
        if keep_share:
            assert self.buffer is not None and isinstance(self.options.reshard_after_forward, int)
            size, rank = self.options.reshard_after_forward, self._post_forward_rank
            self._post_forward_shard = self.buffer.pack_post_forward_shard(size, rank)
        for p in self.params:
            p.register(p.sharded_param)
        self._parked = False
        self._free_unsharded()
        self._transition(ShardState.PARTIALLY_SHARDED if keep_share else ShardState.SHARDED)

    def abandon_gather(self) -> None:
        """Forgets a gather never used, or whose collective failed (its wait raised).
        One gathered in place keeps the unsharded storage's version counter, as a used
        one does: autograd may have saved that storage in an earlier forward, and
        checks its version when backward reads it."""
        out, self._pending_gather, self._gather_output = self._gather_output, None, None
        if self.buffer is not None and out is not None and out is self.buffer.unsharded:
            self.buffer.copy_out(out, self._gather_world)  # (in place: the version only)

    def _transition(self, to: ShardState) -> None:
        # As FSDP2, every change of where the data lives is one of these.
        assert to in _TRANSITIONS[self.state], f"unit {self.name!r}: {self.state} -> {to}"
        self.state = to

    def _free_unsharded(self) -> None:
        if self.extension is not None:
            self.extension.free()
        elif self.buffer is not None and not self.options.keep_unsharded_storage:
            self.buffer.free()
