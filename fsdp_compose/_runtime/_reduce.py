"""Gradient reduction of a unit: accumulation without sync, packing, the
reduce-scatter, the HSDP all-reduce (or its partial sums kept for later), the
averaging division, and the hand-off to the sharded parameters' ``.grad``.

[Note: pending gradients]
A gradient is *pending* while it is not reduced into the sharded ``.grad``: the
unsharded gradient accumulated with gradient sync disabled (on the unsharded
parameter's ``.grad``, or upcast into ``ShardedParam.accumulated_grad``), and with
HSDP and all-reduce disabled, the reduce-scattered partial sum (``partial_sums``).
FSDP2 2.16's API reads, clears and completes them through this one reducer:
``get_pending_gradients`` returns these very tensors (no copy, no communication, so
in-place changes count and the same objects come back across micro-batches),
``zero_grad`` zeroes or drops them, and ``synchronize_gradients`` reduces them as a
synchronizing backward would (one reduce-scatter, the HSDP all-reduce, the divide
factor) without running one. A parameter with a partial sum joins the
reduce-scatter with zeros when it has no new gradient, so that its sum reaches the
all-reduce instead of waiting for a later one.

The dtype of accumulation while sync is disabled follows the installed torch's
FSDP2, so that a valid program computes what its FSDP2 computes. Up to 2.14, a
backward's gradient is added after it to an accumulator upcast to the unit's reduce
dtype (``accumulate_unsharded_grads``; the compute dtype when ``reduce_dtype`` is
None and the dtypes are uniform). From 2.15 autograd accumulates in the reduce dtype
itself (the unsharded parameter's ``grad_dtype``, set at lazy init), each
contribution added in that dtype; 2.15's reduce dtype for ``reduce_dtype=None`` is
the parameter's own. torch's main branch, which has the pending-gradient API
(``_compat.PENDING_GRADIENT_API``), defines the dtype of accumulation as
``reduce_dtype`` when set, else the gradient's (compute) dtype.

Beyond FSDP2, a unit set to *sharded accumulation*
(``FSDPModule.set_gradient_accumulation("sharded")``) keeps no unsharded gradient
while sync is disabled: each backward's gradient is reduce-scattered (in the reduce
dtype) as a synchronizing one would be, and the local result is kept as a partial
sum, the same mechanism as HSDP without all-reduce, upcast to fp32 (4 bytes per
parameter divided by the shard world size, instead of the unsharded gradient's
size). The synchronizing backward (or ``synchronize_gradients``, or in manual mode
``finalize_backward`` with sync enabled, which then need no reduce-scatter) adds the
sums in fp32 to its own reduce-scatter's output, all-reduces that across HSDP
replicas, and divides and hands it over as usual. It trades memory for bytes sent:
one reduce-scatter per micro-batch instead of one per step. A kept sum is stored as
soon as its reduce-scatter is waited on (``PendingReduction.advance``), so that a
later reduction of the unit, advanced in issue order, finds it even where manual
finalization defers finishing the reductions.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import _collectives, _compat
from ._collectives import PendingCollective
from ._sharded_param import ShardedParam

if TYPE_CHECKING:
    from ._unit import Unit


class GradientReducer:
    """Turns one unit's unsharded gradients into reduced sharded ones, with the
    unit's settings (``unit.options``) read at each reduction."""

    def __init__(self, unit: Unit) -> None:
        self.unit = unit
        # HSDP with set_requires_all_reduce(False): reduce-scattered (not yet
        # all-reduced) gradient sums per parameter, added in at the next all-reduce.
        self.partial_sums: dict[ShardedParam, torch.Tensor] = {}

    def accumulate_unsharded_grads(self) -> None:
        """Without gradient sync, keeps gradients unsharded for the next backward,
        upcast to the reduce dtype if that differs from the gradient's; with the
        pending-gradient API, only to an explicit one ([Note: pending gradients])."""
        reduce_dtype = self.unit.accumulate_dtype  # (decided at lazy init)
        for p in self.unit.trainable_params:
            up = p.unsharded_param
            if up is None or up.grad is None or reduce_dtype in (None, up.grad.dtype):
                continue
            grad = p.local_grad(up.grad)  # kept as a plain (TP-local) tensor
            up.grad = None
            if p.accumulated_grad is None:
                p.accumulated_grad = grad.to(reduce_dtype)
            else:
                p.accumulated_grad.add_(grad)

    def pending_grads(self) -> dict[ShardedParam, tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Each parameter's gradients not reduced yet, (unsharded, HSDP partial sum
        shaped as the local shard), as the tensors that hold them; no communication.
        Without sync, gradients set outside backward's hooks (pipelining's
        ``stage_backward_weight`` assigns ``.grad``) join the accumulator first."""
        if not self.unit.options.requires_gradient_sync:
            self.accumulate_unsharded_grads()
        pending = {}
        for p in self.unit.trainable_params:
            up, partial = p.unsharded_param, self.partial_sums.get(p)
            # (mid-backward, autograd's gradient is added to the accumulator after it)
            unreduced = p.accumulated_grad
            if unreduced is None and up is not None:
                unreduced = up.grad
            if unreduced is not None or partial is not None:
                pending[p] = (unreduced, None if partial is None else partial.view(p.local_shape))
        return pending

    def clear_pending(self, params: list[ShardedParam], *, set_to_none: bool = True) -> None:
        """Drops (or zeroes in place) the pending gradients of ``params``: a failed
        step's (``reset_iter_state``), or ``zero_grad``'s."""
        for p in params:
            up = p.unsharded_param
            for grad in (
                p.accumulated_grad,
                None if up is None else up.grad,
                self.partial_sums.get(p),
            ):
                if grad is not None and not set_to_none:
                    grad.zero_()
            if set_to_none:
                p.accumulated_grad = None
                if up is not None:
                    up.grad = None
                self.partial_sums.pop(p, None)

    def has_unsharded_grads(self) -> bool:
        return any(
            p.accumulated_grad is not None
            or (p.unsharded_param is not None and p.unsharded_param.grad is not None)
            for p in self.unit.trainable_params
        )

    def partial_reduce(
        self, params: list[ShardedParam], output: torch.Tensor, *, keep: bool
    ) -> torch.Tensor:
        """Keeps ``output``'s sums for a later all-reduce or hand-over (``keep``; in
        fp32 or wider with sharded accumulation), or adds those kept into it, widened
        to their dtype first; returns the output ([Note: pending gradients])."""
        if not keep and self.partial_sums:
            kept_dtype = next(iter(self.partial_sums.values())).dtype
            output = output.to(torch.promote_types(output.dtype, kept_dtype))
        wide = self.unit.options.sharded_accumulation
        offset = 0
        for p in params:
            piece = output[offset : offset + p.local_numel]
            kept = self.partial_sums.pop(p, None)
            if keep:
                dtype = torch.promote_types(piece.dtype, torch.float32) if wide else piece.dtype
                self.partial_sums[p] = (
                    piece.to(dtype, copy=True) if kept is None else kept.add_(piece)
                )
            elif kept is not None:
                piece.add_(kept)
            offset += p.chunk_numel
        return output

    def hand_over(self, params: list[ShardedParam], output: torch.Tensor, post: float) -> None:
        """Runs the all-reduce hook, divides ``output`` by ``post`` and accumulates
        each parameter's piece into its sharded ``.grad``."""
        unit, options = self.unit, self.unit.options
        # As FSDP2 (ReduceOp.AVG for float32/bfloat16 unless a divide factor or force-sum
        # is set), the hook gets the average, else the sum, divided after the hook.
        if options.all_reduce_hook is not None:
            averaged = options.gradient_divide_factor is None and not options.force_sum_reduction
            if post != 1 and averaged and output.dtype in (torch.float32, torch.bfloat16):
                output.div_(post)
                post = 1
            options.all_reduce_hook(output)
        if post != 1:
            output.div_(post)
        dtypes = {p.sharded_grad_dtype for p in params}
        if len(dtypes) == 1 and output.dtype not in dtypes:
            output = output.to(dtypes.pop())  # one cast for the unit, not one per parameter
        offset, copies_in_flight = 0, False
        for p in params:
            local = output[offset : offset + p.local_numel].view(p.local_shape)
            copies_in_flight |= _assign_sharded_grad(p, local)
            offset += p.chunk_numel
        if copies_in_flight:
            # The optimizer reads the offloaded gradients on the CPU right after
            # backward returns: block until the copies have landed.
            device = unit.mesh_info.device
            getattr(torch, device.type).current_stream(device).synchronize()

    def take_unsharded_grads(self) -> tuple[list[ShardedParam], list[torch.Tensor]]:
        """Removes and returns the unsharded gradients (including those accumulated
        without sync) of the parameters that received one."""
        params, grads, unused = [], [], []
        for p in self.unit.trainable_params:
            up = p.unsharded_param
            grad = p.local_grad(up.grad) if up is not None and up.grad is not None else None
            if p.accumulated_grad is not None:
                if grad is not None:
                    p.accumulated_grad.add_(grad)
                grad, p.accumulated_grad = p.accumulated_grad, None
            if grad is None:
                # A partial sum joins with zeros ([Note: pending gradients]).
                joins = self.unit.options.reduce_scatter_unused_params or p in self.partial_sums
                if not joins or up is None:
                    unused.append(p.fqn)
                    continue
                # The same collective size on ranks where it got no gradient (MoE).
                dtype = p.grad_dtype or p.compute_dtype  # what autograd would have made
                grad = torch.zeros(p.orig_size, dtype=dtype, device=self.unit.mesh_info.device)
            if up is not None:
                up.grad = None
            params.append(p)
            grads.append(grad)
        if unused and params:
            # As FSDP2, the reduce-scatter leaves out parameters without a gradient; only
            # this rank's view is known here (the debug checks compare the ranks' lists).
            warnings.warn(
                f"fsdp_compose: {unused} of unit {self.unit.name!r} got no gradient on this "
                "rank, so its reduce-scatter leaves them out (as FSDP2's). If another rank has "
                "one (an MoE expert without tokens here), gradients are mixed up or the "
                "collective fails: call set_reduce_scatter_unused_params(True) on the model, or "
                "set requires_grad=False where unused on every rank. "
                "FSDP_COMPOSE_DEBUG_COLLECTIVES=1 compares the ranks.",
                stacklevel=1,
            )
        return params, grads

    def synchronize(self) -> PendingReduction | None:
        """Reduces the pending gradients as a synchronizing backward would, with the
        HSDP all-reduce: ``synchronize_gradients`` ([Note: pending gradients])."""
        if self.unit.options.sharded_accumulation and not self.has_unsharded_grads():
            # Only reduce-scattered sums are pending: no new reduce-scatter.
            params = [p for p in self.unit.trainable_params if p in self.partial_sums]
            return self.reduce_grads(params, [], all_reduce=True)
        params, grads = self.take_unsharded_grads()
        return self.reduce_grads(params, grads, all_reduce=True)

    def reduce_grads(
        self, params: list[ShardedParam], grads: list[torch.Tensor], *, all_reduce: bool
    ) -> PendingReduction | None:
        """Packs ``grads`` and issues their reduce-scatter (one collective), then
        (HSDP) all-reduce; returns the pending reduction, or None if nothing to do.
        Without ``all_reduce`` (HSDP, or sharded accumulation without sync) the result
        is kept as partial sums. No ``grads``: ``params``' partial sums alone."""
        if not params:
            return None
        unit, options, info = self.unit, self.unit.options, self.unit.mesh_info
        name, world, factor = unit.name, info.shard_size, options.gradient_divide_factor
        keep = not all_reduce and (info.is_hsdp or not options.requires_gradient_sync)
        if (
            unit.aliases_shards
            and not (info.is_hsdp or options.sharded_accumulation)
            and factor is None
        ):
            # One rank, no casts: the unsharded gradient is the sharded gradient.
            for p, g in zip(params, grads):
                _assign_sharded_grad(p, g)
            return None
        reduce_dtype = unit.reduce_dtype or grads[0].dtype
        pre, post = _divide_factors(info.data_parallel_size, reduce_dtype, factor)
        row = sum(p.chunk_numel for p in params)
        comm = options.reduce_scatter_comm  # as in FSDP2, both buffers come from the comm
        device, replicate_group = info.device, info.replicate_group if all_reduce else None
        if not grads:
            zeros = torch.zeros(row, dtype=reduce_dtype, device=device)
            return PendingReduction(self, params, zeros, _collectives.DONE, replicate_group, post)
        packed = _collectives.allocate(
            comm, world * row, reduce_dtype, device, name, "reduce_scatter"
        )
        # Gradients from autograd do not require grad: no no_grad context needed.
        chunks = [g if p.shard_dim == 0 else p.rank_chunks(g, world) for p, g in zip(params, grads)]
        dtypes = {c.dtype for c in chunks}
        if len(dtypes) > 1 or torch.promote_types(dtypes.pop(), reduce_dtype) != reduce_dtype:
            # Mixed compute dtypes (reduce_dtype set), or a narrowing cast (a grad_dtype
            # wider than reduce_dtype): the fused pack takes one input dtype, widening.
            chunks = [c.to(reduce_dtype) for c in chunks]
        _compat.chunk_cat(chunks, world, packed.view(world, row))
        if pre != 1:
            packed.div_(pre)
        if world == 1:
            output, rs = packed, _collectives.DONE
        else:
            output = _collectives.allocate(comm, row, reduce_dtype, device, name, "reduce_scatter")
            group = options.reduce_scatter_group or info.shard_group
            rs = _collectives.launch_unit(
                "reduce_scatter", comm, output, packed, group, name, unit.events
            )
        return PendingReduction(self, params, output, rs, replicate_group, post, keep)


