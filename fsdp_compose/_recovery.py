"""Recovery from an exception inside forward or backward (beyond FSDP2).

torch's FSDP2 has no way back from a step that raised midway: units may hold
unsharded parameters, collectives may be in flight and gradients half reduced.
This extension fills the core's registration point
``fsdp_compose._hooks.iter_state_reset``, which ``FSDPModule.reset_iter_state``
calls on the root: it waits for in-flight collectives (their buffers must
outlive them) and drops their results, reshards every unit, discards the failed
step's unsharded and partially reduced gradients, and clears the per-iteration
state of the root's scheduler and hooks, so that the next forward starts clean.
"""

from __future__ import annotations

import logging

from . import _hooks
from ._hooks import UnitState
from ._reduce import PendingReduction
from ._scheduler import Scheduler
from ._unit import Phase, Unit

logger = logging.getLogger("fsdp_compose")

__all__: list[str] = []


def reset_iter_state(root: UnitState) -> None:
    """Returns every unit of ``root``'s tree to a clean sharded, idle state."""
    if root.is_root is False:
        raise RuntimeError(
            "reset_iter_state() must be called on the root fully_shard module (the one "
            "the first forward ran through)."
        )
    if root.scheduler is None:
        return
    _reset_scheduler(root.scheduler)
    for state in root.all_states:
        state._pending_modules.clear()
        state._began_forward = False
        state._nested_forwards = 0
    root._finalize_queued = False


def _reset_scheduler(scheduler: Scheduler) -> None:
    failures: list[str] = []
    for reduction in scheduler._reductions:
        try:
            _discard(reduction)
        except RuntimeError as exc:  # a collective of the failed step failed too
            failures.append(str(exc))
    scheduler._reductions = []
    scheduler._scattering = []
    for unit in scheduler.units:
        _discard_unsharded_grads(unit)
        try:
            scheduler.memory.reshard(unit)
        except RuntimeError as exc:
            failures.append(str(exc))
            unit.abandon_gather()
            scheduler.memory.reshard(unit)
        unit.phase = Phase.IDLE
    if scheduler.shared is not None:
        scheduler.shared.reset()
    if failures:
        logger.warning(
            "fsdp_compose: reset_iter_state discarded %d collectives that had failed: %s",
            len(failures),
            failures[0],
        )
    scheduler.memory.deferred.clear()
    scheduler.forward_active = False
    scheduler.backward_active = False
    scheduler._forward_order = []
    scheduler._post_forward_order = []


def _discard(reduction: PendingReduction) -> None:
    # Wait for the collectives still in flight (their buffers must outlive them).
    for pending in (reduction._reduce_scatter, reduction._all_reduce):
        if pending is not None:
            pending.wait()
    reduction._reduce_scatter = reduction._all_reduce = None
    reduction._release()


def _discard_unsharded_grads(unit: Unit) -> None:
    for p in unit.params:
        p.accumulated_grad = None
        if p.unsharded_param is not None:
            p.unsharded_param.grad = None
    unit._partial_reduce.clear()


_hooks.iter_state_reset = reset_iter_state
