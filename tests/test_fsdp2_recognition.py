"""fsdp_compose's units are recognised as FSDP2 modules: ``isinstance(unit,
torch.distributed.fsdp.FSDPModule)`` holds (libraries such as accelerate branch
on it), and torch's FSDP2-aware utilities work on them: ``clip_grad_norm_`` and a
state-dict round trip through ``torch.distributed.checkpoint.state_dict``. A
module sharded by torch's own ``fully_shard`` is still refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from dist_utils import run_distributed
from helpers import full, local_slice, rank_world
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp_compose
from fsdp_compose import fully_shard

WORLD = 2


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _job() -> dict:
    rank, world = rank_world()
    base = _model()
    ref = copy.deepcopy(base)
    model = copy.deepcopy(base)
    fully_shard(model[0])
    fully_shard(model)
    out: dict = {
        "isinstance": [isinstance(m, TorchFSDPModule) for m in (model, model[0])],
        "plain_not_fsdp": not isinstance(model[1], TorchFSDPModule),
        "ours": isinstance(model, fsdp_compose.FSDPModule),
        "class_mro_2": type(model).__mro__[2] is nn.Sequential,  # torch's class-swap layout
        # torch's FSDPModule comes last in the unit's class: none of its methods
        # shadows ours, the original class's or nn.Module's.
        "torch_owned": sorted(
            n
            for n in dir(TorchFSDPModule)
            if not n.startswith("__")
            and next(c for c in type(model).__mro__ if n in c.__dict__) is TorchFSDPModule
        ),
    }
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4 * world, 6, generator=gen)
    (ref(x).pow(2).mean() * 10).backward()
    (model(local_slice(x, rank, world)).pow(2).mean() * 10).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    out["norm"] = (full(norm).item(), ref_norm.item())
    out["clipped_diff"] = max(
        (full(p.grad) - q.grad).abs().max().item()
        for p, q in zip(model.parameters(), ref.parameters())
    )
    # Full state dict out, perturbed model, the same state dict back in.
    full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    out["full_sd"] = all(
        torch.equal(full_sd[n], p.detach()) for n, p in base.state_dict().items()
    )
    sharded_sd = {k: v.clone() for k, v in get_model_state_dict(model).items()}
    restored = []
    for sd, options in ((full_sd, StateDictOptions(full_state_dict=True)), (sharded_sd, None)):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        set_model_state_dict(model, sd, options=options)
        restored.append(
            max(
                (full(p.detach()) - q.detach()).abs().max().item()
                for p, q in zip(model.parameters(), base.parameters())
            )
        )
    out["restored"] = restored
    out["sharded_keys"] = sorted(sharded_sd) == sorted(base.state_dict())
    # A module torch's own fully_shard sharded is still refused, by name.
    other = _model()
    torch_fully_shard(other)
    with pytest.raises(ValueError, match="already sharded by torch.distributed.fsdp.fully_shard"):
        fully_shard(other)
    return out


def test_units_are_torch_fsdp_modules() -> None:
    for out in run_distributed(_job, WORLD):
        assert out["isinstance"] == [True, True]
        assert out["plain_not_fsdp"] and out["ours"] and out["class_mro_2"]
        norm, ref_norm = out["norm"]
        assert abs(norm - ref_norm) < 1e-5 and ref_norm > 0.5  # clipping happened
        assert out["clipped_diff"] < 1e-6
        assert out["full_sd"] and out["sharded_keys"]
        assert max(out["restored"]) < 1e-7
        assert set(out["torch_owned"]) <= {"_get_fsdp_state", "_set_unshard_async_op", "_orig_cls_mro_index"}