@dataclass(eq=False)
class PendingReduction:
    """A unit's gradients on their way: reduce-scatter, then (HSDP) all-reduce,
    then division and hand-off to the sharded parameters' ``.grad``."""

    reducer: GradientReducer
    _params: list[ShardedParam]  # packed at their chunk_numel
    _output: torch.Tensor | None  # None once finished or discarded
    _reduce_scatter: PendingCollective | None  # None once waited on
    _replicate_group: dist.ProcessGroup | None  # None: no all-reduce this step
    _post_divide: float
    # Keep the sums for a later all-reduce or hand-over (GradientReducer.reduce_grads).
    _keep_partial: bool = False
    _all_reduce: PendingCollective | None = None

    def advance(self) -> None:
        """Completes the reduce-scatter (freeing its full-size buffers) and starts
        the replicate all-reduce if there is one, without waiting for the latter."""
        if self._reduce_scatter is None or self._output is None:
            return
        self._reduce_scatter.wait()
        self._reduce_scatter = None
        if self._keep_partial:
            # Kept as soon as they arrive: a later reduction of the unit, advanced in
            # issue order, then finds them (manual finalization defers finishing).
            with torch.no_grad():
                self.reducer.partial_reduce(self._params, self._output, keep=True)
            self._output, self._params = None, []
            return
        if self.reducer.partial_sums:
            self._output = self.reducer.partial_reduce(self._params, self._output, keep=False)
        if self._replicate_group is not None:
            unit, group = self.reducer.unit, self._replicate_group
            self._all_reduce = _collectives.all_reduce(self._output, group, unit.name, unit.events)

    def finish(self) -> None:
        """Completes the reduction and accumulates into the sharded ``.grad``."""
        self.advance()
        output = self._output
        if output is None:
            return
        if self._all_reduce is not None:
            self._all_reduce.wait()
            self._all_reduce = None
        with torch.no_grad():
            self.reducer.hand_over(self._params, output, self._post_divide)
        self._output, self._params = None, []

    def discard(self) -> None:
        """Drops this reduction (``reset_iter_state``), after waiting for the
        collectives still in flight (their buffers must outlive them)."""
        for pending in (self._reduce_scatter, self._all_reduce):
            if pending is not None:
                pending.wait()
        self._reduce_scatter = self._all_reduce = None
        self._output, self._params = None, []


