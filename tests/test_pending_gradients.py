"""FSDP2 2.16's pending-gradient API: ``get_pending_gradients``,
``synchronize_gradients`` and ``zero_grad``, and the dtype of accumulation while
gradient sync is disabled (``reduce_dtype``, else the compute dtype).

Numerics against torch's FSDP2 in the same job where it has the feature (no-sync
accumulation, then a synchronizing backward), against values computed by hand
otherwise; collectives counted with an observer and torch's ``CommDebugMode``.
torch's own tests for these methods run with ``tools/run_torch_fsdp_tests.py --cpu``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
from helpers import collective_log, rank_world
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor.debug import CommDebugMode

from fsdp_compose import MixedPrecisionPolicy, fully_shard
from fsdp_compose._runtime import _compat

BF16 = torch.bfloat16
# Micro-batch inputs whose sum rounds differently in bf16 (256 + 1 == 256) and fp32.
MICRO = (256.0, 1.0, -256.0)


class TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4, bias=False)
        self.second = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(x) + self.second(x)


def _sharded(shard_fn, reduce_dtype: torch.dtype | None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Linear(1, 2, bias=False)
    mp = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=reduce_dtype)
    shard_fn(model, mesh=init_device_mesh("cpu", (2,)), mp_policy=mp)
    return model


def _backward(model: nn.Module, value: float, rank: int) -> None:
    model(torch.full((1, 1), value * (rank + 1), dtype=BF16)).sum().backward()


def _accumulation_job() -> dict:
    rank, _ = rank_world()
    out: dict = {}
    for reduce_dtype in (None, torch.float32):
        # torch's FSDP2: no sync for all but the last micro-batch
        theirs = _sharded(torch_fully_shard, reduce_dtype)
        for i, value in enumerate(MICRO):
            theirs.set_requires_gradient_sync(i == len(MICRO) - 1)
            _backward(theirs, value, rank)
        # ours: no sync throughout, then synchronize_gradients
        ours = _sharded(fully_shard, reduce_dtype)
        ours.set_requires_gradient_sync(False)
        param, held = ours.weight, []
        for value in MICRO:
            _backward(ours, value, rank)
            with CommDebugMode() as comm:
                pending = ours.get_pending_gradients()
            assert comm.get_total_counts() == 0
            assert set(pending) == {param} and param.grad is None
            unreduced, partial = pending[param]
            assert partial is None
            held.append(unreduced)
        assert all(t is held[0] for t in held), "one accumulator across micro-batches"
        name = str(reduce_dtype)
        out[f"dtype {name}"] = str(held[0].dtype)
        with collective_log(ours) as log:
            ours.synchronize_gradients()
            assert ours.get_pending_gradients() == {}
            first = param.grad.full_tensor().clone()
            ours.synchronize_gradients()  # nothing pending: no collective, no change
        out[f"kinds {name}"] = dict(log.kinds())
        out[f"idempotent {name}"] = torch.equal(first, param.grad.full_tensor())
        out[f"ours {name}"] = first.tolist()
        out[f"theirs {name}"] = theirs.weight.grad.full_tensor().tolist()
    return out


def test_accumulation_dtype_and_synchronize_match_fsdp2() -> None:
    from dist_utils import run_distributed

    for r in run_distributed(_accumulation_job, 2):
        # reduce_dtype=None accumulates in the compute dtype, fp32 in fp32 (FSDP2's)
        assert r["dtype None"] == "torch.bfloat16"
        assert r["dtype torch.float32"] == "torch.float32"
        for name in ("None", "torch.float32"):
            assert r[f"ours {name}"] == r[f"theirs {name}"], name
            assert r[f"kinds {name}"] == {"reduce_scatter": 1}, r[f"kinds {name}"]
            assert r[f"idempotent {name}"]
        # the two dtypes give different sums: the comparison above can tell them apart
        assert r["ours None"] != r["ours torch.float32"]


def _grouped_job() -> dict:
    """zero_grad on one module of a grouped unit; in-place changes to a pending
    gradient are reduced; the divide factor applies to synchronize_gradients."""
    torch.manual_seed(0)
    model = TwoLinear()
    mesh = init_device_mesh("cpu", (2,))
    mp = MixedPrecisionPolicy(param_dtype=BF16)
    fully_shard([model.first, model.second], mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.set_reshard_after_backward(False)  # the unsharded parameters stay registered
    first, second = model.first.weight, model.second.weight
    ones = torch.ones(1, 4, dtype=BF16)
    out: dict = {}
    for sync, value in ((True, 4.0), (False, 2.0)):
        model.set_requires_gradient_sync(sync)
        model(ones * value).sum().backward()
    # dW = the input, for both weights: reduced 4, pending 2
    with _installed_torch(reduce_in_param_dtype=False, pending_api=True):
        model.first.zero_grad(set_to_none=False)
    pending = model.get_pending_gradients()
    out["first zeroed"] = (
        pending[first][0].eq(0).all().item() and first.grad.to_local().eq(0).all().item()
    )
    out["second kept"] = (pending[second][0].tolist(), second.grad.to_local().tolist())
    pending[second][0].mul_(0.5)  # an in-place change counts
    model.set_gradient_divide_factor(1.0)  # the root's unit has no parameters
    model.first.set_gradient_divide_factor(1.0)  # sum over the 2 ranks
    model.first(ones).sum().backward()  # first: pending 1
    model.synchronize_gradients()
    out["after sync"] = (first.grad.full_tensor().tolist(), second.grad.full_tensor().tolist())
    with _installed_torch(reduce_in_param_dtype=False, pending_api=True):
        model.zero_grad()
    out["cleared"] = (model.get_pending_gradients(), first.grad, second.grad)
    return out


def test_grouped_zero_grad_mutation_and_divide_factor() -> None:
    from dist_utils import run_distributed

    for r in run_distributed(_grouped_job, 2):
        assert r["first zeroed"]
        pending, reduced = r["second kept"]
        assert pending == [[2.0] * 4] * 4 and all(v == 4.0 for row in reduced for v in row)
        first, second = r["after sync"]
        assert first == [[2.0] * 4] * 4  # 0 + (1 + 1) summed over 2 ranks
        assert second == [[6.0] * 4] * 4  # 4 + (1 + 1) after halving the pending 2
        assert r["cleared"] == ({}, None, None)


def _hsdp_job() -> dict:
    """HSDP: a partial sum without a new gradient reaches the all-reduce through
    synchronize_gradients; zero_grad zeroes partial sums."""
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = TwoLinear()
    mp = MixedPrecisionPolicy(param_dtype=BF16)
    fully_shard([model.first, model.second], mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.set_reshard_after_backward(False)
    first, second = model.first.weight, model.second.weight
    ones = torch.ones(1, 4, dtype=BF16)
    out: dict = {}
    model(ones * 4).sum().backward()
    model.set_requires_all_reduce(False)
    for module, value in ((model.first, 2.0), (model.second, 3.0)):
        module(torch.full((1, 4), value, dtype=BF16, requires_grad=True)).sum().backward()
    model.set_requires_gradient_sync(False)
    model.first(ones.requires_grad_()).sum().backward()
    pending = model.get_pending_gradients()
    out["pending"] = {
        name: (unreduced is not None, tuple(partial.shape) == tuple(p.to_local().shape))
        for name, p in (("first", first), ("second", second))
        for unreduced, partial in [pending[p]]
    }
    with collective_log(model) as log:
        model.synchronize_gradients()
    out["kinds"] = dict(log.kinds())
    out["grads"] = [p.grad.full_tensor().unique().tolist() for p in (first, second)]
    # zero_grad(set_to_none=False) zeroes a partial sum: the next reduction omits it
    model.set_requires_gradient_sync(True)
    model.set_requires_all_reduce(False)
    model(ones).sum().backward()
    with _installed_torch(reduce_in_param_dtype=False, pending_api=True):
        model.zero_grad(set_to_none=False)
    out["zeroed"] = all(
        partial is not None and partial.eq(0).all().item()
        for _, partial in model.get_pending_gradients().values()
    )
    model.set_requires_all_reduce(True)
    model(ones * 5).sum().backward()
    out["after zero"] = [p.grad.full_tensor().unique().tolist() for p in (first, second)]
    return out


def test_hsdp_partial_sums() -> None:
    from dist_utils import run_distributed

    for r in run_distributed(_hsdp_job, 4):
        assert r["pending"] == {"first": (True, True), "second": (False, True)}
        # one reduce-scatter (the partial-only parameter joins with zeros), one all-reduce
        assert r["kinds"] == {"reduce_scatter": 1, "all_reduce": 1}, r["kinds"]
        assert r["grads"] == [[7.0], [7.0]]  # 4 + 2 + 1 and 4 + 3 (identical ranks)
        assert r["zeroed"]
        assert r["after zero"] == [[5.0], [5.0]]


@contextmanager
def _installed_torch(*, reduce_in_param_dtype: bool, pending_api: bool) -> Iterator[None]:
    """Runs as if the installed torch's FSDP2 were 2.15 or had the pending-gradient
    API (the flags are read at lazy init); restored for the pool's next job."""
    saved = (_compat.REDUCE_IN_PARAM_DTYPE, _compat.PENDING_GRADIENT_API)
    _compat.REDUCE_IN_PARAM_DTYPE, _compat.PENDING_GRADIENT_API = (
        reduce_in_param_dtype,
        pending_api,
    )
    try:
        yield
    finally:
        _compat.REDUCE_IN_PARAM_DTYPE, _compat.PENDING_GRADIENT_API = saved


