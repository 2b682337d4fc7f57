"""When each unit gathers, frees and reduces: one scheduler per root turns what the
hooks report (``pre_forward`` ... ``finalize_backward``) into unit operations.

* **Prefetch.** Unit k's forward issues the all-gathers of the next ``forward_depth``
  units of the previous forward's order, so that they run (on gloo's threads, or an
  all-gather stream) while unit k computes. Backward walks the last complete
  forward's post-forward order in reverse, from its end at every backward pass
  until the backwards of the forwards recorded so far have ended as last ones
  (``set_is_last_backward(False)`` for pipeline microbatches); as in FSDP2, a
  backward through the same graph after that (``retain_graph``) prefetches nothing
  ([Note: backward prefetch]). A changed order (conditional modules) costs an unused
  prefetch, freed at the end of forward. A forward that starts inside the tree (a
  module run alone, as a chunked loss runs the head) prefetches nothing implicitly,
  as FSDP2 never does. Explicit lists (``set_modules_to_forward_prefetch``) replace
  the implicit choice.
* **Rate limiter.** ``max_unsharded_bytes`` bounds the unsharded parameter bytes
  allocated or in flight: a prefetch waits for a unit to free its parameters; a
  unit needed *now* is always gathered.
* **Reductions.** A unit's reduce-scatter is issued when its backward ends and
  overlaps the backward of the units before it; the previous one is completed
  first, so one unit's full-size gradient buffers exist at a time.
  ``finalize_backward`` (queued on the autograd engine by the first backward hook)
  completes all before ``backward()`` returns.
* **Step state.** The root's step is a :class:`TrainingState`, asserted at every
  change ([Note: step state]).

Every decision depends only on the program order of hook calls, the same on every
rank: all ranks issue the same collectives in the same order.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch

from . import _compat
from ._events import Events
from ._reduce import PendingReduction
from ._sharded_param import ShardedParam
from ._shared import SharedUses
from ._unit import ROOT_STEPS, ShardState, TrainingState, Unit, check_step

logger = logging.getLogger("fsdp_compose")


@dataclass
class ScheduleSettings:
    """One root's schedule settings, written by its tree's ``FSDPModule`` setters."""

    forward_depth: int = 1  # units ahead the implicit forward prefetch gathers
    backward_depth: int = 1  # units ahead the implicit backward prefetch gathers
    max_unsharded_bytes: int | None = None  # the rate limiter's bound (None: unbounded)
    max_inflight_reductions: int = 1  # reduce-scatters whose full-size buffers coexist
    is_last_backward: bool = True  # whether the next backward completes every reduction
    manual_backward_finalization: bool = False  # FSDPModule.finalize_backward ends backward
    events: Events = field(default_factory=Events)  # [Note: runtime events]

    def adopt(self, other: ScheduleSettings) -> None:
        """Takes over what was set on ``other`` (a subtree annotated earlier)."""
        default = ScheduleSettings()
        for f in fields(self):
            value = getattr(other, f.name)
            if f.name == "events":
                self.events.adopt(value)
            elif value != getattr(default, f.name):
                setattr(self, f.name, value)


class RateLimiter:
    """Counts which of ``units`` hold unsharded memory (allocated or in flight), and
    issues, defers and drains gathers within ``settings.max_unsharded_bytes``. Every
    shard-state change of a unit goes through it, so its count is exact."""

    def __init__(self, units: list[Unit], settings: ScheduleSettings) -> None:
        self.settings = settings
        self.deferred: list[Unit] = []  # prefetches waiting for memory
        self._holding: dict[Unit, int] = {}  # unit -> unsharded bytes it holds
        self.holding_bytes = 0  # unsharded parameter bytes allocated or in flight now
        for unit in units:
            self.account(unit)

    def account(self, unit: Unit) -> None:
        """Counts (or stops counting) ``unit``'s unsharded bytes after its state changed."""
        holds = unit.holds_unsharded
        if holds == (unit in self._holding):
            return
        if holds:
            nbytes = self._holding[unit] = unit.unsharded_nbytes
            self.holding_bytes += nbytes
        else:
            nbytes = self._holding.pop(unit)
            self.holding_bytes -= nbytes
        events = self.settings.events
        if events.on_memory:
            events.memory("alloc" if holds else "free", unit.info, nbytes, self.holding_bytes)

    def issue(self, unit: Unit) -> None:
        if not unit.holds_unsharded:
            unit.unshard()
            self.account(unit)

    def prefetch(self, unit: Unit) -> None:
        if unit.holds_unsharded:
            return
        if self._fits(unit):
            if self.settings.events.on_unit:
                self.settings.events.unit("prefetch", unit.info_at)
            self.issue(unit)
        elif unit not in self.deferred:
            self.deferred.append(unit)
            if self.settings.events.on_unit:
                self.settings.events.unit("prefetch_deferred", unit.info_at)

    def require(self, unit: Unit) -> None:
        """Makes ``unit``'s parameters available now (gather if needed, then wait)."""
        if unit in self.deferred:
            self.deferred.remove(unit)
        self.issue(unit)
        unit.wait_unshard()

    def reshard(self, unit: Unit, *, to_post_forward_group: bool = False) -> None:
        unit.reshard(to_post_forward_group=to_post_forward_group)
        self.account(unit)
        while self.deferred and self._fits(self.deferred[0]):  # freed memory: drain
            self.issue(self.deferred.pop(0))

    def _fits(self, unit: Unit) -> bool:
        limit = self.settings.max_unsharded_bytes
        if limit is None:
            return True
        unit.lazy_init()  # its size is known once initialized (after an invalidate too)
        return self.holding_bytes + unit.unsharded_nbytes <= limit


