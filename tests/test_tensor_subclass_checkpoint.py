"""Checkpoints of tensor-subclass parameters: the subclass and its metadata
survive ``state_dict()``, DCP save at one world size and load at another, and
full-state-dict export, with fsdp_compose as with torch's FSDP2 (checkpoints
written by either load into the other)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_distributed
from test_tensor_subclass import Int8RowWise, _model, _shard
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdp_compose import fully_shard


def _shard_fn(which: str) -> Any:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    return {"torch": torch_fully_shard, "ours": fully_shard}[which]


def _int8_save_job(path: str, which: str) -> None:
    model = _model(uneven=True)  # 6 and 7 rows: uneven at W=2
    _shard(model, _shard_fn(which))
    sd = model.state_dict()
    assert isinstance(sd["0.weight"]._local_tensor, Int8RowWise)
    dcp.save(sd, checkpoint_id=path)


def _int8_load_job(path: str, which: str) -> list[int]:
    """Loads into a differently initialised model; checks each rank's int8 rows
    and scales (the metadata) against the saved model's."""
    reference = _model(uneven=True)
    model = _model(uneven=True)
    with torch.no_grad():
        for p in model.parameters():  # nothing of the saved values left
            if isinstance(p, Int8RowWise):
                p._data.fill_(7)
                p._scale.fill_(3.0)
            else:
                p.fill_(3.0)
    _shard(model, _shard_fn(which))
    sd = model.state_dict()
    with torch.serialization.safe_globals([Int8RowWise]):  # DCP loads weights_only
        dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    rows = []
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        local = p._local_tensor
        if not isinstance(ref, Int8RowWise):
            torch.testing.assert_close(p.full_tensor(), ref.detach(), msg=name)
            continue
        assert isinstance(local, Int8RowWise), (name, type(local))
        chunk = -(-ref.shape[0] // world)
        start = min(rank * chunk, ref.shape[0])
        torch.testing.assert_close(local._data, ref._data[start : start + chunk], msg=name)
        torch.testing.assert_close(local._scale, ref._scale[start : start + chunk], msg=name)
        rows.append(local.shape[0])
    return rows


@pytest.mark.parametrize("saver, loader", [("ours", "ours"), ("torch", "ours"), ("ours", "torch")])
def test_int8_subclass_dcp_save_at_2_load_at_4(saver: str, loader: str, tmp_path: Path) -> None:
    """Saved at W=2 (uneven), loaded at W=4 (an empty shard): int8 rows and
    per-row scales land on the right ranks, as subclasses, with either runtime."""
    path = str(tmp_path)
    run_distributed(_int8_save_job, 2, path, saver)
    rows = run_distributed(_int8_load_job, 4, path, loader)
    assert [r[0] for r in rows] == [2, 2, 2, 0]  # the 6-row weight's last shard is empty


def _int8_full_state_dict_job(which: str) -> None:
    model = _model(uneven=True)
    reference = _model(uneven=True).state_dict()
    _shard(model, _shard_fn(which))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert full.keys() == reference.keys()
    for name, ref in reference.items():
        # DTensor.full_tensor() all-gathers through the subclass's own dispatch,
        # which (for this subclass) dequantizes: the export holds the values.
        expected = ref.dequantize() if isinstance(ref, Int8RowWise) else ref
        torch.testing.assert_close(full[name], expected, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("which", ["torch", "ours"])
def test_int8_subclass_full_state_dict_export(which: str) -> None:
    run_distributed(_int8_full_state_dict_job, 3, which)


# -- torchao NF4 ----------------------------------------------------------


def _nf4_model() -> nn.Module:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    torch.manual_seed(0)
    # 256 x 256: NF4's scaler blocks divide into 2 and 4 shards.
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    for layer in model:
        layer.weight = nn.Parameter(to_nf4(layer.weight.detach()), requires_grad=False)
    return model


def _nf4_sharded(which: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = _nf4_model() if seed == 0 else _perturbed_nf4_model()
    for layer in model:
        _shard_fn(which)(layer)
    _shard_fn(which)(model)
    return model


def _perturbed_nf4_model() -> nn.Module:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    model = _nf4_model()
    for layer in model:
        layer.weight = nn.Parameter(to_nf4(torch.randn(256, 256)), requires_grad=False)
        nn.init.zeros_(layer.bias)
    return model


def _nf4_checkpoint_job(path: str, saver: str, loader: str) -> None:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    reference = _nf4_model()
    dcp.save(_nf4_sharded(saver).state_dict(), checkpoint_id=path)
    model = _nf4_sharded(loader, seed=1)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    for i, layer in enumerate(reference):
        weight = full[f"{i}.weight"]
        assert isinstance(model[i].weight._local_tensor, NF4Tensor)
        assert isinstance(weight, NF4Tensor), type(weight)  # quantized, block sizes kept
        assert weight.block_size == layer.weight.block_size
        assert torch.equal(weight.get_original_weight(), layer.weight.get_original_weight())
        torch.testing.assert_close(full[f"{i}.bias"], layer.bias.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("saver, loader", [("ours", "ours"), ("torch", "ours")])
def test_torchao_nf4_dcp_round_trip_and_full_state_dict(
    saver: str, loader: str, tmp_path: Path
) -> None:
    """NF4 (QLoRA) weights: DCP save and load at W=2, then a full-state-dict
    export that is an NF4Tensor equal to the original. (At another world size
    DCP's default planner fails with FSDP2 and fsdp_compose alike;
    ``subclass_checkpoint.NF4LoadPlanner`` loads it: test_nf4_checkpoint_reshard.py.)"""
    pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    path = str(tmp_path)
    run_distributed(_nf4_checkpoint_job, 2, path, saver, loader)
