"""Choose a sharding plan that fits a per-rank memory budget.

[Note: the planner's cost model]
Step time = compute + exposed communication, per rank:

* compute of a unit = its forward + backward FLOPs (measured on the meta device
  by ``torch.utils.flop_counter``, attention's QK^T and AV included) /
  ``flop_rate``; forward is a third of it,
  backward two thirds, and activation checkpointing adds the forward again to
  backward;
* a collective takes ``latency + bytes sent / bandwidth`` (the ideal per-rank
  bytes of ``_estimate.py``) and collectives run one at a time;
* overlap follows fsdp_compose's scheduler: with prefetch depth ``d`` a unit's
  all-gather is issued when the unit ``d`` places earlier (in forward, or in
  backward's reverse order) starts computing (``d = 0``: when it is needed);
  a unit's compute starts when its parameters have arrived; its reduce-scatter
  is issued when its backward ends and the step ends when the last one is done;
* ``overlap`` is the fraction of a collective's time that can pass while the
  rank computes: 1 where communication has an engine of its own (NCCL beside
  compute on a GPU); near 0 where it takes the cores compute uses (gloo on a
  CPU whose cores the ranks already fill: its copies and checksums are CPU work,
  and prefetching then hides nothing). The schedule above is simulated with
  full overlap, and ``(1 - overlap)`` of the communication it hid behind compute
  is added back.

Exposed communication = step time - compute. The search is exhaustive over the
choices below (each candidate costs one pass of the memory walk, the model is
profiled once): units of ``g`` consecutive policy units (``g`` in 1, 2, 4),
``reshard_after_forward=False`` on the last ``m`` units of forward order (the
first ones backward needs) and ``True`` on the rest, prefetch depth 0, 1 or 2,
activation checkpointing of every unit off or on. Among the candidates whose
predicted peak fits the budget, the one with the least predicted step time is
chosen (ties: fewer bytes sent, then less memory).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .._runtime import MixedPrecisionPolicy, OffloadPolicy
from ._estimate import MemoryEstimate, _check_mesh, estimate, format_bytes, parse_bytes
from ._policy import ShardingPlan, UnitPlan, WrapPolicy, resolve_plan
from ._profile import ROOT, StepFn, default_step, profile_model
from ._units import describe_choice, elide_rows

__all__ = ["CostModel", "PlanResult", "plan_to_budget"]


@dataclass(frozen=True)
class CostModel:
    """Rates the planner's step-time model uses (see ``[Note: the planner's cost model]``).

    Args:
        flop_rate: sustained FLOP/s of one rank's training compute.
        bandwidth: bytes/s one rank sends in a collective.
        latency: seconds of fixed cost per collective.
        overlap: the fraction of a collective's time that can pass while the
            rank computes, from 0 (communication competes with compute for the
            same cores, as gloo on a CPU the ranks already fill) to 1 (a
            separate engine, as NCCL on a GPU).
        source: where the rates come from, printed with the plan (``"given"``,
            ``"measured ..."``; :meth:`for_device` names its defaults).
    """

    flop_rate: float = 400e12
    bandwidth: float = 25e9
    latency: float = 20e-6
    overlap: float = 1.0
    source: str = field(default="given", compare=False)

    @classmethod
    def for_device(cls, device: str) -> CostModel:
        """The default rates for ``device``: ``"cuda"``, a datacenter GPU with NCCL
        (400 TFLOP/s of bf16 training compute, 25 GB/s per rank, communication
        fully overlapped); ``"cpu"``, a CPU rank with gloo (100 GFLOP/s, 2 GB/s,
        no overlap: gloo's copies take the cores compute uses). Rough orders of
        magnitude: pass a measured :class:`CostModel` for step times to trust."""
        if device == "cpu":
            return cls(100e9, 2e9, 100e-6, 0.0, source="default for device=cpu (gloo)")
        return cls(source=f"default for device={device} (a datacenter GPU with NCCL)")

    def describe(self) -> str:
        """One line: the rates and their source."""
        return (
            f"cost model ({self.source}): {self.flop_rate / 1e12:g} TFLOP/s, "
            f"{self.bandwidth / 1e9:g} GB/s, latency {self.latency * 1e6:g} us, "
            f"overlap {self.overlap:g}"
        )

    def __post_init__(self) -> None:
        for name in ("flop_rate", "bandwidth"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v > 0 or math.isinf(v):
                raise ValueError(f"CostModel.{name} must be a positive number, got {v!r}")
        if not self.latency >= 0:
            raise ValueError(f"CostModel.latency must be >= 0, got {self.latency!r}")
        if not isinstance(self.overlap, (int, float)) or not 0 <= self.overlap <= 1:
            raise ValueError(f"CostModel.overlap must be in [0, 1], got {self.overlap!r}")


@dataclass(frozen=True)
class PlanResult:
    """The planner's answer.

    Attributes:
        fits: whether some candidate fits the budget.
        plan: the chosen plan (``None`` when nothing fits); apply it with
            ``auto_wrap(model, plan=result.plan, ...)``.
        estimate: the chosen plan's estimate (when nothing fits: the plan
            with the smallest peak).
        budget_bytes: what the plan's estimate was held to: the budget less the
            headroom (of the chosen plan, or of the closest when nothing fits).
        step_time_s, exposed_comm_s: the cost model's prediction for the plan.
        candidates: how many candidates were evaluated.
        shortfall_bytes: how much more memory per rank the smallest candidate
            needs (0 when it fits).
        suggestions: what would fit when nothing does.
        requested_bytes: the budget as given.
        headroom: the fraction of it left free (``budget_bytes`` is the rest).
        cost: the cost model the step times come from (``cost.source`` says whose).
        reason: one line on why this plan was chosen.
        runner_up: the next best plan that fits (``choice``, ``peak_bytes``,
            ``step_time_s``), or ``None``.
    """

    fits: bool
    plan: ShardingPlan | None
    estimate: MemoryEstimate
    budget_bytes: int
    step_time_s: float
    exposed_comm_s: float
    candidates: int
    shortfall_bytes: int = 0
    suggestions: tuple[str, ...] = ()
    choice: dict[str, Any] = field(default_factory=dict)
    requested_bytes: int = 0
    headroom: float = 0.0
    cost: CostModel = field(default_factory=CostModel)
    reason: str = ""
    runner_up: dict[str, Any] | None = None

    def _held_to(self) -> str:
        if not self.headroom:
            return format_bytes(self.budget_bytes)
        return (
            f"{format_bytes(self.budget_bytes)} ({format_bytes(self.requested_bytes)} less "
            f"the headroom of {self.headroom:g})"
        )

    def table(self) -> str:
        """The plan (or the "does not fit" report) as text."""
        lines = []
        if not self.fits:
            lines.append(
                f"DOES NOT FIT: the smallest plan needs {format_bytes(self.estimate.peak_bytes_per_rank)} "
                f"per rank, {format_bytes(self.shortfall_bytes)} more than the budget of "
                f"{self._held_to()}."
            )
            lines += [f"  - {s}" for s in self.suggestions]
            return "\n".join(lines)
        assert self.plan is not None
        lines.append(f"plan: {len(self.plan.units)} units, {describe_choice(self.choice)}")
        lines.append(
            f"predicted peak {format_bytes(self.estimate.peak_bytes_per_rank)} of "
            f"{self._held_to()}; step {self.step_time_s * 1e3:.1f} ms, "
            f"exposed communication {self.exposed_comm_s * 1e3:.1f} ms"
        )
        lines.append(self.cost.describe())
        lines.append(f"why: {self.reason}")
        if self.runner_up is not None:
            ru = self.runner_up
            lines.append(
                f"runner-up: {describe_choice(ru['choice'])}; peak {format_bytes(ru['peak_bytes'])}, "
                f"step {ru['step_time_s'] * 1e3:.1f} ms"
            )
        rows: list[tuple[str, ...]] = [
            ("unit", "reshard_after_forward", "checkpoint", "params/rank", "unsharded", "sent/step")
        ]
        for u in self.estimate.units:
            rows.append(
                (
                    u.name,
                    str(u.reshard_after_forward),
                    "yes" if u.checkpoint else "no",
                    format_bytes(u.sharded_bytes),
                    format_bytes(u.unsharded_bytes),
                    format_bytes(u.all_gather_bytes + u.reduce_bytes),
                )
            )
        rows = elide_rows(rows)
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "budget_bytes": self.budget_bytes,
            "requested_bytes": self.requested_bytes,
            "headroom": self.headroom,
            "step_time_s": None if math.isnan(self.step_time_s) else self.step_time_s,
            "exposed_comm_s": None if math.isnan(self.exposed_comm_s) else self.exposed_comm_s,
            "cost": {
                "flop_rate": self.cost.flop_rate,
                "bandwidth": self.cost.bandwidth,
                "latency": self.cost.latency,
                "overlap": self.cost.overlap,
                "source": self.cost.source,
            },
            "reason": self.reason,
            "runner_up": self.runner_up,
            "candidates": self.candidates,
            "shortfall_bytes": self.shortfall_bytes,
            "suggestions": list(self.suggestions),
            "choice": self.choice,
            "plan": None
            if self.plan is None
            else {
                "prefetch_depth": self.plan.prefetch_depth,
                "units": [
                    {
                        "modules": list(u.modules),
                        "reshard_after_forward": u.reshard_after_forward,
                        "checkpoint": u.checkpoint,
                    }
                    for u in self.plan.units
                ],
            },
            "estimate": self.estimate.to_dict(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


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


def step_time(est: MemoryEstimate, cost: CostModel, depth: int) -> tuple[float, float]:
    """(step seconds, exposed communication seconds) of ``est`` under ``cost``."""
    root, blocks = est.units[0], list(est.units[1:])
    fwd = {u.name: u.flops / 3 / cost.flop_rate for u in est.units}
    bwd = {
        u.name: u.flops * (2 / 3 + (1 / 3 if u.checkpoint else 0)) / cost.flop_rate
        for u in est.units
    }
    if est.config["mesh_shape"][-1] == 1 and est.config["mesh_shape"][0] == 1:
        return sum(fwd.values()) + sum(bwd.values()), 0.0  # one rank: no collectives

    def comm(nbytes: float) -> float:
        return cost.latency + nbytes / cost.bandwidth

    gather_fwd = {u.name: comm(u.all_gather_bytes - u.backward_gather_bytes) for u in est.units}
    gather_bwd = {
        u.name: comm(u.backward_gather_bytes) if u.backward_gather_bytes else 0.0 for u in est.units
    }
    reduce = {u.name: comm(u.reduce_bytes) for u in est.units}
    channel = 0.0  # when the (single) communication channel is next free
    t = 0.0
    compute_total = 0.0
    comm_total = sum(gather_fwd.values()) + sum(gather_bwd.values()) + sum(reduce.values())

    def run_phase(
        order: list[Any], gathers: dict[str, float], times: dict[str, float], backward: bool
    ) -> None:
        nonlocal channel, t, compute_total
        arrive: dict[str, float] = {}
        issue_at: dict[str, float | None] = {u.name: None for u in order}
        for i, u in enumerate(order):
            # issue gathers up to `depth` ahead when unit i starts (and its own if not yet issued)
            for j in range(i, min(len(order), i + depth + 1)):
                v = order[j]
                if issue_at[v.name] is None:
                    issue_at[v.name] = t
                    begin = max(channel, t)
                    channel = begin + gathers[v.name]
                    arrive[v.name] = channel
            start = max(t, arrive[u.name])
            t = start + times[u.name]
            compute_total += times[u.name]
            if backward:
                begin = max(channel, t)
                channel = begin + reduce[u.name]

    run_phase([root, *blocks], gather_fwd, fwd, backward=False)
    run_phase([*reversed(blocks), root], gather_bwd, bwd, backward=True)
    end = max(t, channel)
    hidden = max(0.0, comm_total - (end - compute_total))
    end += (1 - cost.overlap) * hidden  # what the hidden part still takes from compute
    return end, end - compute_total


#: ``plan_to_budget``'s default headroom on CPU, without and with activation
#: checkpointing (see its docstring).
CPU_HEADROOM = 0.13
CPU_HEADROOM_CHECKPOINTED = 0.18


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
) -> PlanResult:
    """Chooses unit boundaries, ``reshard_after_forward`` per unit, the prefetch
    depth and (optionally) activation checkpointing to fit ``budget`` per rank
    with the least predicted step time (``[Note: the planner's cost model]``).

    Args:
        model: the unwrapped model (usually on the meta device).
        budget: bytes per rank (``int``) or a size such as ``"80GiB"``.
        batch, seq, world_size, mesh_shape, policy, mp_policy, offload_policy,
            optimizer, device, set_to_none, step_fn: as for
            :func:`estimate`; ``policy`` gives the finest unit boundaries the
            planner groups.
        activation_checkpointing: whether the planner may turn it on.
        cost: the rates of the step-time model (default:
            ``CostModel.for_device(device)``; the result names its source).
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

    Returns:
        A :class:`PlanResult`; ``result.fits`` is False (with what is missing in
        ``result.suggestions``) when no candidate fits.
    """
    given = parse_bytes(budget)
    cost = CostModel.for_device(device) if cost is None else cost
    # the headroom and what a plan's estimate may reach, without and with checkpointing
    if headroom is None:
        headrooms = (CPU_HEADROOM, CPU_HEADROOM_CHECKPOINTED) if device == "cpu" else (0.0, 0.0)
    elif not 0.0 <= headroom < 1.0:
        raise ValueError(f"headroom is a fraction of the budget in [0, 1), got {headroom!r}")
    else:
        headrooms = (headroom, headroom)
    caps = (int(given * (1.0 - headrooms[0])), int(given * (1.0 - headrooms[1])))
    replicate, shard = _check_mesh(world_size, mesh_shape)
    base = resolve_plan(model, policy)
    leaves = [m for u in base.units[:-1] for m in u.modules]
    profile = profile_model(
        model, leaves, batch=batch, seq=seq, compute_dtype=mp_policy.param_dtype, step_fn=step_fn
    )
    common: dict[str, Any] = {
        "batch": batch,
        "seq": seq,
        "mp_policy": mp_policy,
        "optimizer": optimizer,
        "device": device,
        "set_to_none": set_to_none,
        "step_fn": step_fn,
        "profile": profile,
    }
    shape = (replicate, shard) if replicate > 1 else (shard,)
    candidates = candidate_plans(
        base,
        groups=groups,
        depths=depths,
        keeps=keeps,
        checkpointing=(False, True) if activation_checkpointing else (False,),
    )
    fitting, fastest, smallest = _search(
        model, candidates, caps, cost, shape, offload_policy, common
    )
    if fitting:
        (total, _, _), exposed, choice, plan, est = fitting[0]
        ck = bool(choice["checkpoint"])
        reason, runner_up = _explain(fitting, fastest, len(candidates))
        return PlanResult(
            True,
            plan,
            est,
            caps[ck],
            total,
            exposed,
            len(candidates),
            choice=choice,
            requested_bytes=given,
            headroom=headrooms[ck],
            cost=cost,
            reason=reason,
            runner_up=runner_up,
        )
    shortfall, closest, ck = smallest
    ac = activation_checkpointing
    suggestions = _suggest(model, base, caps, replicate, shard, offload_policy, device, common, ac)
    return PlanResult(
        False,
        None,
        closest,
        caps[ck],
        math.nan,
        math.nan,
        len(candidates),
        shortfall_bytes=shortfall,
        suggestions=tuple(suggestions),
        requested_bytes=given,
        headroom=headrooms[ck],
        cost=cost,
        reason="no candidate fits",
    )


_Ranked = tuple[tuple[float, int, int], float, dict[str, Any], ShardingPlan, MemoryEstimate]


def _search(
    model: nn.Module,
    candidates: list[tuple[dict[str, Any], ShardingPlan]],
    caps: tuple[int, int],
    cost: CostModel,
    shape: tuple[int, ...],
    offload_policy: OffloadPolicy,
    common: dict[str, Any],
) -> tuple[list[_Ranked], tuple[float, int, dict[str, Any]], tuple[int, MemoryEstimate, bool]]:
    """Estimates every candidate: those that fit, best first (least step time, then
    fewer bytes sent, then less memory); the fastest of all (step, peak, choice);
    the one nearest its cap (over its cap, estimate, checkpointed)."""
    fitting: list[_Ranked] = []
    fastest: tuple[float, int, dict[str, Any]] | None = None
    smallest: tuple[int, MemoryEstimate, bool] | None = None
    for choice, plan in candidates:
        est = estimate(model, plan=plan, mesh_shape=shape, offload_policy=offload_policy, **common)
        ck = bool(choice["checkpoint"])
        peak = est.peak_bytes_per_rank
        if smallest is None or peak - caps[ck] < smallest[0]:
            smallest = (peak - caps[ck], est, ck)
        total, exposed = step_time(est, cost, plan.prefetch_depth)
        if fastest is None or total < fastest[0]:
            fastest = (total, peak, choice)
        if peak <= caps[ck]:
            fitting.append(
                ((total, est.comm_bytes_per_rank_per_step, peak), exposed, choice, plan, est)
            )
    assert smallest is not None and fastest is not None
    fitting.sort(key=lambda r: r[0])
    return fitting, fastest, smallest


def _explain(
    fitting: list[_Ranked], fastest: tuple[float, int, dict[str, Any]], candidates: int
) -> tuple[str, dict[str, Any] | None]:
    """Why the first of ``fitting`` was chosen, and the runner-up: the best other
    plan with a different prediction (step or peak)."""
    (total, _, peak), _, choice, _, _ = fitting[0]
    runner_up = None
    for (t2, _, p2), _, c2, _, _ in fitting[1:]:
        if (t2, p2) != (total, peak):
            runner_up = {"choice": c2, "peak_bytes": p2, "step_time_s": t2}
            break
    reason = (
        f"the least predicted step time of the {len(fitting)} of {candidates} candidates that fit"
    )
    if fastest[2] is not choice:
        reason += (
            f"; faster ones need more memory (the fastest: {fastest[0] * 1e3:.1f} ms "
            f"at a peak of {format_bytes(fastest[1])})"
        )
    return reason, runner_up


def _min_peak(
    model: nn.Module,
    base: ShardingPlan,
    shape: tuple[int, ...],
    offload: OffloadPolicy,
    common: dict[str, Any],
    caps: tuple[int, int],
) -> tuple[int, int]:
    """(peak, cap) of the smallest plans of the search space (every unit
    resharded, no prefetch; checkpointed or not): the one nearest its cap."""
    nearest = []
    for checkpoint in (True, False):
        units = tuple(UnitPlan(u.modules, True, checkpoint) for u in base.units[:-1])
        plan = ShardingPlan((*units, UnitPlan((ROOT,))), 0)
        peak = estimate(
            model, plan=plan, mesh_shape=shape, offload_policy=offload, **common
        ).peak_bytes_per_rank
        nearest.append((peak - caps[checkpoint], peak, caps[checkpoint]))
    _, peak, cap = min(nearest)
    return peak, cap


def _suggest(
    model: nn.Module,
    base: ShardingPlan,
    caps: tuple[int, int],
    replicate: int,
    shard: int,
    offload: OffloadPolicy,
    device: str,
    common: dict[str, Any],
    ac_allowed: bool,
) -> list[str]:
    out = []
    for factor in (2, 4, 8, 16, 32, 64, 128):
        w = shard * factor
        if w > 1 << 20:
            break
        shape = (replicate, w) if replicate > 1 else (w,)
        peak, cap = _min_peak(model, base, shape, offload, common, caps)
        if peak <= cap:
            what = f"a shard group of {w} ranks" if replicate > 1 else f"W={w}"
            out.append(f"{what} would fit (smallest plan: {format_bytes(peak)} per rank)")
            break
    else:
        out.append(
            f"no world size up to {shard * 128} fits: the activations alone are too large; "
            "reduce the micro-batch or sequence length"
        )
    if device == "cuda" and type(offload).__name__ != "CPUOffloadPolicy":
        from .._runtime import CPUOffloadPolicy

        shape = (replicate, shard) if replicate > 1 else (shard,)
        peak, cap = _min_peak(model, base, shape, CPUOffloadPolicy(), common, caps)
        verdict = "would fit" if peak <= cap else "would not be enough"
        out.append(f"CPUOffloadPolicy() {verdict} (device peak {format_bytes(peak)} per rank)")
    if not ac_allowed:
        out.append("allowing activation checkpointing may fit")
    if common["batch"] > 1:
        out.append(f"a smaller micro-batch than {common['batch']} reduces the activations")
    return out