def _switch_job() -> dict:
    rank, _ = rank_world()
    out: dict = {}
    cases = {
        "2.13 fp32": (False, False, torch.float32),
        "2.15 None": (True, False, None),
        "2.16 None": (True, True, None),
        "2.16 fp32": (True, True, torch.float32),
    }
    for name, (in_param_dtype, pending_api, reduce_dtype) in cases.items():
        with _installed_torch(reduce_in_param_dtype=in_param_dtype, pending_api=pending_api):
            model = _sharded(fully_shard, reduce_dtype)
            model.set_requires_gradient_sync(False)
            held = []
            for value in MICRO:
                _backward(model, value, rank)
                held.append(model.get_pending_gradients()[model.weight][0])
            model.synchronize_gradients()
        same = all(t is held[0] for t in held)
        out[name] = (str(held[0].dtype), same, model.weight.grad.full_tensor().tolist())
    return out


def test_accumulation_dtype_follows_installed_torch() -> None:
    from dist_utils import run_distributed

    for r in run_distributed(_switch_job, 2):
        # 2.15 accumulates reduce_dtype=None in the parameter's dtype; torch's main
        # branch in the compute dtype, explicit reduce_dtype through autograd
        assert r["2.13 fp32"][:2] == ("torch.float32", True)
        assert r["2.15 None"][:2] == ("torch.float32", True)
        assert r["2.16 None"][:2] == ("torch.bfloat16", True)
        assert r["2.16 fp32"][:2] == ("torch.float32", True)
        # one contribution per backward: autograd's fp32 accumulation = the upcast one
        assert r["2.16 fp32"][2] == r["2.13 fp32"][2] == r["2.15 None"][2]
        assert r["2.16 None"][2] != r["2.16 fp32"][2]


