"""Choose a sharding plan that fits a per-rank memory budget.

[Note: the planner's search]
The search is exhaustive over the choices below (each candidate costs one pass
of the memory walk, the model is profiled once): units of ``g`` consecutive
policy units (``g`` in 1, 2, 4), ``reshard_after_forward=False`` on the last
``m`` units of forward order (the first ones backward needs) and ``True`` on the
rest, prefetch depth 0, 1 or 2, activation checkpointing of every unit off or
on. A candidate fits when its predicted peak is within the budget less the
headroom, and (with a host budget) the offloaded state within the host budget.
With ``offload_by_budget``, a candidate that does not fit is tried again with
some of its units offloaded ([Note: offload by budget]).
Among those that fit, the one with the least predicted step time is chosen
(``[Note: the planner's cost model]`` in ``_cost.py``); ties go to fewer bytes
sent, then less memory. The same order ranks every candidate, so the reason
printed with the plan (``_explain``) is read off the compared numbers: a
candidate ranked before the chosen one cannot fit.

[Note: offload by budget]
Offloading a unit frees its sharded parameters, gradients and optimizer states
from the device and costs host-device copies every step (its shards before each
gather, its gradient shards after its reduction) and a share of the host
optimizer step. The planner offloads, in each candidate that does not fit, the
units that free the most device memory per byte copied per step (a unit kept
unsharded after forward is gathered once, so it copies half as much; a frozen
unit frees no gradients or optimizer states), the larger first among equals,
until the freed bytes cover what the candidate is over; the result is estimated
again, and one more unit is offloaded while it still does not fit. Offloaded
candidates then compete with the others on predicted step time: offloading can
beat activation checkpointing when the copies hide behind compute.

With ``grad_accum > 1`` micro-batches per step, each candidate's units also get
an accumulation mode ([Note: choosing the accumulation mode] in
``_accumulation.py``), the bytes they hold between micro-batches count
towards the candidate's peak, and its step time is that of the ``grad_accum``
micro-batches, sharded units' extra reduce-scatters included ([Note: the
planner's cost model]). The held bytes are device bytes, offloaded units' too:
offloading frees a unit's states, not its accumulator, so the units to offload
are ranked and counted by their states alone, and the candidate with units
offloaded chooses its accumulation modes again with the memory they freed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from .._runtime import MixedPrecisionPolicy, OffloadPolicy
from ._accumulation import UnitAccumulation, choose_accumulation
from ._cost import CostModel, StepCost, _offload_copies, step_cost, step_time
from ._estimate import (
    MemoryEstimate,
    UnitEstimate,
    _check_mesh,
    estimate,
    format_bytes,
    parse_bytes,
)
from ._policy import ShardingPlan, UnitPlan, WrapPolicy, resolve_plan
from ._profile import ROOT, ModelProfile, StepFn, default_step, profile_model
from ._result import PlanResult

__all__ = ["CostModel", "PlanResult", "candidate_plans", "plan_to_budget", "step_time"]

#: ``progress(evaluated, total)``: called as candidates are evaluated.
Progress = Callable[[int, int], None]


def candidate_plans(
    base: ShardingPlan,
    *,
    groups: Sequence[int] = (1, 2, 4),
    depths: Sequence[int] = (0, 1, 2),
    checkpointing: Sequence[bool] = (False, True),
    keeps: Sequence[int] | None = None,
) -> list[tuple[dict[str, Any], ShardingPlan]]:
    """Every plan of the planner's search space around ``base`` (its units are
    the finest boundaries; the root stays last with its defaults)."""
    leaves = [u.modules for u in base.units[:-1]]
    out = []
    for g in sorted(set(groups)):
        if g > 1 and g > len(leaves):
            continue
        grouped = _group(leaves, g)
        n = len(grouped)
        ms = sorted(
            set(keeps if keeps is not None else [0, n, *[2**i for i in range(n.bit_length())]])
        )
        for ac in checkpointing:
            for m in (k for k in ms if 0 <= k <= n):
                units = tuple(UnitPlan(mods, i < n - m, ac) for i, mods in enumerate(grouped)) + (
                    UnitPlan((ROOT,)),
                )
                for d in depths:
                    choice = {"group": g, "keep": m, "checkpoint": ac, "prefetch_depth": d}
                    out.append((choice, ShardingPlan(units, d, base.skipped)))
    return out


def _group(leaves: list[tuple[str, ...]], g: int) -> list[tuple[str, ...]]:
    """Consecutive leaves, ``g`` at a time, never across different parents."""
    out: list[tuple[str, ...]] = []
    for mods in leaves:
        parent = mods[0].rpartition(".")[0]
        if out and len(out[-1]) < g and out[-1][0].rpartition(".")[0] == parent and len(mods) == 1:
            out[-1] = out[-1] + mods
        else:
            out.append(tuple(mods))
    return out


#: ``plan_to_budget``'s default headroom on CPU, without and with activation
#: checkpointing (see its docstring).
CPU_HEADROOM = 0.13
CPU_HEADROOM_CHECKPOINTED = 0.18


def _check_grad_accum(grad_accum: object) -> None:
    """Refuses a ``grad_accum`` that is not a number of micro-batches."""
    if not isinstance(grad_accum, int) or isinstance(grad_accum, bool) or grad_accum < 1:
        raise ValueError(
            f"grad_accum is the number of micro-batches per step (>= 1), got {grad_accum!r}"
        )


def plan_to_budget(
    model: nn.Module,
    budget: int | str,
    *,
    batch: int,
    seq: int,
    world_size: int | None = None,
    mesh_shape: Sequence[int] | None = None,
    policy: WrapPolicy = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    optimizer: str = "adamw",
    device: str = "cuda",
    set_to_none: bool = False,
    activation_checkpointing: bool = True,
    cost: CostModel | None = None,
    step_fn: StepFn = default_step,
    groups: Sequence[int] = (1, 2, 4),
    depths: Sequence[int] = (0, 1, 2),
    keeps: Sequence[int] | None = None,
    headroom: float | None = None,
    host_budget: int | str | None = None,
    offload_by_budget: bool = False,
    grad_accum: int = 1,
    profile: ModelProfile | None = None,
    progress: Progress | None = None,
) -> PlanResult:
    """Chooses unit boundaries, ``reshard_after_forward`` per unit, the prefetch
    depth and (optionally) activation checkpointing to fit ``budget`` per rank
    with the least predicted step time (``[Note: the planner's search]``).

    Args:
        model: the unwrapped model (usually on the meta device).
        budget: bytes per rank (``int``) or a size such as ``"80GiB"``.
        batch, seq, world_size, mesh_shape, policy, mp_policy, offload_policy,
            optimizer, device, set_to_none, step_fn, profile: as for
            :func:`estimate`; ``policy`` gives the finest unit boundaries the
            planner groups.
        activation_checkpointing: whether the planner may turn it on.
        cost: the rates of the step-time model (default:
            ``CostModel.for_device(device)``; the result names its source). With
            ``CPUOffloadPolicy`` on ``"cuda"`` the step includes the host-device
            copies and the optimizer step on the host.
        groups, depths: the unit groupings and prefetch depths searched.
        keeps: the numbers of units (last in forward order) searched with
            ``reshard_after_forward=False`` (default: 0, 1, 2, 4, ... and all).
        headroom: the fraction of ``budget`` left free for what the estimate does
            not model: a plan fits when its estimate is at most
            ``(1 - headroom) * budget``. Default: ``0`` on CUDA; with
            ``device="cpu"`` ``0.13``, or ``0.18`` for a plan that checkpoints:
            the estimate counts allocated tensor bytes, and a CPU process's
            resident memory exceeds them by what glibc's heap keeps (it grows
            over the first steps of any torch process; BENCHMARKS.md).
        host_budget: host memory per rank the offloaded state may take (bytes
            or a size such as ``"128GiB"``; ``None``: not checked).
        offload_by_budget: a candidate that does not fit may offload some of its
            units (``UnitPlan.offload``), those that free the most device memory
            per byte copied per step ([Note: offload by budget]); needs
            ``device="cuda"`` and no ``CPUOffloadPolicy`` for every unit.
        grad_accum: micro-batches per optimizer step (gradient sync disabled for
            all but the last). Above 1, every unit gets an accumulation mode for
            ``FSDPModule.set_gradient_accumulation`` and its held bytes count
            towards the peak ([Note: choosing the accumulation mode]).
        progress: ``progress(evaluated, total)``, called as candidates are
            evaluated (the command line prints it on long runs).

    Returns:
        A :class:`PlanResult`; ``result.fits`` is False (with what is missing in
        ``result.suggestions``) when no candidate fits.
    """
    _check_offload_by_budget(offload_by_budget, device, offload_policy)
    _check_grad_accum(grad_accum)
    given = parse_bytes(budget)
    host_cap = None if host_budget is None else parse_bytes(host_budget)
    cost = CostModel.for_device(device) if cost is None else cost
    headrooms = _headrooms(headroom, device)
    caps = (int(given * (1.0 - headrooms[0])), int(given * (1.0 - headrooms[1])))
    replicate, shard = _check_mesh(world_size, mesh_shape)
    base = resolve_plan(model, policy)
    if profile is None:  # once, for every candidate
        leaves = [m for u in base.units[:-1] for m in u.modules]
        dtype = mp_policy.param_dtype
        profile = profile_model(
            model, leaves, batch=batch, seq=seq, compute_dtype=dtype, step_fn=step_fn
        )
    common: dict[str, Any] = dict(
        batch=batch, seq=seq, mp_policy=mp_policy, optimizer=optimizer, device=device
    )
    common.update(set_to_none=set_to_none, step_fn=step_fn, profile=profile)
    shape = (replicate, shard) if replicate > 1 else (shard,)
    candidates = candidate_plans(
        base,
        groups=groups,
        depths=depths,
        keeps=keeps,
        checkpointing=(False, True) if activation_checkpointing else (False,),
    )
    search = _Search(model, caps, host_cap, cost, shape, offload_policy, common)
    search.by_budget = offload_by_budget
    search.grad_accum = grad_accum
    scored = search.run(candidates, progress)
    fitting = sorted((s for s in scored if s.fits), key=lambda s: s.key)
    result: dict[str, Any] = {
        "grad_accum": grad_accum,
        "candidates": len(candidates),
        "requested_bytes": given,
        "cost": cost,
        "host_budget_bytes": host_cap,
    }
    if fitting:
        best = fitting[0]
        assert best.plan is not None and best.est is not None
        ck = bool(best.choice["checkpoint"])
        reason, runner_up = _explain(fitting, min(scored, key=lambda s: s.key), len(scored))
        return PlanResult(
            True,
            best.plan,
            best.est,
            caps[ck],
            best.step.step_s,
            best.step.exposed_comm_s,
            choice=best.choice,
            headroom=headrooms[ck],
            reason=reason,
            runner_up=runner_up,
            step=best.step,
            host_bytes=best.est.host_bytes_per_rank,
            accumulation=best.accumulation,
            **result,
        )
    closest = min(scored, key=lambda s: s.peak - s.cap)
    assert closest.est is not None
    ck = bool(closest.choice["checkpoint"])
    ac = activation_checkpointing
    return PlanResult(
        False,
        None,
        closest.est,
        caps[ck],
        math.nan,
        math.nan,
        shortfall_bytes=max(0, closest.peak - closest.cap),
        suggestions=tuple(_suggest(search, base, replicate, shard, device, ac)),
        headroom=headrooms[ck],
        reason="no candidate fits",
        host_bytes=closest.est.host_bytes_per_rank,
        accumulation=closest.accumulation,
        **result,
    )


def _check_offload_by_budget(by_budget: bool, device: str, offload: OffloadPolicy) -> None:
    if by_budget and (device != "cuda" or type(offload).__name__ == "CPUOffloadPolicy"):
        raise ValueError(
            "offload_by_budget chooses units to offload on a GPU: it needs device='cuda' and "
            "an offload_policy that does not already offload every unit"
        )


def _headrooms(headroom: float | None, device: str) -> tuple[float, float]:
    """The fraction of the budget a plan leaves free, without and with checkpointing."""
    if headroom is None:
        return (CPU_HEADROOM, CPU_HEADROOM_CHECKPOINTED) if device == "cpu" else (0.0, 0.0)
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"headroom is a fraction of the budget in [0, 1), got {headroom!r}")
    return (headroom, headroom)


@dataclass(frozen=True)
class _Scored:
    """One candidate's prediction: what the ranking and the reasons compare."""

    choice: dict[str, Any]
    step: StepCost
    comm_bytes: int
    peak: int
    cap: int  # the device memory it may use (the budget less its headroom)
    host_fits: bool = True
    plan: ShardingPlan | None = None
    est: MemoryEstimate | None = None
    accumulation: tuple[UnitAccumulation, ...] = ()

    @property
    def key(self) -> tuple[float, int, int]:
        """The ranking: least step time, then fewer bytes sent, then less memory."""
        return (self.step.step_s, self.comm_bytes, self.peak)

    @property
    def fits(self) -> bool:
        return self.peak <= self.cap and self.host_fits


class _Search:
    """Estimates candidates against the caps (device, and host when given)."""

    def __init__(
        self,
        model: nn.Module,
        caps: tuple[int, int],
        host_cap: int | None,
        cost: CostModel,
        shape: tuple[int, ...],
        offload: OffloadPolicy,
        common: dict[str, Any],
    ) -> None:
        self.model, self.caps, self.host_cap, self.cost = model, caps, host_cap, cost
        self.shape, self.offload, self.common = shape, offload, common
        self.by_budget = False  # offload units of candidates that do not fit
        self.grad_accum = 1  # micro-batches per step

    def score(
        self,
        choice: dict[str, Any],
        plan: ShardingPlan,
        shape: tuple[int, ...] | None = None,
        offload: OffloadPolicy | None = None,
    ) -> _Scored:
        """One candidate (at another mesh shape or offload policy if given)."""
        est = estimate(
            self.model,
            plan=plan,
            mesh_shape=shape or self.shape,
            offload_policy=self.offload if offload is None else offload,
            **self.common,
        )
        host = est.host_bytes_per_rank
        cap = self.caps[bool(choice["checkpoint"])]
        peak = est.peak_bytes_per_rank
        accumulation: tuple[UnitAccumulation, ...] = ()
        if self.grad_accum > 1:
            accumulation = choose_accumulation(est, self.cost, self.grad_accum, cap - peak)
            peak += sum(a.held for a in accumulation)
            plan = _with_accumulation(plan, accumulation)
        sharded = {a.name for a in accumulation if a.mode == "sharded"}
        step = step_cost(est, self.cost, plan.prefetch_depth, self.grad_accum, sharded)
        return _Scored(
            choice,
            step,
            est.comm_bytes_per_rank_per_step,
            peak,
            cap,
            self.host_cap is None or host <= self.host_cap,
            plan,
            est,
            accumulation,
        )

    def run(
        self, candidates: list[tuple[dict[str, Any], ShardingPlan]], progress: Progress | None
    ) -> list[_Scored]:
        out = []
        for i, (choice, plan) in enumerate(candidates):
            scored = self.score(choice, plan)
            if self.by_budget and not scored.fits:
                scored = self.offloading(scored) or scored
            out.append(scored)
            if progress is not None:
                progress(i + 1, len(candidates))
        return out

    def offloading(self, scored: _Scored) -> _Scored | None:
        """``scored``'s candidate with units offloaded until it fits ([Note: offload
        by budget]), or ``None`` when offloading every unit does not make it fit."""
        assert scored.plan is not None and scored.est is not None
        plan, need = scored.plan, scored.peak - scored.cap

        def rank(u: UnitEstimate) -> tuple[float, int]:
            freed = u.sharded_bytes + u.grad_bytes + u.optimizer_bytes
            return (-freed / max(1, sum(_offload_copies(u))), -freed)

        order = sorted(scored.est.units, key=rank)  # stable: forward order among equals
        chosen: list[str] = []
        for u in order:
            if need <= 0:
                break
            chosen.append(u.name)
            need -= u.sharded_bytes + u.grad_bytes + u.optimizer_bytes
        while True:
            picked = set(chosen)
            units = tuple(dataclasses.replace(u, offload=u.name in picked) for u in plan.units)
            offloaded = ShardingPlan(units, plan.prefetch_depth, plan.skipped)
            choice = {**scored.choice, "offload": tuple(chosen)}
            again = self.score(choice, offloaded)
            if again.fits:
                return again
            if not again.host_fits or len(chosen) == len(order):
                return None
            chosen.append(order[len(chosen)].name)


def _with_accumulation(
    plan: ShardingPlan, accumulation: tuple[UnitAccumulation, ...]
) -> ShardingPlan:
    """``plan`` with each unit's chosen accumulation mode, for ``auto_wrap``."""
    modes = {a.name: a.mode for a in accumulation}
    units = tuple(dataclasses.replace(u, accumulation=modes[u.name]) for u in plan.units)
    return dataclasses.replace(plan, units=units)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _versus(other: _Scored, chosen: _Scored) -> str:
    """How ``other`` (ranked after ``chosen``) compares with it, in the printed units."""
    if _ms(other.step.step_s) != _ms(chosen.step.step_s):
        return f"{(other.step.step_s - chosen.step.step_s) * 1e3:.1f} ms slower"
    if other.step.step_s > chosen.step.step_s:
        return "slower by less than 0.1 ms"
    if other.comm_bytes > chosen.comm_bytes:
        return f"as fast, sends {format_bytes(other.comm_bytes - chosen.comm_bytes)} more per step"
    return f"as fast, same bytes sent, peak {format_bytes(other.peak - chosen.peak)} higher"


def _explain(
    fitting: list[_Scored], fastest: _Scored, candidates: int
) -> tuple[str, dict[str, Any] | None]:
    """Why ``fitting[0]`` was chosen and the runner-up (the best other plan that
    fits with a different prediction), both read off the compared numbers.
    ``fitting`` is ranked by :attr:`_Scored.key`, ``fastest`` is the first of
    every candidate in the same order."""
    chosen = fitting[0]
    reason = (
        f"the least predicted step time ({_ms(chosen.step.step_s)}) of the {len(fitting)} "
        f"of {candidates} candidates that fit"
    )
    if fastest.key == chosen.key:
        reason += "; no candidate is predicted faster"
    else:  # ranked before the chosen one, so it does not fit
        over = f"peak {format_bytes(fastest.peak)}, over {format_bytes(fastest.cap)}"
        if _ms(fastest.step.step_s) != _ms(chosen.step.step_s):
            reason += f"; faster ones do not fit (the fastest: {_ms(fastest.step.step_s)}, {over})"
        elif fastest.step.step_s < chosen.step.step_s:
            reason += f"; one faster by less than 0.1 ms does not fit ({over})"
        elif fastest.comm_bytes < chosen.comm_bytes:
            reason += f"; one as fast that sends fewer bytes does not fit ({over})"
        else:
            reason += (
                f"; one as fast with the same bytes sent and a lower peak does not fit ({over})"
            )
    same = sum(o.key == chosen.key for o in fitting[1:])
    ties = [o for o in fitting[1:] if o.step.step_s == chosen.step.step_s and o.key != chosen.key]
    if ties:  # the ranking's tie-breaks decided: say which
        by_bytes = any(o.comm_bytes != chosen.comm_bytes for o in ties)
        reason += f"; it ties on step time with {len(ties)} other(s) and " + (
            "sends the fewest bytes" if by_bytes else "has the lowest peak"
        )
    if same:
        reason += f"; {same} other candidate(s) predict the same (the first searched is shown)"
    runner_up = None
    for other in fitting[1:]:
        if other.key != chosen.key:
            runner_up = {
                "choice": other.choice,
                "peak_bytes": other.peak,
                "step_time_s": other.step.step_s,
                "comm_bytes": other.comm_bytes,
                "versus": _versus(other, chosen),
            }
            break
    return reason, runner_up


def _smallest(
    search: _Search,
    base: ShardingPlan,
    shape: tuple[int, ...],
    offload: OffloadPolicy | None = None,
) -> _Scored:
    """The smallest plan of the search space (every unit resharded, no prefetch;
    checkpointed or not) nearest its cap, at ``shape``."""
    nearest = []
    for checkpoint in (True, False):
        units = tuple(UnitPlan(u.modules, True, checkpoint) for u in base.units[:-1])
        plan = ShardingPlan((*units, UnitPlan((ROOT,))), 0)
        choice = {"group": 1, "keep": 0, "checkpoint": checkpoint, "prefetch_depth": 0}
        nearest.append(search.score(choice, plan, shape, offload))
    return min(nearest, key=lambda s: s.peak - s.cap)


def _suggest(
    search: _Search,
    base: ShardingPlan,
    replicate: int,
    shard: int,
    device: str,
    ac_allowed: bool,
) -> list[str]:
    out = []
    for factor in (2, 4, 8, 16, 32, 64, 128):
        w = shard * factor
        if w > 1 << 20:
            break
        shape = (replicate, w) if replicate > 1 else (w,)
        small = _smallest(search, base, shape)
        if small.fits:
            assert small.est is not None
            what = f"a shard group of {w} ranks" if replicate > 1 else f"W={w}"
            host = small.est.host_bytes_per_rank
            also = f", {format_bytes(host)} of host memory" if host else ""
            out.append(
                f"{what} would fit (smallest plan: {format_bytes(small.peak)} per rank{also})"
            )
            break
    else:
        out.append(
            f"no world size up to {shard * 128} fits: the activations alone are too large; "
            "reduce the micro-batch or sequence length"
        )
    if device == "cuda" and type(search.offload).__name__ != "CPUOffloadPolicy":
        from .._runtime import CPUOffloadPolicy

        shape = (replicate, shard) if replicate > 1 else (shard,)
        small = _smallest(search, base, shape, CPUOffloadPolicy())
        assert small.est is not None
        verdict = "would fit" if small.fits else "would not be enough"
        out.append(
            f"CPUOffloadPolicy() {verdict} (device peak {format_bytes(small.peak)} per rank; "
            f"it needs {format_bytes(small.est.host_bytes_per_rank)} of host memory per rank "
            "and adds host-device copies and a host optimizer step to every step: plan with "
            "offload (--offload) for its step time)"
        )
    if not ac_allowed:
        out.append("allowing activation checkpointing may fit")
    if search.common["batch"] > 1:
        out.append(f"a smaller micro-batch than {search.common['batch']} reduces the activations")
    return out
