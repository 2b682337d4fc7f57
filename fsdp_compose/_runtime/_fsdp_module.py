"""``FSDPModule``: the class :func:`fully_shard` mixes into an annotated module,
with FSDP2's runtime methods (``unshard``, ``reshard``, the ``set_*`` settings),
and :class:`UnshardHandle`, :func:`share_comm_ctx`, :func:`register_fsdp_forward_method`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from . import _compat
from ._collectives import AllGather, DefaultAllGather, DefaultReduceScatter, ReduceScatter
from ._errors import FSDPRuntimeError
from ._events import Observer
from ._hooks import UnitState, state_of
from ._mesh import separate_reduce_scatter_group
from ._scheduler import Scheduler
from ._sharded_param import grads_kept
from ._unit import TrainingState, Unit

logger = logging.getLogger("fsdp_compose")

__all__ = [
    "FSDPModule",
    "GradientReductionHandle",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]

# Steps in which FSDPModule.finalize_backward cannot run: a forward or backward pass is on.
_IN_PASS = (TrainingState.FORWARD, TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)

# The FSDP subclass made for each annotated class (by fsdp_class_of).
_fsdp_classes: dict[type, type] = {}


def fsdp_class_of(cls: type) -> type:
    """The subclass of :class:`FSDPModule` and ``cls`` that ``fully_shard`` gives a
    ``cls`` module, made once per class. torch's ``FSDPModule`` comes last, so FSDP2's
    isinstance checks accept it but none of its methods shadows ours or ``cls``'s."""
    made = _fsdp_classes.get(cls)
    if made is None:
        bases = (FSDPModule, cls, TorchFSDPModule)
        made = _fsdp_classes[cls] = type(
            f"FSDP{cls.__name__}", bases, {"__deepcopy__": _no_deepcopy}
        )
    return made


def _no_deepcopy(*_: Any) -> NoReturn:
    raise FSDPRuntimeError(
        "FSDP does not support deepcopy: fully_shard modules cannot be deep-copied (their "
        "parameters are shards tied to process groups). Copy the model before fully_shard, "
        "or use state_dict()."
    )


