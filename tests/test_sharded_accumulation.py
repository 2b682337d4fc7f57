"""Sharded fp32 gradient accumulation (``FSDPModule.set_gradient_accumulation``),
beyond FSDP2: numerics over 8 bf16 micro-batches against one process in fp32, the
collectives per step, the pending gradients it reports, and the default mode
bit-identical to torch's FSDP2 in the same job (HSDP on 4 ranks).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from helpers import collective_log, rank_world
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor.debug import CommDebugMode

from fsdp_compose import MixedPrecisionPolicy, fully_shard

BF16 = torch.bfloat16
MICRO = 8  # micro-batches per step
DIM = 32
LAYERS = 3


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(DIM, DIM), nn.Tanh()]
    return nn.Sequential(*layers)


def _batch(rank: int, micro: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * micro + rank)
    return torch.randn(4, DIM, generator=gen) + 1  # a shared mean: correlated gradients


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().mean()


def _reference(world: int) -> dict[str, torch.Tensor]:
    """One process in fp32: the data-parallel mean of every micro-batch's gradient."""
    model = _model()
    for micro in range(MICRO):
        for rank in range(world):
            (_loss(model, _batch(rank, micro)) / world).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _shard(shard_fn: Callable, mesh: Any, reduce_dtype: torch.dtype | None) -> nn.Module:
    model = _model()
    mp = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=reduce_dtype)
    for i in range(0, 2 * LAYERS, 2):
        shard_fn(model[i], mesh=mesh, mp_policy=mp)
    shard_fn(model, mesh=mesh, mp_policy=mp)
    return model


