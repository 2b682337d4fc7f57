"""Turns the ranks' raw results of one job into the numbers the tables report.

Definitions (the same for every implementation):

* ``step_time_s``: per timed step, the slowest rank's wall time; the median over
  the timed steps.
* ``exposed_comm_s``: per timed step, the time the training thread was blocked
  (``measure.ThreadTimes.blocked``), averaged over ranks; the median over steps.
  ``trace_exposed_comm_s`` (fsdp_compose only) is fsdp_compose's own measure
  (``trace.exposed_communication()``) over the instrumented steps, as a cross-check;
  ``instrumented_blocked_s`` is the blocked time over those same steps.
* ``peak_train_bytes``: ``VmHWM - RSS at reset`` (the largest over ranks; every
  rank's value is kept in ``peak_train_bytes_per_rank``).
* ``peak_vs_formula``: (peak_train + this rank's sharded parameter bytes, which
  were resident before the reset) / the memory formula (``memory_model.py``),
  on the rank with the largest peak.
* ``lo_bytes_per_rank_step``: loopback bytes transmitted during the timed steps,
  divided by W and by the number of steps (``lo`` counts each byte once for all
  ranks together; checked by the calibration all-gather, ``lo_calibration``).
* ``ideal_bytes_per_rank_step``: from the collectives the implementation reported
  (``probes.py``), the bytes a bandwidth-optimal algorithm sends per rank.
* ``ring_ideal_bytes``: 3 (W-1)/W P (2 (W-1)/W P with reshard_after_forward=False),
  P = fp32 parameter bytes: all-gather in forward and backward, reduce-scatter.
  For DDP, one all-reduce: 2 (W-1)/W P.
* ``max_loss_diff``: max over all steps of |global mean loss - single process loss|.
"""

from __future__ import annotations

import statistics
from typing import Any

from memory_model import memory_formula
from workloads import unit_param_bytes


def _median_over_steps(per_rank: list[list[float]], combine: Any) -> float:
    return statistics.median(combine(column) for column in zip(*per_rank))


def _mean(values: Any) -> float:
    values = list(values)
    return sum(values) / len(values)


def summarize_train(
    config: dict[str, Any], ranks: list[dict[str, Any]], reference_losses: list[float] | None
) -> dict[str, Any]:
    world, steps = config["world_size"], config["steps"]
    timed = [[s["wall"] for s in r["timed_steps"]] for r in ranks]
    blocked = [[s["blocked"] for s in r["timed_steps"]] for r in ranks]
    on_cpu = [[s["on_cpu"] for s in r["timed_steps"]] for r in ranks]
    summary: dict[str, Any] = {
        "step_time_s": _median_over_steps(timed, max),
        "step_time_all_s": [max(col) for col in zip(*timed)],
        "exposed_comm_s": _median_over_steps(blocked, _mean),
        "on_cpu_s": _median_over_steps(on_cpu, _mean),
    }
    if config["instrumented"]:
        inst = [[s["blocked"] for s in r["instrumented_steps"]] for r in ranks]
        summary["instrumented_blocked_s"] = _median_over_steps(inst, _mean)
    traced = [r["trace_exposed_by_step"] for r in ranks if r.get("trace_exposed_by_step")]
    summary["trace_exposed_comm_s"] = (
        _mean(statistics.median(t) for t in traced) if traced else None
    )

    # memory
    peaks = [r["memory"]["vm_hwm"] - r["memory"]["rss_at_reset"] for r in ranks]
    worst = max(range(world), key=lambda i: peaks[i])
    local_batch = config["global_batch"] // world
    formula = memory_formula(config["impl"], config["preset"], world, local_batch)
    summary.update(
        peak_train_bytes=peaks[worst],
        peak_train_bytes_per_rank=peaks,
        peak_with_params_bytes=peaks[worst] + ranks[worst]["memory"]["local_param_bytes"],
        formula=formula,
        peak_vs_formula=(peaks[worst] + ranks[worst]["memory"]["local_param_bytes"])
        / formula["total"],
    )

    # bytes
    param_bytes = unit_param_bytes(config["preset"])["total"]
    # FSDP: all-gather in forward (and again in backward when resharded after
    # forward) + reduce-scatter; DDP: one ring all-reduce = 2 (W-1)/W P.
    fsdp = config["impl"] not in ("ddp", "single")
    factor = 3 if fsdp and config["reshard_after_forward"] else 2
    summary["param_bytes"] = param_bytes
    summary["ring_ideal_bytes"] = factor * (world - 1) / world * param_bytes if world > 1 else 0.0
    lo = ranks[0]["loopback"]
    summary["lo_bytes_per_rank_step"] = lo["tx_bytes"] / world / steps if world > 1 else 0.0
    if lo["calibration"]:
        summary["lo_calibration"] = lo["calibration"]["ratio"]
        # Traffic of other processes on this machine during the timed window, as a
        # share of what was measured (0 on a quiet machine).
        window = sum(summary["step_time_all_s"])
        background = lo["calibration"]["background_bytes_per_s"] * window
        summary["lo_background_share"] = background / max(1, lo["tx_bytes"])
    ideal = [r["ideal_bytes_sent_per_step"] for r in ranks if r["ideal_bytes_sent_per_step"]]
    summary["ideal_bytes_per_rank_step"] = _mean(ideal) if ideal else None
    summary["collectives_per_step"] = ranks[0]["collectives_per_step"]

    # numerics
    losses = ranks[0]["losses"]
    summary["losses"] = losses
    summary["max_loss_diff"] = (
        max(abs(a - b) for a, b in zip(losses, reference_losses)) if reference_losses else None
    )
    return summary


def summarize_overhead(config: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Median step (slowest rank) and on-CPU time (mean over ranks)."""
    walls = [[s["wall"] for s in r["steps"]] for r in ranks]
    cpus = [[s["on_cpu"] for s in r["steps"]] for r in ranks]
    return {
        "step_time_s": _median_over_steps(walls, max),
        "on_cpu_s": _median_over_steps(cpus, _mean),
    }


def overhead_per_unit(
    summaries: dict[str, dict[str, Any]], units: int
) -> dict[str, dict[str, float]]:
    """Per-unit per-step cost over ``unwrapped``, for each FSDP (same W)."""
    base = summaries["unwrapped"]
    return {
        impl: {
            "wall_us": (s["step_time_s"] - base["step_time_s"]) / units * 1e6,
            "on_cpu_us": (s["on_cpu_s"] - base["on_cpu_s"]) / units * 1e6,
        }
        for impl, s in summaries.items()
        if impl != "unwrapped"
    }
