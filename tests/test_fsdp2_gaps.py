"""FSDP2 API gaps real clients hit (issue 21): communication-allocator settings,
FSDP2's exception types, ``dp_mesh_dims`` on a full SPMD mesh."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
from dist_utils import run_distributed

from fsdp_compose import fully_shard


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
