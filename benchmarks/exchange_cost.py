"""What the always-on desync protection costs: gloo collectives as tagged exchanges
(see [Note: collectives matched by what they are] in ``fsdp_compose/_gloo.py``)
against gloo's own collectives as fsdp_compose issued them before.

    python benchmarks/exchange_cost.py --preset small --world-size 2 --steps 12

"Before" is re-created here as a route: all-gathers as one gloo broadcast per rank
into the output's rows (rows of 64 KiB and more) or gloo's own all-gather
(smaller rows), reduce-scatters as gloo's all-to-all and a local sum -- the same
bytes, matched by order only. Both run *in the same processes*, alternating call by
call and step by step, so load from other processes hits both alike:

* per collective (loopback): an all-gather of a tiny unit's row (4,160 floats)
  and of a 1 MiB row, and a reduce-scatter of 2 x 4,160 floats, issued and
  waited; median latency and on-CPU time (rank 0, all threads);
* per step: the benchmark's training step (``workloads.py``: the examples' GPT,
  one unit per block plus the root, AdamW); median wall and on-CPU time.
The stall watchdog runs in both (it wakes five times a second and only reads one
attribute while nothing stalls).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness

_BROADCAST_MIN_ROW_BYTES = 64 * 1024


class _Works:
    def __init__(self, works: list[Any], finish: Any = None) -> None:
        self._works, self._finish = works, finish

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        if self._finish is not None:
            self._finish()
        return True

    def get_future(self) -> Any:
        return torch.futures.collect_all([w.get_future() for w in self._works])


def _before_route() -> Any:
    """The gloo route before the exchanges: collectives matched by order."""
    from fsdp_compose import _collectives, _host_memory

    class BeforeRoute(_collectives.Route):
        __slots__ = ()
        name = "gloo-before"

        def gathers_in_place(self, row_bytes: int) -> bool:
            return True

        def all_gather(self, output, input, group, label, step):  # type: ignore[no-untyped-def]
            rows = output.view(group.size(), -1)
            if rows[0].numel() * rows.element_size() < _BROADCAST_MIN_ROW_BYTES:
                return group._allgather_base(output, input)
            works = []
            for root in range(group.size()):
                opts = dist.BroadcastOptions()
                opts.rootRank, opts.rootTensor = root, 0
                works.append(group.broadcast([rows[root]], opts))
            return _Works(works)

        def reduce_scatter(self, output, input, group, label, step):  # type: ignore[no-untyped-def]
            # the receive buffer allocated as the exchanges allocate theirs
            received = _host_memory.empty(input.numel(), input.dtype, input.device)
            work = group.alltoall_base(received, input, [], [])
            rows = received.view(group.size(), -1)
            return _Works([work], lambda: torch.sum(rows, dim=0, out=output))

    return BeforeRoute()


def _worker(
    rank: int, world: int, init_file: str, args: argparse.Namespace, queue: mp.Queue
) -> None:
    harness.init_gloo(rank, world, init_file)
    import workloads

    from fsdp_compose import _collectives

    group = dist.group.WORLD
    routes = {"exchange": _collectives.route_of(group), "before": _before_route()}
    assert routes["exchange"].name == "gloo", routes["exchange"].name

    def all_gather(row: int) -> Any:
        out = torch.empty(world * row)

        def run(route: Any, step: int) -> None:
            out.view(world, row)[rank].normal_()
            route.all_gather(out, out.view(world, row)[rank], group, "probe", step).wait()

        return run

    def reduce_scatter(row: int) -> Any:
        inp, out = torch.randn(world * row), torch.empty(row)

        def run(route: Any, step: int) -> None:
            route.reduce_scatter(out, inp, group, "probe", step).wait()

        return run

    probes = {
        "all_gather 4160 floats": all_gather(4160),
        "all_gather 1 MiB row": all_gather(262144),
        "reduce_scatter 2x4160 floats": reduce_scatter(4160),
    }
    per_call: dict[str, dict[str, list[float]]] = {}
    per_call_cpu: dict[str, dict[str, list[float]]] = {}
    for name, run in probes.items():
        per_call[name] = {"exchange": [], "before": []}
        per_call_cpu[name] = {"exchange": [], "before": []}
        for i in range(2 * (args.calls + 20)):
            which = "exchange" if i % 2 == 0 else "before"
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            run(routes[which], i)
            if i >= 40:
                per_call[name][which].append(time.perf_counter() - start)
                per_call_cpu[name][which].append(time.process_time() - start_cpu)

    model = workloads.build_gpt(args.preset, "fsdp_compose")
    optim = workloads.make_optimizer(model)
    batches = workloads.Batches(workloads.PRESETS[args.preset], args.global_batch, rank, world)
    wall: dict[str, list[float]] = {"exchange": [], "before": []}
    cpu: dict[str, list[float]] = {"exchange": [], "before": []}
    for step in range(args.warmup + 2 * args.steps):
        which = "exchange" if step % 2 == 0 else "before"
        for module in model.modules():
            state = getattr(module, "_fsdp_state", None)
            unit = state().unit if state is not None and state().unit is not None else None
            if unit is not None and unit._initialized:
                unit._all_gather.route = routes[which]
                unit._reduce_scatter.route = routes[which]
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        workloads.train_step(model, optim, batches.get(step))
        if step >= args.warmup:
            wall[which].append(time.perf_counter() - start)
            cpu[which].append(time.process_time() - start_cpu)
    if rank == 0:
        queue.put(
            {
                "us_per_call": {
                    n: {k: 1e6 * statistics.median(v) for k, v in d.items()}
                    for n, d in per_call.items()
                },
                "cpu_us_per_call": {
                    n: {k: 1e6 * statistics.median(v) for k, v in d.items()}
                    for n, d in per_call_cpu.items()
                },
                "step_wall_s": {k: statistics.median(v) for k, v in wall.items()},
                "step_cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
            }
        )
    dist.destroy_process_group()


def main() -> None:
    p = harness.ab_parser(__doc__, 2, 12, "timed steps per side")
    p.add_argument("--calls", type=int, default=300, help="timed calls per side and probe")
    args = p.parse_args()
    result = harness.spawn_ranks(_worker, args.world_size, args, "fsdp_compose_exchange_")
    print(f"W={args.world_size}, loopback, median over {args.calls} calls each, alternating:")
    for name, us in result["us_per_call"].items():
        cpu_us = result["cpu_us_per_call"][name]
        print(
            f"  {name}: exchange {us['exchange']:.0f} us, before {us['before']:.0f} us "
            f"(added {us['exchange'] - us['before']:+.0f} us); on-CPU {cpu_us['exchange']:.0f} "
            f"vs {cpu_us['before']:.0f} us"
        )
    wall, cpu = result["step_wall_s"], result["step_cpu_s"]
    print(
        f"training step ({args.preset}, median of {args.steps} each): exchange {wall['exchange']:.4f} s, "
        f"before {wall['before']:.4f} s, ratio {wall['exchange'] / wall['before']:.3f}; on-CPU "
        f"(rank 0) {cpu['exchange']:.4f} vs {cpu['before']:.4f} s, ratio "
        f"{cpu['exchange'] / cpu['before']:.3f}"
    )


if __name__ == "__main__":
    main()
