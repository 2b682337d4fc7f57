"""Frozen parameters, the scenarios of torch's ``test_fully_shard_frozen.py``, against
torch's FSDP2 in the same job.

torch's file patches FSDP2's private post-backward function to count its calls, so
it cannot run with fsdp_compose swapped in; its scenarios are checked directly on 2
gloo ranks, each with both libraries from the same seed:

* **within a unit:** only the biases train (BitFit), frozen before ``fully_shard``
  or after it (then the units' parameter lists still hold the frozen weights), with
  and without activation checkpointing (torch's composable ``checkpoint``);
* **across units:** every other linear frozen, a no-grad step in between, and the
  frozen ones unfrozen for the last step (fine-tuning that thaws layers);
* **a unit used several times in one forward**, also under ``torch.no_grad()``
  inside the forward, beside a frozen unit used as often.

Per step the losses, each reduce-scatter's size (counted as torch's tests count
them, by replacing ``torch.distributed``'s function) and, at the end, the
parameters are bit-identical to FSDP2's. The ``reshard_after_forward`` values
(``True``, ``False``, ``2``) are spread over the scenarios to keep the job short.
The optimizer is SGD where torch's file uses Adam, whose update hides a gradient
scaled by a constant.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from dist_utils import run_distributed
from helpers import against_fsdp2
from torch.testing._internal.common_fsdp import patch_reduce_scatter

_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
DIM = 16


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(F.relu(self.in_proj(x)))


class _Reused(nn.Module):
    """A trainable and a frozen linear, each called three times per forward; the
    trainable one once more per call under ``torch.no_grad()``."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.frozen, self.trained = (nn.Linear(DIM, DIM) for _ in range(3))
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        for _ in range(3):
            x = self.frozen(F.relu(self.trained(x)))
            with torch.no_grad():
                x += F.relu(self.trained(x))
        return x


def _freeze_weights(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        if "bias" not in name:
            param.requires_grad_(False)


def _within_unit(shard: Callable[..., Any], reshard: bool | int, late: bool, ac: bool) -> Any:
    from torch.distributed._composable import checkpoint

    model = nn.Sequential(*[_Block() for _ in range(3)])
    if not late:
        _freeze_weights(model)
    for block in model:
        if ac:
            checkpoint(block)
        shard(block, reshard_after_forward=reshard)
    shard(model, reshard_after_forward=reshard)
    optim = torch.optim.SGD(model.parameters(), lr=1e-2)
    if late:
        _freeze_weights(model)
    return model, optim, lambda step: None


def _across_units(shard: Callable[..., Any], reshard: bool | int) -> Any:
    model = nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(6)])
    for linear in model:
        shard(linear, reshard_after_forward=reshard)
    optim = torch.optim.SGD(model.parameters(), lr=1e-2)

    def thaw(step: int) -> None:  # every other linear frozen; all train on the last step
        for linear in model[::2]:
            linear.requires_grad_(step == 3)

    return model, optim, thaw


def _reused(shard: Callable[..., Any], reshard: bool | int) -> Any:
    model = _Reused()
    for linear in (model.first, model.frozen, model.trained):
        shard(linear, reshard_after_forward=reshard)
    shard(model, reshard_after_forward=reshard)
    return model, torch.optim.SGD(model.parameters(), lr=1e-2), lambda step: None


SCENARIOS: list[tuple[str, Callable[..., Any], dict[str, Any]]] = [
    ("within a unit, frozen before", _within_unit, {"reshard": 2, "late": False, "ac": True}),
    ("within a unit, frozen after", _within_unit, {"reshard": False, "late": True, "ac": False}),
    ("within a unit, frozen after, AC", _within_unit, {"reshard": True, "late": True, "ac": True}),
    ("across units, thawed", _across_units, {"reshard": True}),
    ("across units, thawed, 2", _across_units, {"reshard": 2}),
    ("reused in forward", _reused, {"reshard": True}),
    ("reused in forward, 2", _reused, {"reshard": 2}),
]


def _train(shard: Callable[..., Any], build: Callable[..., Any], options: dict[str, Any]) -> Any:
    torch.manual_seed(42)
    model, optim, before_step = build(shard, **options)
    rank = dist.get_rank()
    inputs = torch.Generator().manual_seed(rank)
    losses: list[float] = []
    sizes: list[int] = []

    def counted(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sizes.append(output.numel())
        return _REDUCE_SCATTER(output, *args, **kwargs)

    with patch_reduce_scatter(counted):
        for step in range(4):
            before_step(step)
            x = torch.randn(4, DIM, generator=inputs)
            if step == 1 and build is _across_units:  # an evaluation between steps
                with torch.no_grad():
                    losses.append(model(x).sum().item())
                continue
            loss = model(x).sum()
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=step % 2 == 0)
            losses.append(loss.item())
    params = [p.full_tensor().detach() for p in model.parameters()]
    return losses, sizes, params


def test_frozen_parameters_match_fsdp2() -> None:
    for rank_results in run_distributed(against_fsdp2, 2, SCENARIOS, _train, timeout=240.0):
        assert [r[0] for r in rank_results] == [s[0] for s in SCENARIOS]
        for name, losses, reduce_scatters, params in rank_results:
            assert losses and reduce_scatters and params, name
