"""``enable_sharded_step`` with what users combine it with: bit-identical to torch
FSDP2's DTensor step (AdamW fused and foreach, SGD), DCP checkpoints of the
optimizer state that are the same with and without it (and resume across the two
modes), ``CPUOffloadPolicy``, gradient clipping, ``ShardedGradScaler``,
``torch.compile`` of the step, HSDP and TP x FSDP meshes (a parameter FSDP did not
shard keeps the DTensor path). LR schedulers, hooks and closures are in
``test_optim_local.py``; torchft's ``OptimizerWrapper`` in ``test_torchft.py``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp_compose
from fsdp_compose import _optim_direct, enable_sharded_step

WIDTH = 16
OPTIMIZERS = {
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, maximize=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9, nesterov=True, weight_decay=0.01),
}


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)) for _ in range(3)])


def _shard(model: nn.Module, impl: str, **kwargs: Any) -> nn.Module:
    shard = torch.distributed.fsdp.fully_shard if impl == "fsdp2" else fsdp_compose.fully_shard
    for block in model:
        shard(block, **kwargs)
    shard(model, **kwargs)
    return model


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(4, WIDTH, generator=g)


def _backward(model: nn.Module, step: int, scaler: Any = None) -> None:
    loss = model(_batch(step)).square().mean()
    (loss if scaler is None else scaler.scale(loss)).backward()


def _locals(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().to_local().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@contextlib.contextmanager
def _counting_direct_steps() -> Iterator[list[int]]:
    """Counts the parameters the direct update (fsdp_compose/_optim_direct.py) updates."""
    counts: list[int] = []
    saved = dict(_optim_direct.DIRECT)

    def wrap(fn: Any) -> Any:
        def counted(opt: torch.optim.Optimizer) -> Any:
            updated = fn(opt)
            counts.append(-1 if updated is None else len(updated))
            return updated

        return counted

    _optim_direct.DIRECT.update({cls: wrap(fn) for cls, fn in saved.items()})
    try:
        yield counts
    finally:
        _optim_direct.DIRECT.update(saved)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        _backward(model, step)
        opt.step()
        opt.zero_grad()


# --- parity with torch FSDP2 -------------------------------------------------------


def _fsdp2_parity_job(name: str) -> dict:
    results = {}
    for impl, sharded in (("fsdp2", False), ("fsdp_compose", False), ("fsdp_compose", True)):
        model = _shard(_mlp(), impl)
        opt = OPTIMIZERS[name](model.parameters())
        if sharded:
            enable_sharded_step(opt)
        with _counting_direct_steps() as counts:
            _train(model, opt, range(4))
        results[impl, sharded] = (_locals(model), opt, counts)
    ref, ref_opt, _ = results["fsdp2", False]
    fast, fast_opt, counts = results["fsdp_compose", True]
    states_same = all(
        torch.equal(va.to_local() if isinstance(va, DTensor) else va,
                    vb.to_local() if isinstance(vb, DTensor) else vb)
        for sa, sb in zip(ref_opt.state.values(), fast_opt.state.values())
        for va, vb in zip(sa.values(), sb.values())
    )
    n = len(list(fast_opt.param_groups[0]["params"]))
    return {
        "default_equal": _same(ref, results["fsdp_compose", False][0]),
        "sharded_equal": _same(ref, fast),
        "states_equal": states_same,
        # the first step creates the states (general path), the others are direct
        "direct_steps": counts == [-1, n, n, n],
    }


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_bit_identical_to_fsdp2(name: str) -> None:
    for r in run_distributed(_fsdp2_parity_job, 2, name):
        assert r == {k: True for k in r}, r


# --- DCP checkpoints across modes --------------------------------------------------


def _checkpoint_job(root: str, name: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build(sharded: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _shard(_mlp(), "fsdp_compose")
        opt = OPTIMIZERS[name](model.parameters())
        return model, enable_sharded_step(opt) if sharded else opt

    # The reference: four steps on the DTensor path, uninterrupted.
    ref, ref_opt = build(False)
    _train(ref, ref_opt, range(4))
    out: dict[str, bool] = {}
    for save_sharded in (True, False):
        model, opt = build(save_sharded)
        _train(model, opt, range(2))
        msd, osd = get_state_dict(model, opt)
        other, other_opt = build(not save_sharded)
        _train(other, other_opt, range(2))
        _, other_osd = get_state_dict(other, other_opt)
        out[f"same_state_dict_{save_sharded}"] = _same_tree(osd, other_osd)
        path = f"{root}/ckpt_{int(save_sharded)}"
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        # Resume in the other mode, from a fresh model and optimizer.
        loaded, loaded_opt = build(not save_sharded)
        lmsd, losd = get_state_dict(loaded, loaded_opt)
        state = {"model": lmsd, "optim": losd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(loaded, loaded_opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        _train(loaded, loaded_opt, range(2, 4))
        out[f"resumed_equal_{save_sharded}"] = _same(_locals(ref), _locals(loaded))
    return out


def _same_tree(a: Any, b: Any) -> bool:
    """Same keys, types, DTensor placements and values."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b))
    if isinstance(a, DTensor):
        return (isinstance(b, DTensor) and a.placements == b.placements
                and a.shape == b.shape and torch.equal(a.to_local(), b.to_local()))
    if isinstance(a, torch.Tensor):
        return type(a) is type(b) and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("name", ["adamw_fused", "sgd"])
