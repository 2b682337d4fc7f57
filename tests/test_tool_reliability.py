"""The tools beyond FSDP2 under bad input and faults: whole-matrix optimizers,
safetensors I/O and auto-wrap end in a clear exception on every rank (or behave
correctly), never in a silently wrong result, a hang or a dead process group."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch import nn

from fsdp_compose import enable_sharded_step, fully_shard


def _square_model(seed: int = 0, n: int = 4) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(n)])
    for layer in model:
        fully_shard(layer)
    return fully_shard(model)


def _backward(model: nn.Module) -> None:
    torch.manual_seed(0)
    model(torch.randn(3, 8)).sum().backward()


def _pg_usable() -> bool:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item() == dist.get_world_size()


def _muon_disagreement_job(case: str) -> dict:
    rank = dist.get_rank()
    model = _square_model()
    if case == "order_named":  # the same shapes, another order on rank 1
        named = list(model.named_parameters())
        params = named[::-1] if rank == 1 else named
    elif case == "shapes":  # rank 1 forgets a matrix: the shapes no longer line up
        params = list(model.parameters())[: 3 if rank == 1 else 4]
    else:  # "grads": same optimizer, a matrix without a gradient on rank 1 at step 2
        params = list(model.parameters())
    opt = enable_sharded_step(torch.optim.Muon(params, lr=0.1))
    error = ""
    steps = 0
    before: list[torch.Tensor] = []
    for step in range(3):
        opt.zero_grad()
        _backward(model)
        if case == "grads" and step == 2 and rank == 1:
            model[1].weight.grad = None
        before = [p.detach().to_local().clone() for p in model.parameters()]
        start = time.monotonic()
        try:
            opt.step()
        except RuntimeError as exc:
            error, elapsed = str(exc), time.monotonic() - start
            break
        steps += 1
    unchanged = all(
        torch.equal(b, p.detach().to_local()) for b, p in zip(before, model.parameters())
    )
    return {
        "error": error,
        "steps": steps,
        "fast": bool(error) and elapsed < 10,
        "unchanged": unchanged,
        "pg_usable": _pg_usable(),
    }


@pytest.mark.parametrize("case", ["order_named", "shapes", "grads"])
def test_muon_ranks_disagreeing_on_matrices_raise_on_every_rank(case: str) -> None:
    """Ranks whose Muon holds other matrices (order, shapes, which have gradients)
    raise the same error naming the first differing matrix before any data moves,
    within seconds; nothing is updated and the process group stays usable."""
    results = run_distributed(_muon_disagreement_job, 2, case)
    assert results[0]["error"] == results[1]["error"], results
    for r in results:
        assert "disagree" in r["error"] and "at matrix" in r["error"], r
        assert r["fast"] and r["unchanged"] and r["pg_usable"], r
        assert r["steps"] == (2 if case == "grads" else 0), r
    if case == "order_named":
        assert "'0.weight'" in results[0]["error"] and "'3.weight'" in results[0]["error"]
    if case == "grads":
        assert "without a gradient" in results[0]["error"]


def _muon_plan_cache_job(steps: int) -> dict:
    from fsdp_compose.whole_matrix import _muon

    model = _square_model(n=6)
    params = list(model.parameters())
    opt = enable_sharded_step(torch.optim.Muon(params, lr=0.01))
    sizes = []
    for step in range(steps):
        opt.zero_grad()
        _backward(model)
        for k, p in enumerate(params):  # a different set of matrices with gradients each step
            if (step >> k) & 1:
                p.grad = None
        opt.step()
        cache = _muon._caches[opt]
        sizes.append((len(cache.plans), len(cache.digests)))
    pools = {id(p.pool) for p in _muon._caches[opt].plans.values()}
    return {
        "max": max(sizes),
        "last": sizes[-1],
        "pools": len(pools),
        "bound": _muon.PLAN_CACHE_SIZE,
    }


def test_muon_plan_cache_is_bounded() -> None:
    """Over 1,000 steps whose set of matrices with gradients keeps changing (63
    different sets), the plans and digests kept stay at PLAN_CACHE_SIZE, and the
    plans share one buffer pool."""
    for r in run_distributed(_muon_plan_cache_job, 2, 1000, timeout=300):
        bound = r["bound"]
        assert r["max"] == (bound, bound) and r["last"] == (bound, bound), r
        assert r["pools"] == 1, r