class FSDPModule:
    """The class :func:`fully_shard` mixes into a module: ``isinstance(module,
    FSDPModule)`` tells whether it was annotated; its methods control the unit at
    runtime (with ``recurse=True``, every ``FSDPModule`` in the module's subtree)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Containers make instances of their own class (slicing an annotated
        # nn.Sequential): those are plain modules, not units.
        orig_cls = next(
            c for c in cls.__mro__ if c not in _fsdp_classes.values() and c is not FSDPModule
        )
        instance = orig_cls.__new__(orig_cls)  # type: ignore[call-overload]
        instance.__init__(*args, **kwargs)
        return instance

    def _fsdp_state(self) -> UnitState:
        state = state_of(self)  # type: ignore[arg-type]
        if state is None:
            raise RuntimeError(f"{type(self).__name__} has no fully_shard state")
        return state

    def _units(self, recurse: bool) -> list[Unit]:
        return self._fsdp_state().units_in_subtree(recurse)

    def _configure(self, recurse: bool, **changes: Any) -> None:
        for unit in self._units(recurse):
            unit.configure(**changes)

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gathers this module's parameters (not recursive), in ``param_dtype``.

        Args:
            async_op (bool): if ``True``, returns an :class:`UnshardHandle` to wait on
                (the next forward also waits for it); else waits and returns ``None``.
        """
        state = self._fsdp_state()
        units = state.own_units
        for unit in units:  # issue every mesh's all-gather before waiting on any
            if state.scheduler is not None:
                state.scheduler.memory.issue(unit)  # at once, outside the limit
            else:
                unit.unshard()
        handle = UnshardHandle(units)
        if not async_op:
            handle.wait()
        return handle if async_op else None

    def reshard(self) -> None:
        """Frees this module's unsharded parameters (if any) and registers the
        sharded ones. Not recursive."""
        state = self._fsdp_state()
        for unit in state.own_units:
            state.reshard(unit)

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Sets whether resharding keeps the unsharded storage allocated (default
        ``False``), which keeps data pointers fixed (CUDA graphs) at a memory cost."""
        self._configure(recurse, keep_unsharded_storage=bool(keep))

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """Sets whether the caller ends backward with :meth:`finalize_backward`
        (``backward()`` then leaves gradient reductions pending). Call on the root,
        before backward; the mode is fixed from backward until finalize or reset."""
        state = self._fsdp_state()
        if state.is_root is False:
            raise RuntimeError(
                "set_manual_backward_finalization must be called on the root FSDP module"
            )
        active = state.scheduler.manual_finalization if state.scheduler is not None else None
        if enabled != state.settings.manual_backward_finalization and _compat.inside_backward():
            raise RuntimeError(
                "set_manual_backward_finalization cannot change mode during backward"
            )
        if active is not None and enabled != active:
            raise RuntimeError(
                "set_manual_backward_finalization cannot change mode after backward starts"
            )
        state.settings.manual_backward_finalization = bool(enabled)

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """Finalizes backward in manual mode (:meth:`set_manual_backward_finalization`):
        runs the pending post-backward work, reduces gradients and reshards. Call on the
        root after all backward passes of one logical backward (to accumulate over several,
        disable gradient sync for all but the last). Units in sharded accumulation
        (:meth:`set_gradient_accumulation`) have reduce-scattered already: with gradient
        sync enabled, their fp32 sums are handed to ``.grad`` as by
        :meth:`synchronize_gradients`. With ``async_op``, returns a
        :class:`GradientReductionHandle` to wait on before using the gradients or forward."""
        state = self._fsdp_state()
        scheduler = state.scheduler
        if state.is_root is None or scheduler is None:
            return GradientReductionHandle(None) if async_op else None
        if scheduler.training_state is TrainingState.REDUCTION_PENDING:
            raise RuntimeError(
                "The previous gradient reduction must be waited on before finalizing backward again"
            )
        if not state.is_root:
            raise RuntimeError("finalize_backward must be called on the root FSDP module")
        manual = scheduler.manual_finalization
        if not (state.settings.manual_backward_finalization if manual is None else manual):
            raise RuntimeError(
                "FSDP finalize_backward requires manual backward finalization. Call "
                "set_manual_backward_finalization(True) before forward"
            )
        if scheduler.training_state in _IN_PASS:
            raise RuntimeError("FSDP finalize_backward must be called after backward completes")
        # (sharded accumulation's sums are handed over by finalization itself)
        units = [u for u in scheduler.units if not u.options.sharded_accumulation]
        partial = next((u for u in units if u.reducer.partial_sums), None)
        if partial is not None:
            raise RuntimeError(
                "FSDP manual backward finalization does not support partial gradient "
                f"reductions for parameter group {partial.name!r} (set_requires_all_reduce"
                "(False)). Use automatic backward finalization, or fsdp_compose's "
                "set_gradient_accumulation('sharded'), which finalize_backward supports"
            )
        scheduler.finalize_manually(wait=not async_op)
        return GradientReductionHandle(scheduler) if async_op else None

    def reset_iter_state(self) -> None:
        """Recovers from an exception raised inside forward or backward: call on the
        root after catching it. In-flight collectives are completed and discarded,
        every unit is resharded and the failed step's unreduced gradients dropped."""
        self._fsdp_state().reset_iter_state()

    def get_pending_gradients(
        self, *, recurse: bool = True
    ) -> dict[nn.Parameter, tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Returns the gradients accumulated but not reduced yet, without communication:
        for each such sharded parameter, ``(unreduced, partial)``. ``unreduced`` is the
        unsharded gradient kept while gradient sync is disabled (in the dtype of
        accumulation: ``reduce_dtype`` if set, else the compute dtype); ``partial``
        (HSDP, all-reduce disabled; or :meth:`set_gradient_accumulation` ``"sharded"``,
        in fp32) the reduce-scattered sum not reduced yet, shaped as the local shard. Both are the tensors that accumulate (the same objects
        across micro-batches): in-place changes are reduced. FSDP2 2.16's API.

        Args:
            recurse (bool): include every ``FSDPModule`` in this module's subtree.
        """
        return {
            p.sharded_param: pending
            for unit in self._units(recurse)
            for p, pending in unit.reducer.pending_grads().items()
        }

    def synchronize_gradients(self, *, recurse: bool = True) -> None:
        """Reduces the pending gradients (:meth:`get_pending_gradients`) into the sharded
        ``.grad`` without another backward: completes the reductions in flight, then
        reduce-scatters (and with HSDP all-reduces) what is pending, divided as a
        backward's reduction (:meth:`set_gradient_divide_factor` included). Idempotent;
        collective: call on every rank, after backward. FSDP2 2.16's API.

        Args:
            recurse (bool): include every ``FSDPModule`` in this module's subtree.
        """
        scheduler = self._fsdp_state().scheduler
        if scheduler is not None:  # (none before the first forward: nothing pending)
            scheduler.synchronize_gradients(self._units(recurse))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad`` that also clears this module's pending gradients
        (:meth:`get_pending_gradients`) and the sharded ``.grad`` while the unsharded
        parameters are registered: FSDP2 2.16's behaviour, where the installed torch's
        FSDP2 has it. Up to 2.15, FSDP2's ``zero_grad`` is ``nn.Module``'s, and so is
        this one (pending gradients survive it; zero the tensors
        :meth:`get_pending_gradients` returns to clear them)."""
        super().zero_grad(set_to_none)  # type: ignore[misc]
        if not _compat.PENDING_GRADIENT_API:  # the same numbers as the installed FSDP2
            return
        registered = {id(t) for t in self.parameters()}  # type: ignore[attr-defined]
        for unit in self._units(True):
            params = [
                p
                for p in unit.params
                if id(p.sharded_param) in registered or id(p.unsharded_param) in registered
            ]
            for p in params:
                if set_to_none:
                    p.sharded_param.grad = None
                elif p.sharded_param.grad is not None:
                    p.sharded_param.grad.zero_()
            unit.reducer.clear_pending(params, set_to_none=set_to_none)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Sets whether the next backward is the last of the step (default ``True``);
        earlier ones (e.g. microbatches) leave their gradient reductions in flight."""
        self._fsdp_state().settings.is_last_backward = bool(is_last_backward)

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Sets whether backward reduces gradients (``False`` accumulates unsharded
        gradients locally, like ``no_sync``); with HSDP, the all-reduce too."""
        sync = requires_gradient_sync
        self._configure(recurse, requires_gradient_sync=sync, requires_all_reduce=sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: sets whether gradients are all-reduced across replicas after the
        reduce-scatter (``False`` accumulates reduce-scattered sums locally)."""
        self._configure(recurse, requires_all_reduce=requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Sets at runtime whether parameters are freed after forward (e.g. ``True``
        for the root, or ``False`` during evaluation)."""
        if not isinstance(reshard_after_forward, bool):
            kind = type(reshard_after_forward).__name__
            raise ValueError(f"reshard_after_forward must be a bool here, got {kind}")
        modules = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        for module in (m for m in modules if isinstance(m, FSDPModule)):
            module._fsdp_state().set_reshard_after_forward(reshard_after_forward)

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Sets whether parameters are freed after backward (``False`` saves the next
        forward's all-gather during gradient accumulation, at a memory cost)."""
        self._configure(recurse, reshard_after_backward=reshard_after_backward)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Sets the ``modules`` (in issue order) whose parameters this module's forward
        all-gathers as it starts, instead of the implicit next unit(s); ``[]``: none."""
        self._set_prefetch(modules, "forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Sets the ``modules`` (in issue order) whose parameters this module's backward
        all-gathers as it starts, instead of the implicit previous unit(s); ``[]``: none."""
        self._set_prefetch(modules, "backward_prefetch")

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divides reduced gradients by ``factor`` instead of the data-parallel size."""
        self._configure(False, gradient_divide_factor=float(factor))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated alias of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Sets whether backward needs this module's parameters at all (``False``
        for e.g. an embedding whose backward does not read its weight)."""
        self._configure(False, unshard_in_backward=unshard_in_backward)

    def set_post_optim_event(self, event: torch.Event) -> None:
        """Accepted for API compatibility: the next all-gather is always ordered after
        the optimizer step on the current stream, which this event would establish."""
        del event

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Sets whether parameters without a gradient on this rank join the
        reduce-scatter as zeros, so that ranks using different parameters (MoE,
        conditional branches) issue the same collective; like DDP's
        ``find_unused_parameters``."""
        self._configure(recurse, reduce_scatter_unused_params=reduce_scatter_unused_params)

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: Any | None = None
    ) -> None:
        """Calls ``hook(reduce_output)`` on this unit's reduced gradient (the reduce-scatter
        output, or with HSDP the all-reduce output) before the averaging division; on every
        mesh's (:meth:`set_all_reduce_hook_on_mesh`). ``stream``: for API compatibility."""
        del stream
        self.set_all_reduce_hook_on_mesh(None, hook)

    def set_all_reduce_hook_on_mesh(self, mesh: Any, hook: Callable[[torch.Tensor], None]) -> None:
        """Beyond FSDP2: :meth:`set_all_reduce_hook` for the parameters on ``mesh`` (a
        ``DeviceMesh`` from ``shard_placement_fn``) only; ``None``: on every mesh."""
        pgs = None if mesh is None else mesh.get_all_groups()  # meshes on the same ranks may differ
        units = [u for u in self._units(False) if pgs in (None, u.mesh_info.mesh.get_all_groups())]
        if not units and mesh is not None:  # no mesh, no parameters: a no-op, as in FSDP2
            raise ValueError(
                f"set_all_reduce_hook_on_mesh: no parameter of this module is on {mesh}"
            )
        for unit in units:
            unit.configure(all_reduce_hook=hook)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Sets whether reductions sum and divide separately instead of averaging.
        fsdp_compose always sums; as in FSDP2, this sets what an all-reduce hook gets
        for float32/bfloat16 gradients: the sum if enabled, else the average."""
        self._configure(False, force_sum_reduction=bool(enable))

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """Sets how many reduce-scatters may hold their full-size gradient buffers at
        once (default 1; more overlap them with backward). Applies to the whole tree."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        del recurse  # one scheduler serves the whole tree
        self._fsdp_state().settings.max_inflight_reductions = max_input_buffers

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Beyond FSDP2: runs reduce-scatters on a process group of their own, so they
        progress alongside backward all-gathers. Collective: call on every rank."""
        for unit in self._units(recurse):
            group = separate_reduce_scatter_group(unit.mesh_info) if enable else None
            unit.configure(reduce_scatter_group=group)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Asks for communication buffers from the process group's allocator. Accepted;
        the buffers stay on the regular allocator (not implemented), noted once."""
        if not isinstance(enable, bool):
            raise TypeError(f"enable must be a bool, got {type(enable).__name__}")
        if enable:
            _note_comm_buffers_unchanged(
                "set_allocate_memory_from_process_group_for_comm(True)", self._fsdp_state()
            )

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Asks for all-gather buffers in symmetric memory (``backend="NCCL"`` only,
        as in FSDP2). Accepted like :meth:`set_allocate_memory_from_process_group_for_comm`."""
        if backend != "NCCL":
            raise ValueError(f'set_symm_mem_for_comm supports backend="NCCL" only, got {backend!r}')
        _note_comm_buffers_unchanged("set_symm_mem_for_comm()", self._fsdp_state())

    def set_custom_all_gather(self, comm: AllGather | None) -> None:
        """Issues this module's (not its children's) all-gathers with ``comm``
        (FSDP2's ``AllGather``): ``comm.allocate(size, *, dtype, device)`` returns the
        output, whose row for this rank is the input; ``comm(output_tensor,
        input_tensor, group, async_op)`` issues it. Used for shard world sizes above
        1; ``None`` restores the default."""
        _check_comm(comm, self._fsdp_state(), "set_custom_all_gather")
        self._configure(False, all_gather_comm=DefaultAllGather() if comm is None else comm)

    def set_custom_reduce_scatter(self, comm: ReduceScatter | None) -> None:
        """Issues this module's reduce-scatters with ``comm`` (FSDP2's
        ``ReduceScatter``): ``allocate`` makes the input and output buffers,
        ``comm(output_tensor, input_tensor, group, op, async_op)`` issues it with
        ``op`` always ``SUM``. As :meth:`set_custom_all_gather` otherwise."""
        _check_comm(comm, self._fsdp_state(), "set_custom_reduce_scatter")
        self._configure(False, reduce_scatter_comm=DefaultReduceScatter() if comm is None else comm)

    # -- additions beyond FSDP2's API ----------------------------------------

    def register_observer(self, observer: Observer) -> None:
        """Subscribes ``observer`` (:class:`fsdp_compose.Observer`) to the runtime
        events (unit lifecycle, forward/backward spans, memory, collectives) of the
        whole tree of this module's root; call it on the root."""
        self._fsdp_state().settings.events.add(observer)

    def unregister_observer(self, observer: Observer) -> None:
        """Unsubscribes an observer added by :meth:`register_observer`."""
        self._fsdp_state().settings.events.remove(observer)

    def set_gradient_accumulation(self, mode: str, *, recurse: bool = True) -> None:
        """Sets how gradients accumulate while gradient sync is disabled
        (:meth:`set_requires_gradient_sync`).

        ``"unsharded"`` (the default, FSDP2's): each rank keeps the unsharded gradients,
        in the dtype of accumulation, with no communication until the synchronizing
        backward. ``"sharded"``: each backward reduce-scatters its gradients (in the
        reduce dtype) and adds the local shard of the result to an fp32 sum, which
        :meth:`get_pending_gradients` reports as ``partial``; the synchronizing backward
        or :meth:`synchronize_gradients` hands it to ``.grad`` (with HSDP, all-reduced
        across replicas once), divided as usual. Sharded accumulation holds 4 bytes per
        parameter divided by the shard world size instead of the unsharded gradients,
        at the cost of one reduce-scatter per micro-batch instead of one per step.

        Args:
            mode (str): ``"unsharded"`` or ``"sharded"``.
            recurse (bool): set it on every ``FSDPModule`` in this module's subtree.
        """
        if mode not in ("sharded", "unsharded"):
            raise ValueError(
                f'set_gradient_accumulation: mode must be "sharded" or "unsharded", got {mode!r}'
            )
        self._configure(recurse, sharded_accumulation=mode == "sharded")

    def set_prefetch_depth(
        self, *, forward: int | None = None, backward: int | None = None
    ) -> None:
        """Sets how many units ahead the implicit prefetch gathers (default 1 each;
        0 disables it). Applies to the whole tree; call on the root module."""
        for value in (forward, backward):
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 0
            ):
                raise ValueError(f"prefetch depth must be a non-negative int, got {value!r}")
        settings = self._fsdp_state().settings
        if forward is not None:
            settings.forward_depth = forward
        if backward is not None:
            settings.backward_depth = backward

    def set_unsharded_memory_limit(self, max_bytes: int | None) -> None:
        """Bounds the unsharded parameter bytes allocated or in flight at once
        (``None``: no bound): a prefetch beyond it waits; the unit needed now is
        always gathered. Call on the root."""
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 0):
            raise ValueError(f"max_bytes must be a non-negative int or None, got {max_bytes!r}")
        self._fsdp_state().settings.max_unsharded_bytes = max_bytes

    # -- internals -----------------------------------------------------------

    def _set_prefetch(self, modules: list[FSDPModule], which: str) -> None:
        """Sets the prefetch list ``which`` of this module's own units (or of its
        state when it has none) to the units of ``modules``."""
        if not isinstance(modules, (list, tuple)):
            raise TypeError(f"expected a list of FSDPModules, got {type(modules).__name__}")
        states = [_check_fsdp_module(m)._fsdp_state() for m in modules]
        # A module that borrows a shared parameter needs its owner unit too.
        targets = tuple(dict.fromkeys(u for s in states for u in [*s.own_units, *s.borrowed]))
        self._configure(False, **{which: targets})
        state = self._fsdp_state()
        if not state.own_units:
            state.set_prefetch(which, targets)

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # Conversions (.to(), to_empty(), .half()) must see the sharded parameters;
        # afterwards the unit re-derives dtypes and buffers from them.
        # Gradients in a MixedPrecisionPolicy.grad_dtype keep it (also when the
        # conversion fails part way).
        state = self._fsdp_state()
        units = state.own_units + state.borrowed
        for unit in units:
            state.reshard(unit)
        try:
            with grads_kept([p for u in units if u.mp_policy.grad_dtype for p in u.params]):
                return super()._apply(*args, **kwargs)  # type: ignore[misc]
        finally:
            for unit in units:
                unit.invalidate()