def test_checkpoint_round_trips_across_modes(tmp_path: Any, name: str) -> None:
    for r in run_distributed(_checkpoint_job, 2, str(tmp_path), name, timeout=240):
        assert r == {k: True for k in r}, r


# --- CPU offload, clipping, grad scaler, compile -----------------------------------


def _offload_job(name: str) -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy

    runs = {}
    for impl, sharded in (("fsdp2", False), ("fsdp_compose", False), ("fsdp_compose", True)):
        policy = TorchCPUOffloadPolicy(pin_memory=False) if impl == "fsdp2" else (
            fsdp_compose.CPUOffloadPolicy(pin_memory=False))
        model = _shard(_mlp(), impl, offload_policy=policy)
        opt = OPTIMIZERS[name](model.parameters())
        if sharded:
            enable_sharded_step(opt)
        with _counting_direct_steps() as counts:
            _train(model, opt, range(3))
        runs[impl, sharded] = (_locals(model), counts)
    ref = runs["fsdp2", False][0]
    return {"default_equal": _same(ref, runs["fsdp_compose", False][0]),
            "sharded_equal": _same(ref, runs["fsdp_compose", True][0]),
            "direct": runs["fsdp_compose", True][1][1:] == [12, 12]}


@pytest.mark.parametrize("name", ["adamw_fused", "adamw_foreach"])
def test_cpu_offload(name: str) -> None:
    for r in run_distributed(_offload_job, 2, name):
        assert r == {k: True for k in r}, r


def _clip_and_scaler_job(name: str) -> dict:
    """clip_grad_norm_ then ShardedGradScaler.step; one step has an inf on one rank
    only (every rank must skip it)."""
    runs = {}
    for sharded in (False, True):
        model = _shard(_mlp(), "fsdp_compose")
        opt = OPTIMIZERS[name](model.parameters())
        if sharded:
            enable_sharded_step(opt)
        scaler = fsdp_compose.ShardedGradScaler("cpu", init_scale=2.0**8)
        skipped = []
        for step in range(4):
            _backward(model, step, scaler)
            if step == 2 and dist.get_rank() == 1:
                next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("inf")
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            before = _locals(model)
            scaler.step(opt)
            scaler.update()
            skipped.append(_same(before, _locals(model)))
            opt.zero_grad()
        runs[sharded] = (_locals(model), skipped, scaler.get_scale())
    return {"equal": _same(runs[False][0], runs[True][0]),
            "skipped_the_inf_step": runs[True][1] == [False, False, True, False],
            "same_scale": runs[False][2] == runs[True][2]}


