"""FSDP2-aware clients take their FSDP2 path for fsdp_compose's units, with
``fully_shard`` imported from fsdp_compose and torch left unpatched: accelerate
(``Accelerator.prepare``'s ``isinstance(model, FSDPModule)`` check,
``clip_grad_norm_``, ``get_state_dict``, ``save_state``/``load_state`` through
``save_fsdp_model``/``load_fsdp_model``), transformers (``save_pretrained`` of a
full state dict gathered by ``get_model_state_dict``, then ``from_pretrained``) and
Lightning Fabric's ``ModelParallelStrategy`` (a ``parallelize_fn`` that calls
``fully_shard`` on the strategy's data-parallel mesh, meta-device init,
``no_backward_sync``, ``clip_gradients``, DCP ``save``/``load``): the same losses,
norms and parameters as with torch's ``fully_shard``, to the bit.

accelerate selects FSDP only on accelerators (``MULTI_GPU`` and the like); on CPU
gloo the job sets its state's ``distributed_type`` to ``FSDP`` with an FSDP2
plugin, which is what ``Accelerator(fsdp_plugin=...)`` does on a GPU machine.
Each is skipped when its library is not installed."""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn
from dist_utils import run_distributed
from helpers import full, local_slice, rank_world

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from fsdp_compose import fully_shard

WORLD = 2


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


@contextlib.contextmanager
def _launch_env(**extra: str) -> Iterator[None]:
    """This rank's launch as torchrun describes it in the environment, where the
    clients read it (the process group exists already: the port is never used);
    the environment is restored afterwards."""
    rank, world = rank_world()
    values = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)}
    values.update(LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="1", **extra)
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _accelerate_job(ckpt_dir: str) -> dict:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    with _launch_env(), contextlib.ExitStack() as cleanup:
        cleanup.callback(AcceleratorState._reset_state, reset_partial_state=True)
        accelerator = Accelerator(cpu=True)
        # What Accelerator(fsdp_plugin=...) sets on a GPU machine (see the module doc).
        PartialState().distributed_type = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, state_dict_type="SHARDED_STATE_DICT"
        )
        return _accelerate_steps(accelerator, ckpt_dir)


def _accelerate_steps(accelerator, ckpt_dir: str) -> dict:  # type: ignore[no-untyped-def]
    rank, world = rank_world()
    base = _model()
    ref = copy.deepcopy(base)
    model = copy.deepcopy(base)
    fully_shard(model[0])
    fully_shard(model)
    params = [p.to_local().clone() for p in model.parameters()]  # type: ignore[attr-defined]
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared, _ = accelerator.prepare(model, optim)
    out: dict = {"is_fsdp2": accelerator.is_fsdp2, "kept": prepared is model}
    # fsdp2_prepare_model's isinstance check kept fsdp_compose's shards (no torch fully_shard).
    out["same_shards"] = all(
        torch.equal(p.to_local(), q) for p, q in zip(model.parameters(), params)
    )
    x = torch.randn(4 * world, 6, generator=torch.Generator().manual_seed(1))
    ref(x).pow(2).sum().div(world).backward()
    accelerator.backward(model(local_slice(x, rank, world)).pow(2).sum())
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
    out["norm"] = (full(norm).item(), ref_norm.item())
    out["grad_diff"] = max(
        (full(p.grad) - q.grad).abs().max().item()
        for p, q in zip(model.parameters(), ref.parameters())
    )
    full_sd = accelerator.get_state_dict(model)  # FSDP2 path: full, on rank 0 only
    out["full_sd"] = rank != 0 or (
        sorted(full_sd) == sorted(base.state_dict())
        and all(torch.equal(v, base.state_dict()[k]) for k, v in full_sd.items())
    )
    out["full_sd_empty_elsewhere"] = rank == 0 or full_sd == {}
    accelerator.save_state(ckpt_dir)  # save_fsdp_model: DCP, sharded
    out["files"] = sorted(os.listdir(ckpt_dir))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    accelerator.load_state(ckpt_dir)
    out["restored"] = max(
        (full(p.detach()) - q.detach()).abs().max().item()
        for p, q in zip(model.parameters(), base.parameters())
    )
    return out