class Scheduler:
    """Coordinates ``units`` (one root's tree, module pre-order) with ``settings``
    (whose event list the units already report to) and ``shared``, the use counts
    of the units other modules borrow ([Note: shared parameters]; None if none)."""

    def __init__(
        self,
        units: list[Unit],
        settings: ScheduleSettings | None = None,
        shared: SharedUses | None = None,
    ) -> None:
        self.units = units
        # The order in which finalization completes units whose backward hooks did not
        # (their inputs did not require grad): FSDP2's, the tree's pre-order, one call's
        # units (one per mesh) last mesh first.
        by_call = itertools.groupby(units, key=lambda unit: unit.modules)
        self._finalize_order = [unit for _, call in by_call for unit in reversed(list(call))]
        self.settings = settings if settings is not None else ScheduleSettings()
        self.events = self.settings.events  # shared with its units
        strays = [unit.name for unit in units if unit.events is not self.events]
        assert not strays, f"units {strays} report to another tree's events than their root's"
        self.shared = shared
        self.training_state = TrainingState.IDLE  # the root's step: [Note: step state]
        # Not a step state: the finalization mode of the backward iteration in progress,
        # fixed at its first backward until it is finalized or reset (None: none in
        # progress). An iteration spans several forward/backward passes when gradients
        # are accumulated, so the mode outlives each pass's states.
        self.manual_finalization: bool | None = None
        self._awaiting_finalize: list[Unit] = []  # manual mode: post-backward deferred
        # Nor is this: whether a pre-backward hook ran in the backward pass in progress
        # ([Note: backward without a pre-backward hook]).
        self._pre_backward_ran = False
        self.resets = 0  # reset() calls: a GradientReductionHandle from before is invalid
        # The thread that runs the steps (the root's lazy init makes the scheduler on it):
        # only there may state_dict() reshard ([Note: state_dict reshards] in _state_dict.py).
        self.thread = threading.get_ident()

        self._prev_forward_order: list[Unit] = []
        self._forward_order: list[Unit] = []
        self._forward_cursor = 0
        self._forward_from_root = True  # whether the current (or last) forward began at the root
        self._post_forward_order: list[Unit] = []
        self._backward_order: list[Unit] = []  # the last forward's post-forward order
        self._backward_cursor = 0
        # Forward passes (with grad) recorded since the backward order was last cleared:
        # the order serves as many backward passes that end as a last one, then is
        # cleared, as FSDP2 clears its post-forward order ([Note: backward prefetch]).
        self._forwards_to_walk = 0
        self._reductions: list[PendingReduction] = []  # not yet handed to .grad
        self._scattering: list[PendingReduction] = []  # reduce-scatter not yet waited
        self.memory = RateLimiter(units, self.settings)  # every later shard-state change

    def _enter(self, to: TrainingState) -> None:
        self.training_state = check_step(ROOT_STEPS, "the root", self.training_state, to)

    @property
    def step(self) -> int:
        """Forward passes begun so far (the current training step)."""
        return self.events.step

    def prefetch(self, units: Sequence[Unit]) -> None:
        """Explicit prefetch from a module that manages no parameters itself."""
        for unit in units:
            self.memory.prefetch(unit)

    # -- forward ---------------------------------------------------------

    def begin_forward(self, from_root: bool = True) -> None:
        """Called once per iteration, by the first unit state to run forward
        (``from_root``: the root's, else a forward of a module inside the tree)."""
        state = self.training_state
        if state is TrainingState.REDUCTION_PENDING:
            raise RuntimeError("The previous gradient reduction must be waited on before forward")
        if state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):
            raise RuntimeError(
                "fsdp_compose: a new forward started but the previous backward never finished "
                "(an exception inside backward?), so gradients were not reduced. Call "
                "reset_iter_state() on the root module after catching the exception."
            )
        self._complete_reductions()
        self._enter(TrainingState.FORWARD)
        self.events.begin_step()
        # Only a forward through the root predicts the next one: a module inside the
        # tree run alone (a chunked loss's head) prefetches no other unit implicitly,
        # as FSDP2 never does, and leaves the prediction as it was.
        if self._forward_order and self._forward_from_root:
            self._prev_forward_order = self._forward_order
        self._forward_from_root = from_root
        self._forward_order = []
        self._forward_cursor = 0
        self._post_forward_order = []
        self.memory.deferred.clear()
        for unit in self.units:
            if unit.state is ShardState.UNSHARDED and unit.params_changed_since_unshard():
                # Updated (optimizer step) while unsharded (reshard_after_backward=False).
                self.memory.reshard(unit)

    def pre_forward(self, *units: Unit) -> None:
        """``units``: one unit, or one call's units (one per mesh, [Note: per-parameter
        meshes]), whose all-gathers are all issued before any wait."""
        for unit in units:
            unit.enter(TrainingState.FORWARD)
            self._forward_order.append(unit)
            unit.lazy_init()  # adopts parameters replaced since (load_state_dict(assign=True))
            if self.shared is not None:
                self.shared.forward_use_begin(unit)
            self.memory.issue(unit)
        for unit in units:
            for target in self._prefetch_targets(unit, backward=False):
                if target not in units:
                    self.memory.prefetch(target)
        for unit in units:
            self.memory.require(unit)
            if self.events.on_unit:
                self.events.unit("forward_begin", unit.info_at)

    def post_forward(self, unit: Unit) -> None:
        if self.events.on_unit:
            self.events.unit("forward_end", unit.info_at)
        self._end_forward_use(unit)
        unit.enter(TrainingState.IDLE)

    def keep_gathered(self, unit: Unit) -> None:
        """Ends the forward of a grouped unit run on its own with only some of its
        modules (FSDP2's partial path): it stays gathered, for its backward."""
        if self.events.on_unit:
            self.events.unit("forward_end", unit.info_at)
        unit.enter(TrainingState.IDLE)

    def borrow_forward(self, units: list[Unit]) -> None:
        """A module sharing the parameters of (owner) ``units`` starts its forward."""
        assert self.shared is not None
        for unit in units:
            self._forward_order.append(unit)
            self.shared.forward_use_begin(unit)
            self.memory.require(unit)

    def return_forward(self, units: list[Unit]) -> None:
        """The forward that :meth:`borrow_forward` began is done."""
        for unit in units:
            self._end_forward_use(unit)

    def _end_forward_use(self, unit: Unit) -> None:
        self._post_forward_order.append(unit)
        shared = self.shared
        if shared is None or shared.forward_use_end(unit, needs_backward=torch.is_grad_enabled()):
            self._reshard_after_forward(unit)

    def _reshard_after_forward(self, unit: Unit) -> None:
        reshard = unit.options.reshard_after_forward
        if reshard is not False:
            self.memory.reshard(unit, to_post_forward_group=reshard is not True)

    def end_forward(self) -> None:
        """Called by the state that began the forward, after its post-forward."""
        # A manual finalization in progress (gradient accumulation) goes on waiting.
        awaiting = TrainingState.AWAITING_FINALIZE if self.manual_finalization else None
        self._enter(awaiting or TrainingState.IDLE)
        self.memory.deferred.clear()
        no_backward = not torch.is_grad_enabled()
        if self.shared is not None:
            for unit in self.shared.end_forward_pass(record=not no_backward):
                self._reshard_after_forward(unit)  # shared units held for a later use
        if self._post_forward_order and not no_backward:
            self._backward_order = self._post_forward_order
            self._forwards_to_walk += 1
        ran = set(self._forward_order)
        for unit in self.units:
            if unit.gather_in_flight and unit not in ran:
                self.memory.reshard(unit)  # a prefetch the forward did not use
            elif no_backward and unit.state is ShardState.UNSHARDED:
                # As in FSDP2, units that stay unsharded keep their data across no-grad
                # forwards, but model.parameters() shows the shards again (for an
                # optimizer built after an evaluation); begin_forward re-gathers stale ones.
                unit.park()

    # -- backward --------------------------------------------------------

    def pre_backward(self, *units: Unit) -> None:
        """A gradient of a forward output of ``units`` (as in :meth:`pre_forward`) is ready."""
        units = tuple(u for u in units if u.training_state is not TrainingState.PRE_BACKWARD)
        if not units:
            return
        for unit in units:
            unit.enter(TrainingState.PRE_BACKWARD)
        gather = [u for u in units if u.options.unshard_in_backward]
        for unit in gather:
            self.memory.issue(unit)
        for unit in gather:
            for target in self._prefetch_targets(unit, backward=True):
                # As in FSDP2, a unit set not to unshard in backward is not prefetched
                # there either (its backward does not need its parameters).
                if target not in units and target.options.unshard_in_backward:
                    self.memory.prefetch(target)
        for unit in gather:
            self.memory.require(unit)
        if self.events.on_unit:
            for unit in units:
                self.events.unit("backward_begin", unit.info_at)

    def borrow_backward(self, units: list[Unit]) -> None:
        """A borrower of ``units`` starts its backward: unshard them (even if not
        ``unshard_in_backward``)."""
        for unit in units:
            self.memory.require(unit)

    def return_backward(self, units: list[Unit]) -> None:
        """The backward :meth:`borrow_backward` began is done: reduce after a last use."""
        for unit in units:
            self.post_backward(unit)

    def begin_backward(self, *, pre_backward: bool) -> bool:
        """Backward reached a unit of this root, in a pre-backward hook (else a
        post-backward one): returns whether this is the first time in this backward
        pass (the caller then queues :meth:`finalize_backward`)."""
        self._pre_backward_ran |= pre_backward
        if self.training_state is TrainingState.PRE_BACKWARD:
            return False
        self._enter(TrainingState.PRE_BACKWARD)
        if self.manual_finalization is None:
            self.manual_finalization = self.settings.manual_backward_finalization
        self._backward_cursor = len(self._backward_order)
        return True

    def _prefetch_targets(self, unit: Unit, *, backward: bool) -> Sequence[Unit]:
        explicit = unit.options.backward_prefetch if backward else unit.options.forward_prefetch
        if explicit is not None:  # () included
            return explicit
        depth = self.settings.backward_depth if backward else self.settings.forward_depth
        if depth <= 0 or not (backward or self._forward_from_root):
            return []
        if not backward:
            order = self._prev_forward_order
            # Scan on from the last match (amortised O(1) when the order repeats).
            for i in range(self._forward_cursor, len(order)):
                if order[i] is unit:
                    self._forward_cursor = i + 1
                    return order[i + 1 : i + 1 + depth]
            return []
        order = self._backward_order
        # The unit's latest post-forward below the cursor (a unit run n times is found
        # once per backward through it), else anywhere (the order changed).
        below, anywhere = range(self._backward_cursor - 1, -1, -1), range(len(order) - 1, -1, -1)
        index = next((i for i in itertools.chain(below, anywhere) if order[i] is unit), None)
        if index is None:
            return []
        self._backward_cursor = index
        targets: list[Unit] = []
        for earlier in reversed(order[:index]):
            if len(targets) == depth:
                break
            if earlier is not unit and earlier not in targets:
                targets.append(earlier)
        return targets

    def post_backward(self, *units: Unit, at_end: bool = False) -> None:
        """Backward through ``units`` (as in :meth:`pre_forward`) is done, or (``at_end``)
        finalisation reached units whose inputs did not require grad. One call's
        reduce-scatters are issued together."""
        first = True
        for unit in units:
            if at_end or self.shared is None or self.shared.backward_use_end(unit):
                self._post_backward(unit, at_end=at_end, drain=first)
                first = False
        # (a shared unit waits for the backward of its other uses: [Note: shared parameters])

    def _post_backward(self, unit: Unit, *, at_end: bool, drain: bool = True) -> None:
        # FSDP2's span (and TORCH_LOGS=fsdp line) for each unit's post-backward, whether
        # a hook or the end of backward runs it.
        with _compat.profiler_label("post_backward", unit.name):
            self._reduce_after_backward(unit, at_end=at_end, drain=drain)

    def _reduce_after_backward(self, unit: Unit, *, at_end: bool, drain: bool) -> None:
        if unit.training_state is TrainingState.PRE_BACKWARD and self.events.on_unit:
            self.events.unit("backward_end", unit.info_at)
        unit.enter(TrainingState.POST_BACKWARD)
        options, reducer = unit.options, unit.reducer
        params: list[ShardedParam] = []
        sync = options.requires_gradient_sync
        if sync or options.sharded_accumulation:  # ([Note: pending gradients] in _reduce.py)
            params, grads = reducer.take_unsharded_grads()
        else:
            reducer.accumulate_unsharded_grads()
        if options.reshard_after_backward:
            # Gradients are separate tensors: free the parameters before the reduction
            # allocates its buffers, so that the two never coexist.
            self.memory.reshard(unit)
        if params:
            # Complete earlier reduce-scatters first (bounds full-size gradient buffers;
            # they had this unit's backward to finish), except at the end of backward:
            # nothing is left to overlap, so the last ones run together.
            if drain and not at_end:
                while len(self._scattering) >= self.settings.max_inflight_reductions:
                    self._scattering.pop(0).advance()
            all_reduce = sync and options.requires_all_reduce
            reduction = reducer.reduce_grads(params, grads, all_reduce=all_reduce)
            del grads  # packed into the reduction's buffer
            if reduction is not None:
                self._reductions.append(reduction)
                self._scattering.append(reduction)

    def finalize_backward(self) -> None:
        """End of ``backward()``: reduce what is left and hand gradients over (in
        manual mode, what is left waits for :meth:`finalize_manually`)."""
        manual = bool(self.manual_finalization)
        self._enter(TrainingState.POST_BACKWARD)
        # [Note: backward without a pre-backward hook]
        # FSDP2 queues its end-of-backward callback from pre-backward hooks only. A
        # backward that reached units through their post-backward alone (a grouped
        # unit's module run on its own, as a chunked loss runs the head: FSDP2's partial
        # path hooks no output) reduces those units and leaves the rest as they are:
        # units kept gathered stay so, and gradients accumulated without sync stay
        # unreduced, for the backward that follows. Here such a pass only hands its
        # reductions over (FSDP2's are written to .grad as they complete).
        pre_backward_ran, self._pre_backward_ran = self._pre_backward_ran, False
        try:
            for unit in self._finalize_order if pre_backward_ran else ():
                if (
                    unit.training_state is not TrainingState.POST_BACKWARD
                    and (
                        unit.training_state is TrainingState.PRE_BACKWARD
                        or unit.state is not ShardState.SHARDED
                        or unit.reducer.has_unsharded_grads()
                    )
                ) or (
                    self.shared is not None
                    and unit in self.shared
                    and unit.reducer.has_unsharded_grads()
                ):
                    # (a shared unit may get gradients after an early reduction)
                    if manual and unit.options.requires_gradient_sync:
                        if unit not in self._awaiting_finalize:
                            self._awaiting_finalize.append(unit)
                    else:
                        self.post_backward(unit, at_end=True)
            if pre_backward_ran:
                # [Note: backward prefetch]
                # FSDP2 clears its post-forward order when a last backward ends, so that
                # a later backward through the same forward's graph (retain_graph: an
                # auxiliary loss backpropagated after the main one, autograd.grad first)
                # prefetches nothing, where a prefetch could be one no backward uses.
                # Beyond FSDP2, the order is kept while forwards recorded before this
                # backward still have theirs to run (several forwards, then their
                # backwards: each such backward prefetches, where FSDP2's last does not;
                # pipeline microbatches, not last but the last, count down to it).
                self._forwards_to_walk = max(self._forwards_to_walk - 1, 0)
                if self.settings.is_last_backward:
                    if not self._forwards_to_walk:
                        self._backward_order = []
                    for unit in self.units:
                        if unit.gather_in_flight:
                            # A backward prefetch whose unit's backward never ran: as
                            # FSDP2 does, dropped; kept, the next forward would use it,
                            # gathered before the optimizer step changed the parameters.
                            self.memory.reshard(unit)
            if self.settings.is_last_backward and not manual:
                self._complete_reductions()
                self.manual_finalization = None
        finally:
            for unit in self.units:
                unit.enter(TrainingState.IDLE)
            self.memory.deferred.clear()
            if self.shared is not None:
                self.shared.end_backward_pass()
            self._enter(TrainingState.AWAITING_FINALIZE if manual else TrainingState.IDLE)

    def finalize_manually(self, *, wait: bool) -> None:
        """``FSDPModule.finalize_backward``: runs the deferred post-backwards (and those
        of unsynchronized gradients), reshards, and (``wait``) completes every reduction."""
        awaiting, self._awaiting_finalize = self._awaiting_finalize, []
        for pending in self._reductions:  # the no-sync backwards' sums are kept first
            pending.advance()
        for unit in reversed(self.units):
            options = unit.options
            if unit in awaiting or unit.reducer.has_unsharded_grads():
                self._post_backward(unit, at_end=True)
            else:
                if options.sharded_accumulation and options.requires_gradient_sync:
                    # Its backwards reduce-scattered already: hand the kept sums over, as
                    # synchronize_gradients does ([Note: pending gradients] in _reduce.py).
                    reduction = unit.reducer.synchronize()
                    if reduction is not None:
                        self._reductions.append(reduction)
                if options.reshard_after_backward:
                    self.memory.reshard(unit)
            unit.enter(TrainingState.IDLE)
        if wait:
            self.complete_manual_reductions()
        else:
            self._enter(TrainingState.REDUCTION_PENDING)

    def complete_manual_reductions(self) -> None:
        """Completes :meth:`finalize_manually`'s reductions; the backward iteration ends."""
        self._complete_reductions()
        self._enter(TrainingState.IDLE)
        self.manual_finalization = None

    def _complete_reductions(self) -> None:
        reductions, self._reductions = self._reductions, []
        self._scattering = []
        for reduction in reductions:
            reduction.finish()

    def synchronize_gradients(self, units: list[Unit]) -> None:
        """``FSDPModule.synchronize_gradients``: completes the reductions in flight, then
        reduces the pending gradients of ``units`` without a backward ([Note: pending
        gradients] in ``_reduce.py``)."""
        if self.training_state is not TrainingState.IDLE:
            raise RuntimeError(
                "synchronize_gradients must be called after backward completes (in manual "
                f"finalization mode, after finalize_backward), not in {self.training_state.name}"
            )
        self._complete_reductions()
        reductions = [r for unit in units if (r := unit.reducer.synchronize()) is not None]
        for reduction in reductions:  # every reduce-scatter issued before the first wait
            reduction.finish()

    def reset(self) -> None:
        """After an exception inside forward or backward: waits for in-flight
        collectives (their buffers must outlive them), reshards every unit, discards
        the failed step's gradients, and clears the per-iteration state."""
        failures: list[str] = []
        for reduction in self._reductions:
            try:
                reduction.discard()
            except RuntimeError as exc:  # a collective of the failed step failed too
                failures.append(str(exc))
        self._reductions, self._scattering = [], []
        for unit in self.units:
            unit.reducer.clear_pending(unit.params)
            try:
                self.memory.reshard(unit)
            except RuntimeError as exc:
                failures.append(str(exc))
                unit.abandon_gather()
                self.memory.reshard(unit)
            unit.enter(TrainingState.IDLE)
        if self.shared is not None:
            self.shared.reset()
        if failures:
            logger.warning(
                "fsdp_compose: reset_iter_state discarded %d collectives that had failed: %s",
                len(failures),
                failures[0],
            )
        self.memory.deferred.clear()
        self.training_state = TrainingState.IDLE  # from any state: this is the recovery path
        self._pre_backward_ran = False
        self._forward_order, self._post_forward_order = [], []
        self._backward_order, self._forwards_to_walk = [], 0
        self.manual_finalization, self._awaiting_finalize = None, []
        self.resets += 1