class UnshardHandle:
    """A pending :meth:`FSDPModule.unshard`; :meth:`wait` makes the unsharded
    parameters usable and registers them on the module."""

    def __init__(self, units: list[Unit] | None = None) -> None:
        self._units = list(units or [])

    def wait(self) -> None:
        units, self._units = self._units, []
        for unit in units:
            unit.wait_unshard()


class GradientReductionHandle:
    """A pending :meth:`FSDPModule.finalize_backward` (``async_op=True``);
    :meth:`wait` completes its gradient reductions."""

    def __init__(self, scheduler: Scheduler | None) -> None:
        self._scheduler = scheduler
        self._resets = scheduler.resets if scheduler is not None else 0

    def wait(self) -> None:
        """Waits for the gradient reductions and ends the backward iteration; raises
        ``RuntimeError`` if :meth:`FSDPModule.reset_iter_state` invalidated the handle."""
        scheduler, self._scheduler = self._scheduler, None
        if scheduler is None:
            return
        pending = scheduler.training_state is TrainingState.REDUCTION_PENDING
        if scheduler.resets != self._resets or not pending:
            raise RuntimeError("This gradient reduction handle was invalidated")
        scheduler.complete_manual_reductions()


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Accepted for API compatibility with FSDP2: fsdp_compose already shares one set
    of communication streams per device among all roots; this validates ``modules``."""
    for m in modules:
        _check_fsdp_module(m)


_noted_comm_settings: set[tuple[str, str]] = set()


def _note_comm_buffers_unchanged(setting: str, state: UnitState) -> None:
    """Logs once per device type that ``setting`` keeps the regular allocator."""
    device = state.unit.mesh_info.device.type if state.unit is not None else "cpu"
    if (setting, device) in _noted_comm_settings:
        return
    _noted_comm_settings.add((setting, device))
    why = "gloo/CPU has no such allocator"
    if device != "cpu":
        why = f"this path is not implemented for {device!r} yet"
    logger.warning(
        "fsdp_compose: %s accepted; communication buffers still come from the regular "
        "allocator (%s). Collectives and results are unchanged.",
        setting,
        why,
    )


def _check_comm(comm: object, state: UnitState, method: str) -> None:
    if comm is not None and not (callable(comm) and callable(getattr(comm, "allocate", None))):
        raise TypeError(
            f"{method} expects an object with an allocate(size, *, dtype, device) method "
            f"that is also callable to issue the collective (FSDP2's Comm interface), got "
            f"{type(comm).__name__}"
        )
    if len(state.own_units) > 1:  # ValueError, as FSDP2
        raise ValueError(
            f"{method} is not supported on a module whose parameters use several meshes "
            "(per-parameter meshes from shard_placement_fn): it would be ambiguous which "
            "mesh's collectives it applies to"
        )


def _check_fsdp_module(m: object) -> FSDPModule:
    if not isinstance(m, FSDPModule):
        raise ValueError(
            f"expected FSDPModules (modules annotated by fully_shard), got {type(m).__name__}"
        )
    return m


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Makes ``module.<method_name>`` (e.g. ``generate``) gather and free parameters
    like ``forward``: the call counts as one forward, even when it calls ``forward``
    several times. A no-op for modules that are not ``FSDPModule``.

    Args:
        module (nn.Module): the annotated module.
        method_name (str): name of the method to wrap.
    """
    if not isinstance(module, FSDPModule) or method_name == "forward":
        return  # forward already runs the unit's hooks
    method = getattr(module, method_name, None)
    if method is None or not callable(method):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r}")
    state = module._fsdp_state()

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return state.run_registered_method(module, method, args, kwargs)

    module.__dict__[method_name] = wrapped