def test_accelerate_fsdp2_paths() -> None:
    pytest.importorskip("accelerate")
    with tempfile.TemporaryDirectory() as ckpt_dir:
        for r in run_distributed(_accelerate_job, WORLD, ckpt_dir):
            assert r["is_fsdp2"] and r["kept"] and r["same_shards"], r
            norm, ref_norm = r["norm"]
            assert abs(norm - ref_norm) < 1e-5 and ref_norm > 0.5, r  # it clipped
            assert r["grad_diff"] < 1e-6, r
            assert r["full_sd"] and r["full_sd_empty_elsewhere"], r
            assert "pytorch_model_fsdp_0" in r["files"], r
            assert r["restored"] == 0.0, r


def _transformers_job(save_dir: str) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    rank, _ = rank_world()
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    out: dict = {}
    for name, shard in (("ours", fully_shard), ("torch", torch_fully_shard)):
        model = copy.deepcopy(base)
        for layer in model.model.layers:
            shard(layer)
        shard(model)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state_dict = get_model_state_dict(model, options=options)  # rank 0 only
        target = os.path.join(save_dir, name)
        model.save_pretrained(target, state_dict=state_dict, is_main_process=rank == 0)
        torch.distributed.barrier()
        loaded = AutoModelForCausalLM.from_pretrained(target)
        out[name] = max(
            (p - q).abs().max().item()
            for p, q in zip(loaded.state_dict().values(), base.state_dict().values())
        )
        out[f"{name}_keys"] = sorted(loaded.state_dict()) == sorted(base.state_dict())
        torch.distributed.barrier()
    return out


def test_transformers_save_pretrained_of_sharded_model() -> None:
    pytest.importorskip("transformers")
    with tempfile.TemporaryDirectory() as save_dir:
        for r in run_distributed(_transformers_job, WORLD, save_dir):
            assert r["ours"] == r["torch"] == 0.0, r
            assert r["ours_keys"] and r["torch_keys"], r


class _FabricNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _fabric_run(shard, ckpt: str) -> dict:  # type: ignore[no-untyped-def]
    """Lightning Fabric's FSDP2 path: three steps of two micro-batches (the first
    without gradient sync), clipping, a DCP checkpoint, a fresh model loading it."""
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy

    rank, world = rank_world()

    def parallelize(model: nn.Module, mesh) -> nn.Module:  # type: ignore[no-untyped-def]
        for layer in model.layers:
            shard(layer, mesh=mesh["data_parallel"])
        return shard(model, mesh=mesh["data_parallel"])

    strategy = ModelParallelStrategy(parallelize, data_parallel_size=world, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()  # (the ranks are already running: the environment says so)
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):  # on meta, materialized by fabric.setup
        model = fabric.setup(_FabricNet())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    inputs = torch.Generator().manual_seed(rank)
    out: dict = {"losses": []}
    for _ in range(3):
        for micro in range(2):
            with fabric.no_backward_sync(model, enabled=micro == 0):
                loss = model(torch.randn(4, 8, generator=inputs)).pow(2).mean()
                fabric.backward(loss)
            out["losses"].append(loss.item())
        out["norm"] = fabric.clip_gradients(model, optimizer, max_norm=0.5).item()
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(ckpt, {"model": model, "optimizer": optimizer, "step": 3})
    out["params"] = [full(p).tolist() for p in model.parameters()]
    with fabric.init_module(empty_init=True):
        restored = fabric.setup(_FabricNet())
    restored_optimizer = fabric.setup_optimizers(torch.optim.AdamW(restored.parameters(), lr=1e-2))
    state = {"model": restored, "optimizer": restored_optimizer, "step": 0}
    fabric.load(ckpt, state)
    out["restored"] = [full(p).tolist() for p in restored.parameters()] == out["params"]
    out["step"] = state["step"]
    loss = restored(torch.randn(4, 8, generator=inputs)).pow(2).mean()
    fabric.backward(loss)
    restored_optimizer.step()
    out["after_load"] = [loss.item(), *(full(p).tolist() for p in restored.parameters())]
    return out


def _fabric_job(ckpt_dir: str) -> dict:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    with _launch_env(NODE_RANK="0"):  # Fabric then takes the ranks as launched
        return {
            name: _fabric_run(shard, os.path.join(ckpt_dir, name))
            for name, shard in (("ours", fully_shard), ("torch", torch_fully_shard))
        }


def test_lightning_fabric_model_parallel_strategy() -> None:
    pytest.importorskip("lightning")
    with tempfile.TemporaryDirectory() as ckpt_dir:
        for r in run_distributed(_fabric_job, WORLD, ckpt_dir, timeout=240):
            ours, theirs = r["ours"], r["torch"]
            assert ours == theirs, (ours["losses"], theirs["losses"])
            assert ours["restored"] and ours["step"] == 3, ours