def _step(
    model: nn.Module,
    rank: int,
    *,
    sync_last: bool = True,
    pending: list | None = None,
    comms: Counter | None = None,
) -> None:
    """8 micro-batches, gradient sync on the last one only (or none: ``sync_last``);
    ``pending`` collects ``get_pending_gradients()`` after each no-sync backward,
    ``comms`` what ``CommDebugMode`` counts (forward and backward counted apart)."""
    for micro in range(MICRO):
        model.set_requires_gradient_sync(sync_last and micro == MICRO - 1)
        with CommDebugMode() as forward:
            loss = _loss(model, _batch(rank, micro).to(BF16))
        with CommDebugMode() as backward:
            loss.backward()
        for mode in (forward, backward):
            if comms is not None:
                comms.update({str(op): n for op, n in mode.get_comm_counts().items()})
        if pending is not None and micro < MICRO - 1:
            pending.append(model.get_pending_gradients())


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def _error(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max((grads[n].float() - ref[n]).abs().max().item() for n in ref)


def _numerics_job() -> dict[str, Any]:
    rank, world = rank_world()
    mesh = init_device_mesh("cpu", (world,))
    ref = _reference(world)
    out: dict[str, Any] = {}
    # the default mode next to torch's FSDP2: the same grads and collectives
    for name, shard_fn in (("fsdp2", torch_fully_shard), ("default", fully_shard)):
        for reduce_dtype in (None, torch.float32):
            model = _shard(shard_fn, mesh, reduce_dtype)
            comms: Counter = Counter()
            _step(model, rank, comms=comms)
            key = f"{name} {reduce_dtype}"
            out[key] = (_grads(model), dict(comms), _error(_grads(model), ref))
    # sharded accumulation, with a bf16 and an fp32 reduce-scatter
    for reduce_dtype in (None, torch.float32):
        model = _shard(fully_shard, mesh, reduce_dtype)
        model.set_gradient_accumulation("sharded")
        pending: list = []
        with collective_log(model) as log:
            _step(model, rank, pending=pending)
        weight = model[0].weight
        held = [p[weight] for p in pending]
        out[f"sharded {reduce_dtype}"] = {
            "error": _error(_grads(model), ref),
            "reduce_scatters": log.counts(),
            "kinds": dict(log.kinds()),
            "pending": [
                (u is None, str(s.dtype), s.shape == weight.to_local().shape) for u, s in held
            ],
            # (a fresh view each call, of the one accumulator)
            "same object": len({s.data_ptr() for _, s in held}) == 1,
            "pending params": len(pending[-1]),
            "after": model.get_pending_gradients(),
        }
    return out


def test_sharded_accumulation_numerics_and_collectives() -> None:
    from dist_utils import run_distributed

    for r in run_distributed(_numerics_job, 2, timeout=300):
        for dtype in ("None", "torch.float32"):
            ours, theirs = r[f"default {dtype}"], r[f"fsdp2 {dtype}"]
            # default mode: bit-identical grads and the same collectives as FSDP2's
            assert ours[1] == theirs[1], (ours[1], theirs[1])
            assert all(torch.equal(ours[0][n], theirs[0][n]) for n in theirs[0]), dtype
        bf16_unsharded, fp32_unsharded = r["default None"][2], r["default torch.float32"][2]
        sharded_bf16_rs = r["sharded None"]["error"]
        sharded_fp32_rs = r["sharded torch.float32"]["error"]
        # bf16 accumulation loses precision; both sharded modes accumulate in fp32: as
        # close as fp32 unsharded accumulation (the bf16 compute's error is left), even
        # with a bf16 reduce-scatter
        errors = (bf16_unsharded, fp32_unsharded, sharded_bf16_rs, sharded_fp32_rs)
        assert fp32_unsharded * 2 < bf16_unsharded, errors
        assert sharded_fp32_rs <= fp32_unsharded * 1.05, errors
        assert sharded_bf16_rs <= fp32_unsharded * 1.25, errors
        assert sharded_bf16_rs * 2 < bf16_unsharded, errors
        for dtype in ("None", "torch.float32"):
            s = r[f"sharded {dtype}"]
            # one reduce-scatter per micro-batch per unit (the root holds no parameters)
            layers = {f"{i}" for i in range(0, 2 * LAYERS, 2)}
            rs = {
                label: n
                for (kind, label), n in s["reduce_scatters"].items()
                if kind == "reduce_scatter"
            }
            assert rs == dict.fromkeys(layers, MICRO), rs
            assert set(s["kinds"]) == {"all_gather", "reduce_scatter"}, s["kinds"]
            # the pending gradient of a no-sync micro-batch: an fp32 shard, one storage
            assert s["pending"] == [(True, "torch.float32", True)] * (MICRO - 1), s["pending"]
            assert s["same object"] and s["pending params"] == 2 * LAYERS
            assert s["after"] == {}


def _synchronize_job() -> dict[str, Any]:
    """synchronize_gradients after 8 no-sync micro-batches: the same gradients as a
    synchronizing last backward, without another reduce-scatter; zero_grad and
    reset_iter_state drop the fp32 shards."""
    from test_pending_gradients import _installed_torch

    rank, world = rank_world()
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    backward = _shard(fully_shard, mesh, None)
    backward.set_gradient_accumulation("sharded")
    _step(backward, rank)
    model = _shard(fully_shard, mesh, None)
    model.set_gradient_accumulation("sharded")
    _step(model, rank, sync_last=False)
    with collective_log(model) as log:
        model.synchronize_gradients()
    out["kinds"] = dict(log.kinds())
    out["equal"] = all(
        torch.equal(a, b) for a, b in zip(_grads(model).values(), _grads(backward).values())
    )
    with _installed_torch(reduce_in_param_dtype=False, pending_api=True):
        _step(model, rank, sync_last=False)
        before = len(model.get_pending_gradients())
        model.zero_grad()
        out["zero_grad"] = (before, model.get_pending_gradients(), model[0].weight.grad)
    _step(model, rank, sync_last=False)
    model.reset_iter_state()
    out["reset"] = model.get_pending_gradients()
    # the default restored: no-sync backwards keep unsharded gradients again
    model.set_gradient_accumulation("unsharded")
    model.set_requires_gradient_sync(False)
    _loss(model, _batch(rank, 0).to(BF16)).backward()
    unreduced, partial = model.get_pending_gradients()[model[0].weight]
    out["unsharded again"] = (tuple(unreduced.shape), partial)
    try:
        model.set_gradient_accumulation("fp32")  # type: ignore[arg-type]
    except ValueError as exc:
        out["error"] = str(exc)
    return out


def test_synchronize_zero_grad_reset_and_mode_switch() -> None:
    from dist_utils import run_distributed

    for r in run_distributed(_synchronize_job, 2, timeout=300):
        assert r["kinds"] == {}, r["kinds"]  # only fp32 shards pending: nothing to send
        assert r["equal"]
        assert r["zero_grad"] == (2 * LAYERS, {}, None)
        assert r["reset"] == {}
        assert r["unsharded again"] == ((DIM, DIM), None)
        assert '"sharded" or "unsharded"' in r["error"]


def _hsdp_job() -> dict[str, Any]:
    rank, world = rank_world()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    ref = _reference(world)
    out: dict[str, Any] = {}
    for name in ("default", "sharded"):
        model = _shard(fully_shard, mesh, torch.float32)
        if name == "sharded":
            model.set_gradient_accumulation("sharded")
        pending: list = []
        with collective_log(model) as log:
            _step(model, rank, pending=pending)
        kept = {
            (u is None, s if s is None else str(s.dtype)) for p in pending for u, s in p.values()
        }
        out[name] = (_error(_grads(model), ref), log.counts(), kept)
    return out


@pytest.mark.parametrize("world", [4])
def test_hsdp_reduce_scatter_each_micro_batch_all_reduce_once(world: int) -> None:
    from dist_utils import run_distributed

    for r in run_distributed(_hsdp_job, world, timeout=300):
        default_error, default_counts, default_kept = r["default"]
        error, counts, kept = r["sharded"]
        assert error <= default_error * 1.05, (error, default_error)
        # pending between micro-batches: unsharded gradients, or fp32 shards only
        assert default_kept == {(False, None)} and kept == {(True, "torch.float32")}
        for i in range(0, 2 * LAYERS, 2):
            label = str(i)
            assert counts[("reduce_scatter", label)] == MICRO, counts
            assert counts[("all_reduce", label)] == 1, counts
            assert default_counts[("reduce_scatter", label)] == 1, default_counts
            assert default_counts[("all_reduce", label)] == 1, default_counts


def _manual_job(mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    """Manual backward finalization over sharded accumulation, against the automatic
    mode: FSDP2's recipe (every backward without sync, then sync and finalize), a
    synchronizing last backward, and the asynchronous handle."""
    rank, _ = rank_world()
    names = ("replicate", "shard")[-len(mesh_shape) :]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    out: dict[str, Any] = {}

    def sharded() -> nn.Module:
        model = _shard(fully_shard, mesh, None)
        model.set_gradient_accumulation("sharded")
        return model

    auto = sharded()
    with collective_log(auto) as log:
        _step(auto, rank)
    out["auto"] = (_grads(auto), log.counts())
    for recipe in ("fsdp2", "sync last", "async"):
        model = sharded()
        model.set_manual_backward_finalization(True)
        with collective_log(model) as log:
            for step in range(2):  # the second step starts from what the first left
                model.zero_grad()
                _step(model, rank, sync_last=recipe == "sync last")
                model.set_requires_gradient_sync(True)
                handle = model.finalize_backward(async_op=recipe == "async")
                if handle is not None:
                    handle.wait()
                if step == 0:
                    counts = log.counts()
        out[recipe] = (_grads(model), counts, model.get_pending_gradients())
    return out


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_manual_finalization_with_sharded_accumulation(mesh_shape: tuple[int, ...]) -> None:
    from dist_utils import run_distributed

    world = 1
    for n in mesh_shape:
        world *= n
    for r in run_distributed(_manual_job, world, mesh_shape, timeout=300):
        grads, counts = r["auto"]
        for recipe in ("fsdp2", "sync last", "async"):
            ours, our_counts, pending = r[recipe]
            assert pending == {}, recipe
            assert all(torch.equal(ours[n], grads[n]) for n in grads), recipe
            # the same collectives as the automatic mode: a reduce-scatter per
            # micro-batch and unit, (HSDP) one all-reduce per step
            assert our_counts == counts, (recipe, our_counts, counts)
