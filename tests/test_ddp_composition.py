"""DDP around a model with a ``fully_shard``-ed part, the scenario of torch's
``test_fully_shard_ignore_params.py``, against torch's FSDP2 in the same job.

The model ``A(module_b=B(lin_b, module_c=C(lin_c), subtrahend), addend)`` shards
``module_b`` (and ``lin_b`` as its own unit) with ``module_c``'s parameters ignored;
``DistributedDataParallel`` wraps the whole model and is told to leave the sharded
parameters alone (``_set_params_and_buffers_to_ignore_for_model``), so it all-reduces
``addend`` and the ignored ``lin_c``, and FSDP reduce-scatters the rest. Each rank
trains on its own input for three SGD steps (the optimizer steps on DTensors and plain
tensors together, under ``implicit_replication``). The losses and every parameter
are bit-identical to FSDP2's, and match a DDP-only model trained on the same inputs.

torch's composable ``replicate`` (DDP applied to a subtree) with ``fully_shard``, the
configurations of torch's ``test_fully_shard_compose.py``: each API leaves the other's
modules alone (``replicate`` skips modules ``fully_shard`` manages, ``fully_shard``
skips subtrees ``replicate`` manages), losses and parameters bit-identical to FSDP2's
and matching a ``replicate``-only model; ``replicate`` on a module ``fully_shard``
manages is refused, with FSDP2's error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from dist_utils import run_distributed
from torch.distributed._composable import replicate
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp_compose

DIM = 8
SHARDED = ["module_b.subtrahend", "module_b.lin_b.weight", "module_b.lin_b.bias"]


class _C(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin_c = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin_c(x)


class _B(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin_b, self.module_c = nn.Linear(DIM, DIM), _C()
        self.subtrahend = nn.Parameter(torch.randn(DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin_b(self.module_c(x)) - self.subtrahend


class _A(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module_b = _B()
        self.addend = nn.Parameter(torch.randn(DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.module_b(x) + self.addend).sum()


def _train(shard: Callable[..., Any] | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(42)
    model: nn.Module = _A()
    if shard is not None:
        ignored = set(model.module_b.module_c.parameters())
        shard(model.module_b.lin_b, ignored_params=ignored)
        shard(model.module_b, ignored_params=ignored)
        DDP._set_params_and_buffers_to_ignore_for_model(model, SHARDED)
    model = DDP(model, broadcast_buffers=False)
    optim = torch.optim.SGD(model.parameters(), lr=1e-2)  # (Adam would hide a scale error)
    x = torch.randn(DIM, DIM, generator=torch.Generator().manual_seed(dist.get_rank()))
    losses = []
    for _ in range(3):
        loss = model(x)
        loss.backward()
        losses.append(loss.item())
        with implicit_replication():  # DTensor and plain parameters in one step
            optim.step()
            optim.zero_grad()
    params = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        for n, p in model.named_parameters()
    }
    return losses, params


def _job() -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    ours, theirs, ddp = _train(fsdp_compose.fully_shard), _train(torch_fully_shard), _train(None)
    return {
        "losses": (ours[0], theirs[0]),
        "same_params": ours[1].keys() == theirs[1].keys()
        and all(torch.equal(ours[1][n], theirs[1][n]) for n in ours[1]),
        "ddp_diff": max((ours[1][n] - ddp[1][n]).abs().max().item() for n in ours[1]),
        "ddp_loss_diff": max(abs(a - b) for a, b in zip(ours[0], ddp[0])),
    }


def test_ddp_around_a_sharded_module_matches_fsdp2() -> None:
    for r in run_distributed(_job, 2):
        assert r["losses"][0] == r["losses"][1], r
        assert r["same_params"], r
        assert r["ddp_diff"] < 1e-5 and r["ddp_loss_diff"] < 1e-4, r


# ---------------------------------------------------------------------------
# torch's composable replicate with fully_shard
# ---------------------------------------------------------------------------

# "1fm,1r": fully_shard on the bottom level, replicate above it; each comma a level,
# bottom-up, as in torch's test_fully_shard_compose.py. "R" is torch's FSDP-based
# replicate (replicate_with_fsdp, torchtitan's DDP), which reads the registry too.
_REPLICATE_CONFIGS = ("1fm,1r", "1r,1fm", "1r1fm,1fm", "1fm1fm,1r1r,1fm", "1fm1fm,1R")


def _compose(config: str, shard: Callable[..., Any] | None) -> nn.Module:
    from torch.testing._internal.common_dist_composable import (
        CompositeModel,
        CompositeParamModel,
    )

    torch.manual_seed(42)
    model: Any = (CompositeModel if config == "1fm,1r" else CompositeParamModel)(
        torch.device("cpu")
    )
    if shard is None:
        return replicate(model)
    if config == "1fm,1r":
        shard(model.l1)
        return replicate(model)
    if config.startswith("1fm1fm"):
        shard(model.u1.seq)
        shard(model.u2.seq)
    if config == "1fm1fm,1R":
        from torch.distributed._composable.replicate_with_fsdp import replicate as fsdp_replicate

        return fsdp_replicate(model)
    replicate(model.u1)
    if config == "1fm1fm,1r1r,1fm":
        replicate(model.u2)
    elif config == "1r1fm,1fm":
        shard(model.u2)
    return shard(model)


def _train_composed(config: str, shard: Callable[..., Any] | None) -> tuple[list[float], dict]:
    model = _compose(config, shard)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(2, 100, generator=torch.Generator().manual_seed(42 + dist.get_rank()))
    losses = []
    for step in range(4):
        optim.zero_grad(set_to_none=step % 2 == 0)
        loss = model(x).sum()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    params = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        for n, p in model.named_parameters()
    }
    return losses, params


def _replicate_job() -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out: dict[str, Any] = {}
    for config in _REPLICATE_CONFIGS:
        ours = _train_composed(config, fsdp_compose.fully_shard)
        theirs = _train_composed(config, torch_fully_shard)
        reference = _train_composed(config, None)
        out[config] = {
            "losses": (ours[0], theirs[0]),
            "same_params": ours[1].keys() == theirs[1].keys()
            and all(torch.equal(ours[1][n], theirs[1][n]) for n in ours[1]),
            "reference_loss_diff": max(abs(a - b) for a, b in zip(ours[0], reference[0])),
        }
    refused = []
    for shard in (fsdp_compose.fully_shard, torch_fully_shard):
        module = shard(nn.Linear(4, 4))
        try:
            replicate(module)
            refused.append("")
        except RuntimeError as exc:
            refused.append(str(exc))
    out["refused"] = refused
    return out


def test_replicate_and_fully_shard_compose_as_fsdp2() -> None:
    for r in run_distributed(_replicate_job, 2, timeout=180):
        for config in _REPLICATE_CONFIGS:
            assert r[config]["losses"][0] == r[config]["losses"][1], (config, r[config])
            assert r[config]["same_params"], (config, r[config])
            assert r[config]["reference_loss_diff"] < 1e-3, (config, r[config])
        ours, theirs = r["refused"]
        assert ours == theirs and "already managed by `fully_shard`" in ours, r["refused"]
