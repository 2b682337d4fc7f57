"""The FSDPModule methods torch 2.15 added: manual backward finalization
(``set_manual_backward_finalization``, ``finalize_backward`` and its
``GradientReductionHandle``) and ``set_keep_unsharded_storage``.

torch's own FSDP2 has them only from 2.15 on, so the reference is one process
training on the whole batch; the refusals are FSDP2 2.15's (same types and the
same conditions)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from dist_utils import run_distributed
from helpers import full, local_slice, rank_world

from fsdp_compose import FSDPModule, GradientReductionHandle, fully_shard

WORLD = 2


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def _shard(model: nn.Sequential) -> nn.Sequential:
    sharded = copy.deepcopy(model)
    for i in (0, 2, 4):
        fully_shard(sharded[i])
    fully_shard(sharded)
    return sharded


def _batch(micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + micro)
    return torch.randn(4 * WORLD, 6, generator=gen), torch.randn(4 * WORLD, 1, generator=gen)


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else full(p.grad).clone() for n, p in model.named_parameters()}


def _max_diff(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> float:
    assert a.keys() == b.keys()
    worst = 0.0
    for name in a:
        x, y = a[name], b[name]
        assert (x is None) == (y is None), name
        if x is not None and y is not None:
            worst = max(worst, (x - y).abs().max().item())
    return worst


def _accumulate(model: nn.Module, microbatches: int, *, local: bool) -> None:
    rank, world = rank_world()
    for micro in range(microbatches):
        x, y = _batch(micro)
        if local:
            x, y = local_slice(x, rank, world), local_slice(y, rank, world)
        (model(x) - y).pow(2).mean().backward()


def _manual_finalization_job(async_op: bool) -> dict:
    base = _model()
    ref = copy.deepcopy(base)
    _accumulate(ref, 2, local=False)
    model = _shard(base)
    assert model.finalize_backward() is None  # before the first forward: a no-op
    model.set_manual_backward_finalization(True)
    # FSDP2's recipe: several backward passes without sync, then sync and finalize.
    model.set_requires_gradient_sync(False)
    _accumulate(model, 2, local=True)
    out: dict = {"grads_before": [n for n, p in model.named_parameters() if p.grad is not None]}
    model.set_requires_gradient_sync(True)
    handle = model.finalize_backward(async_op=async_op)
    if async_op:
        assert isinstance(handle, GradientReductionHandle)
        with pytest.raises(RuntimeError, match="waited on before forward"):
            model(torch.randn(2, 6))
        with pytest.raises(RuntimeError, match="waited on before finalizing"):
            model.finalize_backward()
        handle.wait()
    else:
        assert handle is None
    out["diff"] = _max_diff(_grads(model), _grads(ref))
    out["sharded_after"] = all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    # A synchronized backward in manual mode leaves its reductions to finalize_backward.
    model.zero_grad()
    ref.zero_grad()
    _accumulate(ref, 1, local=False)
    _accumulate(model, 1, local=True)
    model.finalize_backward()
    out["diff_synced"] = _max_diff(_grads(model), _grads(ref))
    # Back to automatic mode: backward() reduces on its own again.
    model.set_manual_backward_finalization(False)
    model.zero_grad()
    ref.zero_grad()
    _accumulate(ref, 1, local=False)
    _accumulate(model, 1, local=True)
    out["diff_auto"] = _max_diff(_grads(model), _grads(ref))
    with pytest.raises(RuntimeError, match="requires manual backward finalization"):
        model.finalize_backward()
    return out


@pytest.mark.parametrize("async_op", [False, True])
def test_manual_backward_finalization_matches_one_process(async_op: bool) -> None:
    for out in run_distributed(_manual_finalization_job, WORLD, async_op):
        assert out["grads_before"] == []  # nothing reduced before finalize_backward
        assert out["sharded_after"]
        assert out["diff"] < 1e-5, out
        assert out["diff_synced"] < 1e-5, out
        assert out["diff_auto"] < 1e-5, out


def _refusals_job() -> dict:
    model = _shard(_model())
    rank, world = rank_world()
    x = local_slice(_batch(0)[0], rank, world)
    model(x).sum().backward()
    child = model[0]
    assert isinstance(child, FSDPModule)
    with pytest.raises(RuntimeError, match="root"):
        child.set_manual_backward_finalization(True)
    with pytest.raises(RuntimeError, match="root"):
        model.set_manual_backward_finalization(True)
        child.finalize_backward()
    loss = model(x).sum()
    loss.backward()  # manual mode now fixed for this backward iteration
    with pytest.raises(RuntimeError, match="after backward starts"):
        model.set_manual_backward_finalization(False)
    model.finalize_backward()
    model.set_manual_backward_finalization(False)  # allowed once finalized
    # reset_iter_state invalidates an outstanding handle.
    model.set_manual_backward_finalization(True)
    model(x).sum().backward()
    handle = model.finalize_backward(async_op=True)
    model.reset_iter_state()
    with pytest.raises(RuntimeError, match="invalidated"):
        handle.wait()
    return {"ok": True}


def test_manual_finalization_refusals_as_fsdp2() -> None:
    assert all(out["ok"] for out in run_distributed(_refusals_job, WORLD))


def _keep_storage_job() -> dict:
    model = _shard(_model())
    rank, world = rank_world()
    x = local_slice(_batch(0)[0], rank, world)
    first = model[0]
    assert isinstance(first, FSDPModule)

    def storage() -> tuple[int, int]:
        first.unshard()
        weight = first.weight
        ptr = weight.data_ptr()
        first.reshard()
        return ptr, weight.untyped_storage().nbytes()

    out = {"default": storage()[1]}
    model.set_keep_unsharded_storage(True)
    ptrs = []
    for _ in range(2):
        model(x).sum().backward()
        ptrs.append(storage())
    out["kept"] = [nbytes for _, nbytes in ptrs]
    out["same_ptr"] = ptrs[0][0] == ptrs[1][0]
    first.set_keep_unsharded_storage(False, recurse=False)
    out["freed_again"] = storage()[1]
    return out


def test_keep_unsharded_storage() -> None:
    for out in run_distributed(_keep_storage_job, WORLD):
        assert out["default"] == 0  # FSDP2's default frees the unsharded storage
        assert all(nbytes > 0 for nbytes in out["kept"])
        assert out["same_ptr"]
        assert out["freed_again"] == 0