def _assign_sharded_grad(p: ShardedParam, local_grad: torch.Tensor) -> bool:
    """Stores (or accumulates) a reduced local gradient as ``p``'s sharded ``.grad``
    in its sharded gradient dtype (its original one unless ``grad_dtype`` is set), on
    the CPU when offloaded; True if an asynchronous copy to the host is in flight
    (synchronize before the CPU reads it)."""
    if local_grad.dtype != p.sharded_grad_dtype:
        local_grad = local_grad.to(p.sharded_grad_dtype)  # on the device, before the copy
    param = p.sharded_param
    existing = param.grad
    # Like autograd's AccumulateGrad, run the hooks of register_post_accumulate_grad_hook.
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    in_flight = False
    if p.offload_device is not None:
        # Asynchronous only into a fresh pinned gradient nothing reads before the
        # caller synchronizes (accumulating, or a post-accumulate-grad hook, would).
        in_flight = p.pin_memory and existing is None and not hooks
        local_grad = local_grad.to(p.offload_device, non_blocking=in_flight)
    if local_grad.shape != p.local_shape:
        local_grad = local_grad.reshape(p.local_shape)
    if existing is None:
        param.grad = p.make_sharded_grad(local_grad)
    else:
        _compat.local_tensor(existing).add_(local_grad)
    if hooks:
        for hook in tuple(hooks.values()):
            hook(param)
    return in_flight


@functools.cache
def _divide_factors(world: int, dtype: torch.dtype, custom: float | None) -> tuple[float, float]:
    """How to divide the sum over ``world`` ranks by ``custom`` (None: by ``world``):
    (divide before the sum, divide after), as FSDP2 chooses. float32 and bfloat16
    divide once, after the sum (closest to a single-process mean). Other dtypes
    (float16's narrow range) split the division around the sum against overflow and
    underflow: the pre-division is a power of two, doubled while it divides the factor
    and is smaller than the factor over it (so about its square root; 2 for 2 or 3
    ranks, 4 for 8), the post-division the rest. The same split as FSDP2's gives
    bit-identical gradients."""
    factor = float(world if custom is None else custom)
    if dtype in (torch.float32, torch.bfloat16):
        return 1.0, factor
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return float(pre), factor / pre
