"""``debug.check_optimizer``: opt-in warnings for optimizer misuse that FSDP2 runs
silently; a valid program gets none, and nothing is checked unless asked."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
from dist_utils import run_distributed

from fsdp_compose import debug, fully_shard


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.a(x)))


def _step(model: nn.Module, optim: torch.optim.Optimizer) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(4, 8)).sum().backward()
        optim.step()
        optim.zero_grad()
    return [
        str(w.message)
        for w in caught
        if "fully_shard" in str(w.message) or "synchron" in str(w.message)
    ]


def _checks_job() -> dict[str, list[str]]:
    torch.manual_seed(0)
    out: dict[str, list[str]] = {}

    model = _Net()  # valid: units, then the root, then the optimizer
    fully_shard(model.a)
    fully_shard(model.b)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters())
    debug.check_optimizer(optim, model)
    out["valid"] = _step(model, optim)
    model.set_requires_gradient_sync(False)
    out["sync_off"] = _step(model, optim)
    model.set_requires_gradient_sync(True)
    out["unchecked_sync_off"] = []

    model = _Net()  # optimizer built before fully_shard
    early = torch.optim.AdamW(model.parameters())
    fully_shard(model.a)
    fully_shard(model)
    debug.check_optimizer(early, model)
    out["before_fully_shard"] = _step(model, early)

    model = _Net()  # forgotten root: plain head next to sharded blocks
    fully_shard(model.a)
    fully_shard(model.b)
    optim = torch.optim.AdamW(model.parameters())
    handle = debug.check_optimizer(optim, model)
    out["no_root"] = _step(model, optim)
    handle.remove()
    out["removed"] = _step(model, optim)

    model = _Net()  # the same program, unchecked: silent, as FSDP2
    fully_shard(model.a)
    fully_shard(model.b)
    optim = torch.optim.AdamW(model.parameters())
    out["unchecked_no_root"] = _step(model, optim)
    return out


def test_check_optimizer_warns_only_on_misuse() -> None:
    for result in run_distributed(_checks_job, 2):
        assert result["valid"] == [], result["valid"]
        assert any("synchronization is off" in m for m in result["sync_off"]), result
        assert any("replaced by sharded ones" in m for m in result["before_fully_shard"]), result
        assert any("is not annotated with fully_shard" in m for m in result["no_root"]), result
        assert result["removed"] == [] and result["unchecked_no_root"] == [], result
