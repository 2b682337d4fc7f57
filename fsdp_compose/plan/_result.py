"""The planner's answer, as data and as the text the command line prints."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from ._accumulation import UnitAccumulation
from ._cost import CostModel, StepCost
from ._estimate import MemoryEstimate
from ._policy import ShardingPlan
from ._units import describe_choice, elide_rows, format_bytes

__all__ = ["PlanResult"]


@dataclass(frozen=True)
class PlanResult:
    """The planner's answer.

    Attributes:
        fits: whether some candidate fits the budget (and the host budget).
        plan: the chosen plan (``None`` when nothing fits); apply it with
            ``auto_wrap(model, plan=result.plan, ...)``.
        estimate: the chosen plan's estimate (when nothing fits: the plan
            with the smallest peak).
        budget_bytes: what the plan's estimate was held to: the budget less the
            headroom (of the chosen plan, or of the closest when nothing fits).
        step_time_s, exposed_comm_s: the cost model's prediction for the plan.
        candidates: how many candidates were evaluated.
        shortfall_bytes: how much more device memory per rank the smallest
            candidate needs (0 when it fits).
        suggestions: what would fit when nothing does.
        choice: the chosen candidate's search coordinates.
        requested_bytes: the budget as given.
        headroom: the fraction of it left free (``budget_bytes`` is the rest).
        cost: the cost model the step times come from (``cost.source`` says whose).
        reason: one line on why this plan was chosen, from the compared numbers.
        runner_up: the next best plan that fits (``choice``, ``peak_bytes``,
            ``step_time_s``, ``comm_bytes``, and ``versus``: how it compares),
            or ``None``.
        step: the chosen plan's step time in parts (``None`` when nothing fits).
        host_bytes: host memory per rank the offloaded state needs (0 without
            offload).
        host_budget_bytes: the host memory per rank allowed (``None``: not checked).
        grad_accum: micro-batches per optimizer step.
        accumulation: with ``grad_accum > 1``, each unit's accumulation costs in
            both modes and the chosen mode (``[Note: choosing the accumulation
            mode]``); the bytes they hold are part of :attr:`peak_bytes`.
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
    step: StepCost | None = None
    host_bytes: int = 0
    host_budget_bytes: int | None = None
    grad_accum: int = 1
    accumulation: tuple[UnitAccumulation, ...] = ()

    @property
    def peak_bytes(self) -> int:
        """The predicted peak per rank, gradient accumulation's held bytes included."""
        return self.estimate.peak_bytes_per_rank + sum(a.held for a in self.accumulation)

    def _held_to(self) -> str:
        if not self.headroom:
            return format_bytes(self.budget_bytes)
        return (
            f"{format_bytes(self.budget_bytes)} ({format_bytes(self.requested_bytes)} less "
            f"the headroom of {self.headroom:g})"
        )

    def _host_over(self) -> bool:
        return self.host_budget_bytes is not None and self.host_bytes > self.host_budget_bytes

    def _host_line(self) -> str:
        budget = (
            ""
            if self.host_budget_bytes is None
            else f" of a host budget of {format_bytes(self.host_budget_bytes)}"
        )
        line = f"host memory per rank {format_bytes(self.host_bytes)}{budget} (the offloaded state)"
        if self.step is not None:
            s = self.step
            line += (
                f"; per step {format_bytes(s.host_to_device_bytes)} host-to-device and "
                f"{format_bytes(s.device_to_host_bytes)} device-to-host "
                f"({s.host_copy_s * 1e3:.1f} ms of copies, hidden behind compute as far as "
                "the schedule allows)"
            )
        return line

    def table(self) -> str:
        """The plan (or the "does not fit" report) as text."""
        lines = []
        offload = bool(self.estimate.config.get("offload"))
        if not self.fits:
            if self._host_over():
                assert self.host_budget_bytes is not None
                lines.append(
                    f"DOES NOT FIT: the offloaded state needs {format_bytes(self.host_bytes)} of "
                    f"host memory per rank, {format_bytes(self.host_bytes - self.host_budget_bytes)} "
                    f"more than the host budget of {format_bytes(self.host_budget_bytes)}."
                )
            else:
                lines.append(
                    f"DOES NOT FIT: the smallest plan needs "
                    f"{format_bytes(self.peak_bytes)} per rank, "
                    f"{format_bytes(self.shortfall_bytes)} more than the budget of "
                    f"{self._held_to()}."
                )
            lines += [f"  - {s}" for s in self.suggestions]
            return "\n".join(lines)
        assert self.plan is not None and self.step is not None
        lines.append(f"plan: {len(self.plan.units)} units, {describe_choice(self.choice)}")
        micro = f" ({self.grad_accum} micro-batches)" if self.grad_accum > 1 else ""
        step = (
            f"step {self.step_time_s * 1e3:.1f} ms{micro}: compute {self.step.compute_s * 1e3:.1f} ms, "
            f"exposed communication {self.exposed_comm_s * 1e3:.1f} ms"
        )
        if offload:
            step += f", host optimizer step {self.step.host_optimizer_s * 1e3:.1f} ms"
        lines.append(f"predicted peak {format_bytes(self.peak_bytes)} of {self._held_to()}; {step}")
        if offload:
            lines.append(self._host_line())
        lines += self._offloaded_line()
        lines.append(self.cost.describe(offload))
        lines.append(f"why: {self.reason}")
        if self.runner_up is not None:
            ru = self.runner_up
            lines.append(
                f"runner-up: {describe_choice(ru['choice'])}; peak {format_bytes(ru['peak_bytes'])}, "
                f"step {ru['step_time_s'] * 1e3:.1f} ms ({ru['versus']})"
            )
        lines += self._unit_rows()
        lines += self._accumulation_rows()
        return "\n".join(lines)

    def _accumulation_rows(self) -> list[str]:
        """Per unit: both accumulation modes' held and sent bytes, the choice and why."""
        if not self.accumulation:
            return []
        acc = self.accumulation
        sharded = [a for a in acc if a.mode == "sharded"]
        lines = [
            "",
            f"gradient accumulation over {self.grad_accum} micro-batches: {len(sharded)} of "
            f"{len(acc)} units sharded; held between micro-batches "
            f"{format_bytes(sum(a.held for a in acc))} per rank (all unsharded: "
            f"{format_bytes(sum(a.held_unsharded for a in acc))}, all sharded: "
            f"{format_bytes(sum(a.held_sharded for a in acc))}); gradients sent per step "
            f"{format_bytes(sum(a.sent for a in acc))}",
        ]
        if self.estimate.config.get("offload"):
            # [Note: choosing the accumulation mode]: the runtime keeps both kinds on the
            # device, so an offloaded unit's held bytes are in the device peak above.
            lines[-1] += (
                "; offloaded units hold theirs on the device too (both modes), with no "
                "host-device copy between micro-batches"
            )
        rows: list[tuple[str, ...]] = [
            (
                "unit",
                "mode",
                "held unsharded",
                "held sharded",
                "sent unsharded",
                "sent sharded",
                "why",
            )
        ]
        for a in acc:
            rows.append(
                (
                    a.name,
                    a.mode,
                    format_bytes(a.held_unsharded),
                    format_bytes(a.held_sharded),
                    format_bytes(a.sent_unsharded),
                    format_bytes(a.sent_sharded),
                    a.reason,
                )
            )
        rows = elide_rows(rows)
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        return lines

    def _offloaded_line(self) -> list[str]:
        """The units ``offload_by_budget`` offloaded, and what it frees and copies."""
        names = self.estimate.config.get("offloaded_units") or []
        if not names:
            return []
        units = [u for u in self.estimate.units if u.name in set(names)]
        freed = sum(u.sharded_bytes + u.grad_bytes + u.optimizer_bytes for u in units)
        shown = ", ".join(names[:8]) + (f", ... ({len(names) - 8} more)" if len(names) > 8 else "")
        return [
            f"offloaded (offload_by_budget): {len(names)} of {len(self.estimate.units)} units, "
            f"{format_bytes(freed)} of device memory per rank freed: {shown}"
        ]

    def _unit_rows(self) -> list[str]:
        partial = bool(self.estimate.config.get("offloaded_units"))
        rows: list[tuple[str, ...]] = [
            ("unit", "reshard_after_forward", "checkpoint", "params/rank", "unsharded", "sent/step")
            + (("offload",) if partial else ())
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
                + (("yes" if u.offload else "no",) if partial else ())
            )
        rows = elide_rows(rows)
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (``null`` where a value does not apply)."""
        return {
            "fits": self.fits,
            "budget_bytes": self.budget_bytes,
            "requested_bytes": self.requested_bytes,
            "headroom": self.headroom,
            "step_time_s": None if math.isnan(self.step_time_s) else self.step_time_s,
            "exposed_comm_s": None if math.isnan(self.exposed_comm_s) else self.exposed_comm_s,
            "step": None if self.step is None else self.step.to_dict(),
            "host_bytes": self.host_bytes,
            "host_budget_bytes": self.host_budget_bytes,
            "cost": self.cost.to_dict(),
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
                        "offload": u.offload,
                    }
                    | ({"accumulation": u.accumulation} if self.grad_accum > 1 else {})
                    for u in self.plan.units
                ],
            },
            "estimate": self.estimate.to_dict(),
        } | (
            {
                "grad_accum": self.grad_accum,
                "accumulation": [a.to_dict() for a in self.accumulation],
            }
            if self.grad_accum > 1
            else {}
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict())
