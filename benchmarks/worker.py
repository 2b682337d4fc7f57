"""One rank of one benchmark job (started by ``harness.py``, one process per rank).

    python benchmarks/worker.py CONFIG_JSON RANK

The harness sets OMP_NUM_THREADS=1 before this process starts; torch is also told
to use one thread, so W ranks use W cores' worth of compute at most.

A training job (``kind: "train"``) runs, in this order:

1. loopback calibration (W > 1): an all-gather of known size and a quiet window,
   to check that ``lo`` counts each byte once and to see background traffic;
2. RSS baseline, then model build / shard / materialize / optimizer;
3. memory reset (``malloc_trim``, ``clear_refs``); RSS at reset;
4. ``warmup`` steps; barrier; loopback counter; ``steps`` timed steps (each
   timed on its own, with the thread's on-CPU/run-delay/blocked split);
   barrier; loopback counter; ``VmHWM``;
5. ``instrumented`` steps under the implementation's probe (see ``probes.py``);
6. the global mean loss of every step (one all-reduce at the end, so the steps
   themselves carry no extra synchronization).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import measure  # noqa: E402
import probes  # noqa: E402
import workloads  # noqa: E402

_CALIBRATION_BYTES = 8 << 20  # per rank
_QUIET_WINDOW_S = 0.5


def calibrate_loopback() -> dict[str, float] | None:
    """Checks the loopback accounting with an all-gather of known size.

    Each rank must send its chunk to the W-1 others, so the ranks together send
    W (W-1) N bytes; ``ratio`` is measured / that. Then measures the ``lo`` traffic
    of everything else on the machine during a short idle window.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return None
    chunk = torch.ones(_CALIBRATION_BYTES // 4)
    out = torch.empty(world * chunk.numel())
    all_gather = getattr(dist, probes.torch_collective_name("all_gather"))
    all_gather(out, chunk)  # warm up connections
    dist.barrier()
    before = measure.loopback_tx_bytes()
    all_gather(out, chunk)
    dist.barrier()
    after = measure.loopback_tx_bytes()
    time.sleep(_QUIET_WINDOW_S)
    idle = measure.loopback_tx_bytes()
    dist.barrier()
    if rank != 0:
        return None
    expected = world * (world - 1) * _CALIBRATION_BYTES
    return {
        "ratio": (after - before) / expected,
        "background_bytes_per_s": (idle - after) / _QUIET_WINDOW_S,
    }


def _times_dict(t: measure.ThreadTimes) -> dict[str, float]:
    return {"wall": t.wall, "on_cpu": t.on_cpu, "run_delay": t.run_delay, "blocked": t.blocked}


def train_job(config: dict[str, Any]) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    impl, preset = config["impl"], config["preset"]
    calibration = calibrate_loopback()

    measure.malloc_trim()
    rss_baseline = measure.rss_bytes()
    model = workloads.build_gpt(preset, impl, config["reshard_after_forward"])
    optim = workloads.make_optimizer(model)
    batches = workloads.Batches(workloads.PRESETS[preset], config["global_batch"], rank, world)
    rss_at_reset = measure.reset_peak_rss()

    losses: list[torch.Tensor] = []
    step = 0
    for _ in range(config["warmup"]):
        losses.append(workloads.train_step(model, optim, batches.get(step)))
        step += 1

    dist.barrier()
    lo_before = measure.loopback_tx_bytes()
    timed: list[dict[str, float]] = []
    for _ in range(config["steps"]):
        batch = batches.get(step)  # data generation is not part of the step
        start = measure.thread_times()
        losses.append(workloads.train_step(model, optim, batch))
        timed.append(_times_dict(measure.thread_times() - start))
        step += 1
    dist.barrier()
    lo_after = measure.loopback_tx_bytes()
    vm_hwm = measure.peak_rss_bytes()

    instrumented: list[dict[str, float]] = []
    with probes.probe(impl, model) as probe:
        for _ in range(config["instrumented"]):
            batch = batches.get(step)
            start = measure.thread_times()
            losses.append(workloads.train_step(model, optim, batch))
            instrumented.append(_times_dict(measure.thread_times() - start))
            step += 1

    mean_losses = torch.stack(losses)
    dist.all_reduce(mean_losses)
    mean_losses /= world

    local_param_bytes = sum(_local_bytes(p) for p in model.parameters())
    optim_bytes = sum(
        _local_bytes(v) for s in optim.state.values() for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    return {
        "rank": rank,
        "timed_steps": timed,
        "instrumented_steps": instrumented,
        **probe.summary(max(1, config["instrumented"])),
        "losses": mean_losses.tolist(),
        "memory": {
            "rss_baseline": rss_baseline,
            "rss_at_reset": rss_at_reset,
            "vm_hwm": vm_hwm,
            "local_param_bytes": local_param_bytes,
            "local_optim_state_bytes": optim_bytes,
        },
        "loopback": (
            {"tx_bytes": lo_after - lo_before, "calibration": calibration} if rank == 0 else None
        ),
    }


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def main() -> None:
    config_path, rank = sys.argv[1], int(sys.argv[2])
    with open(config_path) as f:
        config = json.load(f)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{config['store']}",
        rank=rank,
        world_size=config["world_size"],
        timeout=timedelta(seconds=config.get("pg_timeout_s", 600)),
    )
    if config["kind"] == "train":
        result = train_job(config)
    elif config["kind"] == "overhead":
        import overhead

        result = overhead.overhead_job(config)
    elif config["kind"] == "estimate":
        import estimator_accuracy

        result = estimator_accuracy.measure_job(config)
    else:
        raise ValueError(f"unknown job kind {config['kind']!r}")
    with open(os.path.join(config["out_dir"], f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
