"""Hot-path overhead: the per-unit, per-step CPU cost of an FSDP's hooks and scheduler.

Model: ``units`` tiny ``Linear(width, width)`` layers in a ``Sequential``; for the
FSDPs each layer is its own unit (``fully_shard`` on every layer, then the root).
The compute per layer is a few microseconds, so the step time is dominated by what
the implementation does around each unit.

Method: forward + backward of a fixed input (the optimizer is left out: it is the
same torch optimizer over the same DTensor parameters for both FSDPs, and its cost
is not the hooks' or the scheduler's). Per step we record the training thread's
on-CPU time (``/proc/.../schedstat``; excludes time blocked on collectives and
time preempted), and its wall time. Then

    per-unit overhead = (median step[impl] - median step[unwrapped]) / units

where ``unwrapped`` is the same model without any FSDP, run by the same number of
processes. At W = 1 neither FSDP needs to communicate; at W > 1 the on-CPU figure
includes the cost of issuing (not waiting for) two collectives per unit.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import measure
from workloads import fully_shard_fn

OVERHEAD_IMPLS = ("unwrapped", "fsdp2", "fsdp_compose")


def build(impl: str, units: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(units)))
    if impl != "unwrapped":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard = fully_shard_fn(impl)
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def overhead_job(config: dict[str, Any]) -> dict[str, Any]:
    """One rank's forward+backward step times for the tiny-unit model."""
    model = build(config["impl"], config["units"], config["width"])
    x = torch.randn(config["batch"], config["width"], generator=torch.Generator().manual_seed(1))
    samples: list[dict[str, float]] = []
    for i in range(config["warmup"] + config["steps"]):
        start = measure.thread_times()
        model(x).sum().backward()
        elapsed = measure.thread_times() - start
        model.zero_grad(set_to_none=True)
        if i >= config["warmup"]:
            samples.append({"wall": elapsed.wall, "on_cpu": elapsed.on_cpu,
                            "blocked": elapsed.blocked})
    return {
        "rank": dist.get_rank(),
        "steps": samples,
        "median_wall": statistics.median(s["wall"] for s in samples),
        "median_on_cpu": statistics.median(s["on_cpu"] for s in samples),
    }
