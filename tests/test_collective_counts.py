"""torch's own tools see the same collectives as with torch's FSDP2.

``CommDebugMode`` (the dispatch-level counter FSDP2's own tests use) counts the
collectives of one training step for fsdp_compose and for torch's FSDP2 on the
same model, settings and data, in the same job: the kinds and numbers must be
equal, step by step. The profiler sees every hook and collective under a label
naming the unit.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from gpt import GPT, GPTConfig, loss_fn, make_batch
from helpers import local_slice, rank_world
from models import TINY_GPT
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from fsdp_compose import fully_shard


def _shard(model: GPT, shard_fn: Any, options: dict[str, Any], mesh: Any) -> GPT:
    kwargs: dict[str, Any] = {"mesh": mesh}
    if "reshard_after_forward" in options:
        kwargs["reshard_after_forward"] = options["reshard_after_forward"]
    for block in model.blocks:
        shard_fn(block, **kwargs)
    shard_fn(model, mesh=mesh)
    return model


def _counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}


def _count_job(options: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    rank, world = rank_world()
    if options.get("hsdp"):
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    cfg = GPTConfig(**TINY_GPT)
    base = GPT(cfg)
    ours = _shard(copy.deepcopy(base), fully_shard, options, mesh)
    theirs = _shard(copy.deepcopy(base), torch_fully_shard, options, mesh)
    micro = options.get("micro", 1)
    out: dict[str, Any] = {"ours": [], "theirs": []}
    for name, model in (("ours", ours), ("theirs", theirs)):
        for step in range(2):
            x, y = make_batch(cfg, 2 * world * micro, step)
            xs, ys = local_slice(x, rank, world), local_slice(y, rank, world)
            per_micro = xs.shape[0] // micro
            for i in range(micro):
                model.set_requires_gradient_sync(i == micro - 1)  # type: ignore[operator]
                with CommDebugMode() as fwd:
                    loss = loss_fn(
                        model(xs[i * per_micro : (i + 1) * per_micro]),
                        ys[i * per_micro : (i + 1) * per_micro],
                    )
                with CommDebugMode() as bwd:
                    loss.backward()
                out[name].append({"forward": _counts(fwd), "backward": _counts(bwd)})
            if step == 0:
                model.zero_grad()
    out["grad_diff"] = max(
        (a.grad.full_tensor() - b.grad.full_tensor()).abs().max().item()
        for a, b in zip(ours.parameters(), theirs.parameters())
        if a.grad is not None
    )
    dist.barrier()
    return out


CASES = [
    (2, {"reshard_after_forward": True}),
    (4, {"reshard_after_forward": True}),
    (2, {"reshard_after_forward": False}),
    (4, {"reshard_after_forward": 2}),
    (4, {"hsdp": True}),
    (2, {"micro": 2}),
]


@pytest.mark.parametrize(("world", "options"), CASES, ids=[str(c) for c in CASES])
def test_comm_debug_mode_counts_match_torch_fsdp2(world: int, options: dict[str, Any]) -> None:
    for r in run_distributed(_count_job, world, options):
        assert r["ours"] == r["theirs"], r
        steps = r["ours"]
        # what the counter sees are the real collectives: all-gathers in forward
        assert any("allgather" in k for k in steps[0]["forward"]), steps[0]
        assert r["grad_diff"] == 0.0, r["grad_diff"]


def _profile_job() -> dict[str, Counter[str]]:
    """The ``FSDP::`` profiler spans of one training step, fsdp_compose's and torch's
    FSDP2's on the same model."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    rank, world = rank_world()
    out = {}
    for name, shard in (("fsdp_compose", fully_shard), ("fsdp2", torch_fully_shard)):
        torch.manual_seed(0)
        cfg = GPTConfig(**TINY_GPT)
        model = GPT(cfg)
        for block in model.blocks:
            shard(block)
        shard(model)
        x, y = make_batch(cfg, 2 * world, 0)
        loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        out[name] = Counter(e.name for e in prof.events() if e.name.startswith("FSDP::"))
    return out


# FSDP2's spans that fsdp_compose opens too, the root's without a unit (its FQN is "").
_SPANS = [
    "FSDP::root_pre_forward",
    "FSDP::pre_forward",
    "FSDP::pre_forward (blocks.1)",
    "FSDP::all_gather",
    "FSDP::all_gather (blocks.1)",
    "FSDP::post_forward (blocks.1)",
    "FSDP::pre_backward (blocks.1)",
    "FSDP::post_backward_reduce (blocks.1)",
    "FSDP::post_backward_reduce",
    "FSDP::root_post_backward_callback",
]


def test_profiler_spans_named_as_fsdp2s() -> None:
    r = run_distributed(_profile_job, 2)[0]
    ours, fsdp2 = r["fsdp_compose"], r["fsdp2"]
    for span in _SPANS:
        assert ours[span] == fsdp2[span] > 0, (span, ours, fsdp2)
    # Beyond FSDP2's names: only each unit's post-backward span (FSDP2 splits it in three).
    extra = {name for name in ours if name not in fsdp2}
    assert extra and all(name.startswith("FSDP::post_backward") for name in extra), extra


_LOGGED_STEP = """
import sys, torch, torch.distributed as dist, torch.nn as nn
from fsdp_compose import fully_shard
dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + sys.argv[1])
model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(2)])
for layer in model:
    fully_shard(layer)
fully_shard(model)
model(torch.randn(4, 4)).sum().backward()
dist.destroy_process_group()
"""


def test_torch_logs_fsdp_shows_fsdp2s_lines(tmp_path: Path) -> None:
    # torch's test_fully_shard_logging.py: TORCH_LOGS=+fsdp shows these debug lines.
    env = {**os.environ, "TORCH_LOGS": "+fsdp"}
    args = [sys.executable, "-c", _LOGGED_STEP, str(tmp_path / "init")]
    stderr = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120).stderr
    for line in ("root_pre_forward", "root_post_backward"):
        assert f"FSDP::{line}" in stderr, (line, stderr[-2000:])
    for hook in ("pre_forward", "post_forward", "pre_backward", "post_backward"):
        for unit in (0, 1):
            assert f"FSDP::{hook} ({unit})" in stderr, (hook, unit, stderr[-2000:])
