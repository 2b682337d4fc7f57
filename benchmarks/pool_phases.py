"""What the host-buffer pool holds at each phase of a training step, per rank.

    python benchmarks/pool_phases.py --preset large --world-size 2 --host-buffers pooled

The memory benchmark's training step (``workloads.py``: the examples' GPT, one
unit per block plus the root, AdamW, ``zero_grad(set_to_none=True)``) on fresh
gloo ranks. After each phase (forward, backward, optimizer step, ``zero_grad``)
of each step it prints the phase's resident peak above the reset (``VmHWM``
since the previous phase, reset after each), the pool's buffers in use, cached
(free buffers and parked pages) and, per page-rounded size, how many are free
or parked (``_host_memory.BufferPool``). ``--max-cached`` changes the largest
buffer the pool keeps (``BufferPool(max_cached=...)``; e.g. ``1e12`` for no
bound). The measurement behind the "Bounded pool" subsection of benchmarks/HISTORY.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness

MIB = 2**20


def _sizes(slots: dict[int, list[Any]]) -> str:
    return ", ".join(f"{s / MIB:.1f}M x{len(v)}" for s, v in sorted(slots.items()) if v)


def _worker(rank: int, world: int, init_file: str, args: argparse.Namespace, queue: Any) -> None:
    harness.init_gloo(rank, world, init_file)
    import measure
    import torch.distributed as dist
    import workloads

    from fsdp_compose import _host_memory

    if args.max_cached is not None:
        _host_memory.POOL = _host_memory.BufferPool(max_cached=int(args.max_cached))
    _host_memory.set_mode(args.host_buffers)
    pool = _host_memory.POOL
    model = workloads.build_gpt(args.preset, "fsdp_compose")
    optim = workloads.make_optimizer(model)
    batches = workloads.Batches(workloads.PRESETS[args.preset], world, rank, world)
    base = measure.reset_peak_rss()
    rows: list[str] = []

    def phase(name: str) -> None:
        peak = measure.peak_rss_bytes() - base
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the next phase's peak starts from here
        rows.append(
            f"{name:16s} {peak / MIB:8.1f} {pool.in_use_bytes() / MIB:8.1f} "
            f"{pool.cached_bytes() / MIB:8.1f}  free {{{_sizes(pool._free)}}} "
            f"parked {{{_sizes(pool._parked)}}}"
        )

    for step in range(args.steps):
        x, y = batches.get(step)
        loss = workloads.loss_fn(model(x), y)
        phase(f"step {step} forward")
        loss.backward()
        phase(f"step {step} backward")
        optim.step()
        phase(f"step {step} optimizer")
        optim.zero_grad(set_to_none=True)
        phase(f"step {step} zero_grad")
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        queue.put(everyone)
    dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="large")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--host-buffers", default="pooled", choices=("pooled", "mapped", "heap"))
    p.add_argument("--max-cached", type=float, default=None, metavar="BYTES")
    args = p.parse_args()
    ranks = harness.spawn_ranks(_worker, args.world_size, args, "pool_phases")
    print(f"{'phase':16s} {'peak':>8s} {'in use':>8s} {'cached':>8s}  (MiB above the reset)")
    for rank, rows in enumerate(ranks):
        print(f"rank {rank}")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