@pytest.mark.parametrize("name", ["adamw_fused", "adamw_foreach", "sgd"])
def test_clipping_and_sharded_grad_scaler(name: str) -> None:
    for r in run_distributed(_clip_and_scaler_job, 2, name):
        assert r == {k: True for k in r}, r


def _compile_job() -> dict:
    """A compiled step keeps the DTensor path (the step hook does nothing while
    compiling): the same parameters with and without ``enable_sharded_step``.

    One block (a Linear and a LayerNorm: both parameter shapes of the MLP, every
    foreach op of the step): compiling the step traces it through DTensor
    parameter by parameter, so three blocks cost about three times the
    compilation for the same check."""
    runs = {}
    for sharded in (False, True):
        torch._dynamo.reset()
        model = _shard(_mlp()[:1], "fsdp_compose")
        opt = OPTIMIZERS["adamw_foreach"](model.parameters())
        if sharded:
            enable_sharded_step(opt)
        step = torch.compile(opt.step)
        for i in range(3):
            _backward(model, i)
            step()
            opt.zero_grad()
        runs[sharded] = _locals(model)
    return {"equal": _same(runs[False], runs[True])}


def test_compiled_step() -> None:
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("torch.compile needs g++ for its CPU backend")
    for r in run_distributed(_compile_job, 2, timeout=600):
        assert r == {"equal": True}, r


# --- HSDP and TP x FSDP ------------------------------------------------------------


def _hsdp_job(name: str) -> dict:
    runs = {}
    for impl, sharded in (("fsdp2", False), ("fsdp_compose", True)):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = _shard(_mlp(), impl, mesh=mesh)
        opt = OPTIMIZERS[name](model.parameters())
        if sharded:
            enable_sharded_step(opt)
        with _counting_direct_steps() as counts:
            _train(model, opt, range(3))
        runs[impl] = (_locals(model), counts)
    return {"equal": _same(runs["fsdp2"][0], runs["fsdp_compose"][0]),
            "direct": runs["fsdp_compose"][1][1:] == [12, 12]}


@pytest.mark.parametrize("name", ["adamw_fused", "sgd"])
def test_hsdp(name: str) -> None:
    for r in run_distributed(_hsdp_job, 4, name, timeout=240):
        assert r == {k: True for k in r}, r


def _tp_fsdp_job() -> dict:
    """Blocks: column- then row-parallel Linear pairs on the "tp" dim, FSDP on "dp";
    the last block's parameters are ignored by FSDP and stay tensor-parallel only."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    runs = {}
    for sharded in (False, True):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        model = nn.Sequential(*[
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.ReLU(), nn.Linear(2 * WIDTH, WIDTH))
            for _ in range(3)
        ])
        for block in model:
            parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        ignored = list(model[2].parameters())  # a list: the same order on every rank
        for block in model[:2]:
            fsdp_compose.fully_shard(block, mesh=mesh["dp"])
        fsdp_compose.fully_shard(model, mesh=mesh["dp"], ignored_params=set(ignored))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        if sharded:
            enable_sharded_step(opt)
        with _counting_direct_steps() as counts:
            for step in range(3):
                g = torch.Generator().manual_seed(100 * step + mesh.get_coordinate()[0])
                model(torch.randn(4, WIDTH, generator=g)).square().mean().backward()
                for p in ignored:  # the user reduces what FSDP ignores
                    dist.all_reduce(p.grad.to_local(), group=mesh["dp"].get_group())
                opt.step()
                opt.zero_grad()
        runs[sharded] = (_locals(model), counts)
    return {"equal": _same(runs[False][0], runs[True][0]),
            # 8 FSDP-sharded parameters take the direct update, the 4 TP-only ones do not
            "direct": runs[True][1] == [-1, 8, 8]}


def test_tp_x_fsdp_and_tp_only_parameters() -> None:
    for r in run_distributed(_tp_fsdp_job, 4, timeout=240):
        assert r == {k: True for k in r}, r
