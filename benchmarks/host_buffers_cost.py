"""What each host-buffer mode costs per training step (see [Note: per-step host
buffers outside the heap] in ``fsdp_compose/_host_memory.py``).

    python benchmarks/host_buffers_cost.py --preset small --world-size 2 --steps 30

One copy of the benchmark's training step (``workloads.py``: the examples' GPT,
one unit per block plus the root, AdamW) per mode, all *in the same processes*,
built under its mode and trained in turn, step by step (so load from other
processes on a shared machine hits every mode alike). Reports the median wall
and on-CPU time (rank 0, all threads) per mode and their ratios to ``heap``.

Modes: ``heap`` (``torch.empty``), ``mapped`` (a fresh mapping per buffer),
``pooled`` (the default: mappings reused through the pool, kept between steps),
``pooled-unparked`` (the pool without parking the unsharded storage's pages: they
are given back at reshard and fault in again), ``pooled-step`` (the pool emptied
after every step: what a pool that does not outlive the step would cost).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness

MODES = ("heap", "mapped", "pooled", "pooled-unparked", "pooled-step")


def _mode(arm: str) -> str:
    return arm.partition("-")[0]


def _worker(
    rank: int, world: int, init_file: str, args: argparse.Namespace, queue: mp.Queue
) -> None:
    harness.init_gloo(rank, world, init_file)
    import workloads

    from fsdp_compose import _host_memory

    modes = args.modes.split(",")
    pools = {m: _host_memory.BufferPool(0 if m == "pooled-unparked" else None) for m in modes}
    arms = {}
    for mode in modes:
        _host_memory.POOL = pools[mode]
        _host_memory.set_mode(_mode(mode))
        model = workloads.build_gpt(args.preset, "fsdp_compose")
        arms[mode] = (model, workloads.make_optimizer(model))
    batches = workloads.Batches(workloads.PRESETS[args.preset], args.global_batch, rank, world)
    wall: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    for step in range(args.warmup + args.steps):
        for mode in modes:
            _host_memory.POOL = pools[mode]  # first: leaving the pooled mode empties POOL
            _host_memory.set_mode(_mode(mode))
            model, optim = arms[mode]
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            workloads.train_step(model, optim, batches.get(step))
            if mode.endswith("-step"):
                pools[mode].release()
            if step >= args.warmup:
                wall[mode].append(time.perf_counter() - start)
                cpu[mode].append(time.process_time() - start_cpu)
    if rank == 0:
        queue.put(
            {
                "wall": {m: statistics.median(v) for m, v in wall.items()},
                "cpu": {m: statistics.median(v) for m, v in cpu.items()},
                "pool_bytes": {m: p.cached_bytes() for m, p in pools.items()},
            }
        )
    dist.destroy_process_group()


def main() -> None:
    p = harness.ab_parser(__doc__, 3, 30, "timed steps per mode")
    p.add_argument("--modes", default=",".join(MODES))
    args = p.parse_args()
    r = harness.spawn_ranks(_worker, args.world_size, args, "fsdp_compose_hostbuf_")
    base_wall, base_cpu = r["wall"]["heap"], r["cpu"]["heap"]
    print(f"W={args.world_size}, preset {args.preset}, median of {args.steps} steps per mode")
    print("| mode | wall (s) | / heap | on-CPU (s) | / heap | pool at end (MiB) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for mode in r["wall"]:
        w, c = r["wall"][mode], r["cpu"][mode]
        pool = r["pool_bytes"][mode] / 2**20
        print(
            f"| {mode} | {w:.4f} | {w / base_wall:.3f} | {c:.4f} | {c / base_cpu:.3f} | {pool:.1f} |"
        )


if __name__ == "__main__":
    main()
