"""What the always-on collective guard costs (see [Note: collective guard]).

    python benchmarks/guard_cost.py --preset small --world-size 2 --steps 10

Two measurements, each with the guard on and off *in the same processes*,
alternating step by step (so load from other processes on a shared machine hits
both sides alike):

* per collective: a small all-gather (4,160 floats, one tiny unit) issued and
  waited with and without the guard, alternating call by call over ``--calls``
  calls each on loopback: the latency the guard adds (its fingerprint exchange
  and the launch from gloo's thread) and the on-CPU time of all threads;
* per step: the benchmark's training step (``workloads.py``: the examples' GPT,
  one unit per block plus the root, AdamW), median wall and on-CPU time of the
  steps with the guard on and with it off, how many collectives a step issues,
  and the share of the guarded steps' time the training thread spends issuing
  guarded collectives (the rest of the guard runs on gloo's threads).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness


def _worker(
    rank: int, world: int, init_file: str, args: argparse.Namespace, queue: mp.Queue
) -> None:
    harness.init_gloo(rank, world, init_file)
    import workloads

    from fsdp_compose import _collective_hooks, _guard

    group = dist.group.WORLD
    # Per collective: a 4160-float all-gather (a tiny unit) issued and waited,
    # with and without the guard, alternating call by call.
    inp = torch.randn(4160)
    out = torch.empty(world * 4160)

    def issue(on: dist.ProcessGroup) -> dist.Work:
        return on._allgather_base(out, inp)

    call = _collective_hooks.CollectiveCall(
        "all_gather", "blocks.3", group, 4160, torch.float32, 1, torch.device("cpu")
    )

    def one(guarded: bool) -> None:
        if guarded:
            work = _guard.launch(call, issue)
        else:
            work = issue(group)
        assert work is not None
        work.wait()

    for _ in range(20):
        one(True)
        one(False)
    per_call: dict[bool, list[float]] = {True: [], False: []}
    per_call_cpu: dict[bool, list[float]] = {True: [], False: []}
    for i in range(2 * args.calls):
        guarded = i % 2 == 0
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        one(guarded)
        per_call[guarded].append(time.perf_counter() - start)
        per_call_cpu[guarded].append(time.process_time() - start_cpu)

    # Time the training thread spends issuing guarded collectives (the rest of
    # the guard runs on gloo's threads, inside the step's on-CPU time).
    inside = {"wall": 0.0, "cpu": 0.0}
    launch = _guard.launch

    def timed_launch(*a: object) -> object:
        start, start_cpu = time.perf_counter(), time.thread_time()
        try:
            return launch(*a)  # type: ignore[arg-type]
        finally:
            inside["wall"] += time.perf_counter() - start
            inside["cpu"] += time.thread_time() - start_cpu

    _guard.launch = timed_launch  # type: ignore[assignment]
    model = workloads.build_gpt(args.preset, "fsdp_compose")
    optim = workloads.make_optimizer(model)
    batches = workloads.Batches(workloads.PRESETS[args.preset], args.global_batch, rank, world)
    count = [0]

    def listener(event: str, info: object) -> None:
        count[0] += event == "issue"

    wall: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    for step in range(args.warmup + 2 * args.steps):
        on = step % 2 == 0
        _guard.set_enabled(on)
        if step == args.warmup:
            _collective_hooks.add_listener(listener)
            inside["wall"] = inside["cpu"] = 0.0
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        workloads.train_step(model, optim, batches.get(step))
        if step >= args.warmup:
            wall[on].append(time.perf_counter() - start)
            cpu[on].append(time.process_time() - start_cpu)
    _collective_hooks.remove_listener(listener)
    if rank == 0:
        queue.put(
            {
                "us_per_call": {k: 1e6 * statistics.median(v) for k, v in per_call.items()},
                "cpu_us_per_call": {k: 1e6 * statistics.median(v) for k, v in per_call_cpu.items()},
                "collectives_per_step": count[0] / (2 * args.steps),
                "step_wall_s": {k: statistics.median(v) for k, v in wall.items()},
                "step_cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
                "inside_guard_share": {
                    "wall": inside["wall"] / sum(wall[True]),
                    "cpu": inside["cpu"] / sum(cpu[True]),
                },
                "raw_wall_s": wall,
            }
        )
    dist.destroy_process_group()


def main() -> None:
    p = harness.ab_parser(__doc__, 2, 10, "timed steps per side (on and off)")
    p.add_argument("--calls", type=int, default=500, help="guard calls timed on their own")
    args = p.parse_args()
    result = harness.spawn_ranks(_worker, args.world_size, args, "fsdp_compose_guard_")
    on, off = result["step_wall_s"][True], result["step_wall_s"][False]
    cpu_on, cpu_off = result["step_cpu_s"][True], result["step_cpu_s"][False]
    n = result["collectives_per_step"]
    us, cpu_us = result["us_per_call"], result["cpu_us_per_call"]
    added = us[True] - us[False]
    print(
        f"4160-float all-gather issued and waited (loopback, W={args.world_size}, median): "
        f"guarded {us[True]:.0f} us, unguarded {us[False]:.0f} us -> the guard adds {added:.0f} us "
        f"of latency; on-CPU (rank 0, all threads) {cpu_us[True]:.0f} vs {cpu_us[False]:.0f} us"
    )
    print(f"collectives per step: {n:.0f}")
    print(
        f"step wall time, median of {args.steps}: guard on {on:.3f} s, off {off:.3f} s, ratio {on / off:.3f}"
    )
    print(
        f"step on-CPU time (rank 0): guard on {cpu_on:.3f} s, off {cpu_off:.3f} s, ratio {cpu_on / cpu_off:.3f}"
    )
    share = result["inside_guard_share"]
    print(
        f"training thread inside the guard's launch during guarded steps: {share['wall']:.2%} "
        f"of their wall time, {share['cpu']:.2%} of their on-CPU time (rank 0)"
    )
    print(f"raw step wall times (s), on: {[round(t, 3) for t in result['raw_wall_s'][True]]}")
    print(f"raw step wall times (s), off: {[round(t, 3) for t in result['raw_wall_s'][False]]}")


if __name__ == "__main__":
    main()
