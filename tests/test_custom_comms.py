"""Custom collectives and communication buffers: ``set_custom_all_gather`` /
``set_custom_reduce_scatter`` (FSDP2's ``Comm`` interface: ``allocate`` plus
``__call__``) and the communication-allocator settings (``set_symm_mem_for_comm``,
``set_allocate_memory_from_process_group_for_comm``), each against FSDP2's semantics."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dist_utils import run_distributed
from gpt import GPT, GPTConfig, make_batch
from helpers import (
    collective_log,
    gpt_train_step,
    local_slice,
    max_param_diff,
    rank_world,
)
from models import TINY_GPT

from fsdp_compose import fully_shard, trace

_TIMELINE = trace.Timeline()  # one per rank process, cleared by each recording
TINY = TINY_GPT


# torch 2.13 renamed the single-tensor collectives; older releases have the old names
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _CountingAllGather:
    """A custom all-gather in FSDP2's ``AllGather`` interface that records its calls."""

    def __init__(self) -> None:
        self.allocations: list[int] = []
        self.calls: list[tuple[int, bool, bool]] = []  # (group size, in place, async)

    def allocate(self, size, *, dtype, device):  # type: ignore[no-untyped-def]
        self.allocations.append(int(size[0]))
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):  # type: ignore[no-untyped-def]
        world = group.size()
        row = output_tensor.numel() // world
        in_place = input_tensor.data_ptr() == output_tensor.data_ptr() + (
            dist.get_rank(group) * row * output_tensor.element_size()
        )
        self.calls.append((world, in_place, async_op))
        return _ALL_GATHER(output_tensor, input_tensor, group=group, async_op=async_op)


class _CountingReduceScatter:
    """A custom reduce-scatter in FSDP2's ``ReduceScatter`` interface."""

    def __init__(self) -> None:
        self.allocations: list[int] = []
        self.ops: list[object] = []

    def allocate(self, size, *, dtype, device):  # type: ignore[no-untyped-def]
        self.allocations.append(int(size[0]))
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore[no-untyped-def]
        self.ops.append(op)
        return _REDUCE_SCATTER(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class _WrongSizeAllGather(_CountingAllGather):
    def allocate(self, size, *, dtype, device):  # type: ignore[no-untyped-def]
        return torch.empty(int(size[0]) + 1, dtype=dtype, device=device)


def _custom_comm_job() -> dict:
    """Blocks gather and reduce through user comms (with ``reshard_after_forward=2``
    at 4 ranks, so backward re-gathers within pairs); the root keeps the defaults."""
    rank, world = rank_world()
    cfg = GPTConfig(**TINY)
    torch.manual_seed(0)
    ref = GPT(cfg)
    model = copy.deepcopy(ref)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=2)
    fully_shard(model)
    ag, rs = _CountingAllGather(), _CountingReduceScatter()
    for block in model.blocks:
        block.set_custom_all_gather(ag)
        block.set_custom_reduce_scatter(rs)
    opts = (
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        torch.optim.AdamW(ref.parameters(), lr=1e-3),
    )
    steps = 3
    with collective_log(model) as log:
        diffs = [gpt_train_step(model, ref, opts, cfg, s) for s in range(steps)]
    out = {
        "diffs": diffs,
        "param_diff": max_param_diff(model, ref)[0],
        "ag_calls": ag.calls,
        "ag_allocations": len(ag.allocations),
        "rs_calls": len(rs.ops),
        "rs_ops_sum": all(op == dist.ReduceOp.SUM for op in rs.ops),
        "rs_allocations": len(rs.allocations),
        "logged": log.kinds(),
        "steps": steps,
        "blocks": cfg.n_layer,
    }
    # None restores the default collectives
    for block in model.blocks:
        block.set_custom_all_gather(None)
        block.set_custom_reduce_scatter(None)
    before = (len(ag.calls), len(rs.ops))
    out["diffs"].append(gpt_train_step(model, ref, opts, cfg, steps))
    out["after_reset"] = (len(ag.calls), len(rs.ops)) == before
    # bad input: clear errors, raised identically on every rank (no hang)
    with pytest.raises(TypeError, match="allocate"):
        model.blocks[0].set_custom_all_gather(object())
    bad = copy.deepcopy(ref)
    for block in bad.blocks:
        fully_shard(block)
    fully_shard(bad)
    bad.blocks[0].set_custom_all_gather(_WrongSizeAllGather())
    x, _ = make_batch(cfg, 2 * world, 0)
    with pytest.raises(ValueError, match=r"blocks\.0's custom all-gather: allocate\(\) returned"):
        bad(local_slice(x, rank, world))
    return out


def test_custom_all_gather_and_reduce_scatter() -> None:
    for r in run_distributed(_custom_comm_job, 4):
        assert max(r["diffs"]) < 1e-5 and r["param_diff"] < 1e-4, r
        n = r["steps"] * r["blocks"]
        # per block and step: the forward gather over 4 ranks, the backward one
        # over the post-forward pair; always in place (FSDP2's contract), async
        assert sorted(c[0] for c in r["ag_calls"]) == [2] * n + [4] * n, r["ag_calls"]
        assert all(in_place and is_async for _, in_place, is_async in r["ag_calls"]), r["ag_calls"]
        assert r["ag_allocations"] == 2 * n
        assert r["rs_calls"] == n and r["rs_ops_sum"] and r["rs_allocations"] == 2 * n, r
        # the custom collectives are still logged (trace, debug checks); the root's
        # default ones too
        assert r["logged"]["all_gather"] == 2 * n + r["steps"], r["logged"]
        assert r["logged"]["reduce_scatter"] == n + r["steps"], r["logged"]
        assert r["after_reset"], r


# -- communication-allocator settings ------------------------------------------


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _train(model: nn.Module, steps: int = 2) -> list[float]:
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + torch.distributed.get_rank())
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _comm_allocator_job() -> dict:
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Collect(level=logging.WARNING)
    logger = logging.getLogger("fsdp_compose")
    logger.addHandler(handler)
    try:
        plain = _mlp()
        fully_shard(plain[0])
        fully_shard(plain)
        tuned = _mlp()
        fully_shard(tuned[0])
        fully_shard(tuned)
        for _ in range(2):  # a second call on the same or another module adds no note
            tuned.set_symm_mem_for_comm()
            tuned[0].set_allocate_memory_from_process_group_for_comm(True)
        tuned.set_allocate_memory_from_process_group_for_comm(False)  # the default: silent
        errors = []
        for call in (
            lambda: tuned.set_symm_mem_for_comm("NVSHMEM"),
            lambda: tuned.set_allocate_memory_from_process_group_for_comm(1),  # type: ignore[arg-type]
        ):
            try:
                call()
            except (TypeError, ValueError) as exc:
                errors.append(type(exc).__name__)
        return {
            "notes": [r.getMessage() for r in records],
            "errors": errors,
            "same": _train(plain) == _train(tuned),
        }
    finally:
        logger.removeHandler(handler)


def test_comm_allocator_settings_accepted_with_one_note() -> None:
    for r in run_distributed(_comm_allocator_job, 2):
        assert r["same"]
        assert r["errors"] == ["ValueError", "TypeError"]
        assert len(r["notes"]) == 2, r["notes"]
        assert "set_symm_mem_for_comm()" in r["notes"][0] and "gloo/CPU" in r["notes"][0]
        assert "set_allocate_memory_from_process_group_for_comm(True)" in r["notes"][1]