def _errors_job() -> str:
    torch.manual_seed(0)
    model = _sharded(fully_shard, None)
    model.set_manual_backward_finalization(True)
    _backward(model, 1.0, 0)
    try:
        model.synchronize_gradients()
    except RuntimeError as exc:
        message = str(exc)
    else:
        message = ""
    model.finalize_backward()
    model.synchronize_gradients()  # after finalize: allowed
    return message


def test_synchronize_before_finalize_raises() -> None:
    from dist_utils import run_distributed

    for message in run_distributed(_errors_job, 2):
        assert "after finalize_backward" in message, message


def _zero_grad_job() -> dict:
    """model.zero_grad() after a resharding backward without sync, then a synchronizing
    backward: with torch's FSDP2 up to 2.15 the pending gradient survives it and is
    reduced; fsdp_compose computes the same there, and drops it where the installed
    FSDP2 has the pending-gradient API."""
    rank, _ = rank_world()
    out: dict = {}
    for name, shard_fn, pending_api in (
        ("fsdp2", torch_fully_shard, False),
        ("ours", fully_shard, False),
        ("ours 2.16", fully_shard, True),
    ):
        with _installed_torch(
            reduce_in_param_dtype=_compat.REDUCE_IN_PARAM_DTYPE, pending_api=pending_api
        ):
            model = _sharded(shard_fn, torch.float32)
            model.set_requires_gradient_sync(False)
            _backward(model, 2.0, rank)
            model.zero_grad()
            model.set_requires_gradient_sync(True)
            _backward(model, 1.0, rank)
        out[name] = model.weight.grad.full_tensor().tolist()
    return out


def test_zero_grad_follows_installed_torch() -> None:
    from dist_utils import run_distributed

    for r in run_distributed(_zero_grad_job, 2):
        assert r["ours"] == r["fsdp2"]  # 2.13: the pending 2 survives zero_grad
        # summed over the 2 ranks' inputs (1x, 2x), averaged: (2+1)*1.5 vs 1*1.5
        assert r["fsdp2"] == [[4.5], [4.5]] and r["ours 2.16"] == [[1.5], [1.5]], r
