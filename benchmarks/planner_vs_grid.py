"""The planner's choice vs an exhaustive grid measured on CPU.

    python benchmarks/planner_vs_grid.py [--world-size 2] [--budget-quantile 0.5]

For the benchmark GPT (``estimator_accuracy.MODELS["gpt"]``) at ``W`` ranks,
every plan of a grid (units of 1 or 2 blocks; ``reshard_after_forward=False`` on
none, half or all of them; prefetch depth 0 or 1; activation checkpointing off or
on; the planner searches the same 20 plans) is
run on fresh ranks (``harness.run_job``), measuring its peak memory the way
``estimator_accuracy.py`` does and its step time (one warm-up step, then the
mean of ``--steps``). The budget is the given quantile of the predicted peaks.
Peak memory is allocated tensor bytes (torch's ``MemTracker``), what the
estimate predicts; the planner's CPU headroom is for the resident excess above it.
The planner (``plan_to_budget``, searching the same grid) uses a cost model
measured on this machine: the FLOP rate of one unsharded step of the model in
this process (one thread; times the share of a core each rank gets when the ranks
outnumber the cores), the all-gather bandwidth of ``W`` gloo ranks and the
fraction of an all-gather's time that passes while the rank computes
(``CostModel.overlap``; ``--overlap`` sets it).
Reported: each grid point, the planner's choice, the fastest measured plan that
fits, and the ratio of their measured step times.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import estimator_accuracy as ea
import torch
import torch.nn.functional as F
from harness import run_job


def measured_flop_rate(case: ea.Case, flops: float) -> float:
    """FLOP/s of one unsharded training step of the model here (one thread)."""
    torch.set_num_threads(1)
    model = ea.build_meta(case.model).to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    ids = torch.randint(0, model.cfg.vocab_size, (case.batch, case.seq))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        logits = model(ids)
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids.reshape(-1)).backward()
        times.append(time.perf_counter() - start)
    return flops / min(times[1:])


#: ``reshard_after_forward=False`` on none, half or all of the four blocks' units
KEEPS = (0, 2, 4)


def main() -> None:
    from fsdp_compose.plan import CostModel, estimate, plan_to_budget, resolve_plan
    from fsdp_compose.plan._planner import candidate_plans, step_time

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--budget-quantile", type=float, default=0.5)
    parser.add_argument("--budget", type=float, default=None, help="MiB (overrides the quantile)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--headroom",
        type=float,
        default=None,
        help="the planner's headroom (plan_to_budget(headroom=...)): the fraction of the "
        "budget its plan's estimate leaves free (default: the planner's, 0.1 on CPU)",
    )
    parser.add_argument(
        "--overlap",
        type=float,
        default=None,
        help="the cost model's overlap (default: measured, CostModel(overlap=...))",
    )
    args = parser.parse_args()
    case = ea.Case("gpt", args.world_size)
    model = ea.build_meta(case.model)
    common = {
        "batch": case.batch,
        "seq": case.seq,
        "world_size": case.world_size,
        "device": "cpu",
    }
    base = resolve_plan(model, ["Block"])
    grid = candidate_plans(
        base, groups=(1, 2), depths=(0, 1), checkpointing=(False, True), keeps=KEEPS
    )
    preds = [estimate(model, plan=p, **common) for _, p in grid]
    flops = sum(u.flops for u in preds[0].units)
    if case.world_size > 1:
        calibration = run_job(
            {
                "kind": "estimate",
                "impl": "fsdp_compose",
                "world_size": case.world_size,
                "calibrate": True,
                "case": asdict(case),
            }
        )
        bandwidth = min(r["bandwidth"] for r in calibration)
        overlap = min(r["overlap"] for r in calibration)
    else:  # one rank sends nothing: the rates do not matter
        bandwidth, overlap = CostModel.bandwidth, 1.0
    if args.overlap is not None:
        overlap = args.overlap
    # ranks beyond the machine's cores share them: each computes that much slower
    share = min(1.0, (os.cpu_count() or 1) / case.world_size)
    cost = CostModel(
        flop_rate=measured_flop_rate(case, flops) * share,
        bandwidth=bandwidth,
        latency=1e-3,
        overlap=overlap,
        source="measured on this machine: FLOP rate, gloo all-gather bandwidth"
        + (", overlap given" if args.overlap is not None else ", overlap"),
    )
    peaks = sorted(e.peak_bytes_per_rank for e in preds)
    budget = peaks[min(len(peaks) - 1, int(args.budget_quantile * len(peaks)))]
    if args.budget is not None:
        budget = int(args.budget * 2**20)
    chosen = plan_to_budget(
        model,
        budget,
        groups=(1, 2),
        depths=(0, 1),
        cost=cost,
        policy=["Block"],
        keeps=KEEPS,
        headroom=args.headroom,
        **common,
    )
    print(
        f"W={case.world_size}, micro-batch {case.batch} x {case.seq}; budget {budget / 2**20:.1f} MiB "
        f"(the planner's headroom {args.headroom if args.headroom is not None else 'default'}); "
        f"cost model: {cost.flop_rate / 1e9:.2f} GFLOP/s, {cost.bandwidth / 1e6:.0f} MB/s, "
        f"latency {cost.latency * 1e3:.1f} ms, overlap {cost.overlap:.2f}\n"
    )
    print(
        "| units of | no-reshard units | prefetch | AC | predicted peak (MiB) | measured peak (MiB) | fits (measured) "
        "| predicted step (s) | measured step (s) |"
    )
    print("| ---: | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: |")
    rows = []
    for (choice, plan), est in zip(grid, preds):
        ranks = run_job(
            {
                "kind": "estimate",
                "impl": "fsdp_compose",
                "world_size": case.world_size,
                "case": asdict(case),
                "plan": ea.plan_to_dict(plan),
                "steps": args.steps,
            },
            timeout_s=1800,
        )
        measured = max(r["measured"] for r in ranks)
        step_s = max(r["step_s"] for r in ranks)
        predicted_step, _ = step_time(est, cost, plan.prefetch_depth)
        is_choice = chosen.plan == plan
        rows.append((choice, plan, measured, step_s, is_choice))
        mark = " **(planner)**" if is_choice else ""
        print(
            f"| {choice['group']} | {choice['keep']} | {choice['prefetch_depth']} | "
            f"{'on' if choice['checkpoint'] else 'off'} | {est.peak_bytes_per_rank / 2**20:.1f} | "
            f"{measured / 2**20:.1f} | {'yes' if measured <= budget else 'no'} | {predicted_step:.2f} | "
            f"{step_s:.2f}{mark} |",
            flush=True,
        )
    fitting = [r for r in rows if r[2] <= budget]
    best = min(fitting, key=lambda r: r[3]) if fitting else None
    mine = next((r for r in rows if r[4]), None)
    if best and mine:
        print(
            f"\nplanner's plan: measured peak {mine[2] / 2**20:.1f} MiB (budget {budget / 2**20:.1f} MiB, "
            f"{'fits' if mine[2] <= budget else 'DOES NOT FIT'}), step {mine[3]:.2f} s; fastest fitting grid "
            f"point: {best[3]:.2f} s; ratio {mine[3] / best[3]:.3f}"
        )
    elif not chosen.fits:
        print("\nthe planner: " + chosen.table().replace("\n", "\n  "))
    else:
        print("\nno comparison: no grid point measured within the budget")


if __name__ == "__main__":
    main()
