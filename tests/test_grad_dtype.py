"""``MixedPrecisionPolicy(grad_dtype=...)``: torch main's gradient dtype, on every torch.

With ``param_dtype=torch.bfloat16`` and ``grad_dtype=torch.float32``, the unsharded
parameters compute in bf16 but receive (and accumulate) fp32 gradients, reduced in
fp32 unless ``reduce_dtype`` says otherwise, and the sharded gradients are fp32
whatever the parameters' storage dtype, also across ``module.to(...)`` conversions.
The cases follow torch main's ``test_fully_shard_grad_dtype.py`` (which needs FSDP2's
private state and a CUDA mm with ``out_dtype``); here on 2 gloo ranks, against fp32
values computed by hand from the same bf16 operands, exactly (sum reduction, no
division). The unsharded parameter's gradient is observed with an observer-free
tensor hook on the registered parameter.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dist_utils import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from fsdp_compose import MixedPrecisionPolicy, fully_shard

BF16, FP32 = torch.bfloat16, torch.float32


class _FP32WeightGrad(torch.autograd.Function):
    """``inp @ weight.T`` whose weight gradient is computed in fp32 from the bf16
    operands (what a mixed-input GEMM with an fp32 output gives on an accelerator)."""

    @staticmethod
    def forward(ctx: Any, inp: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inp, weight)
        return inp @ weight.T

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inp, weight = ctx.saved_tensors
        return grad_output @ weight, grad_output.float().T @ inp.float()


class _Projection(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((8, 8), 0.125, dtype=dtype))

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return _FP32WeightGrad.apply(inp, self.weight)  # type: ignore[no-any-return]


def _received(module: nn.Module) -> list[torch.Tensor]:
    """Hooks the parameter registered now (the unsharded one, inside forward's span)."""
    received: list[torch.Tensor] = []
    module.weight.register_hook(lambda g: received.append(g.detach().clone()))
    return received


def _fp32_gradient_job(storage: torch.dtype, schedule: str, reshard: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    projection = _Projection(storage)
    model = nn.Sequential(projection)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # An omitted reduce_dtype must not reduce in the bf16 compute dtype.
    policy = MixedPrecisionPolicy(param_dtype=BF16, grad_dtype=FP32)
    fully_shard(projection, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh)
    projection.set_gradient_divide_factor(1.0)
    projection.set_force_sum_reduction_for_comms(True)
    out: dict[str, Any] = {"received": [], "grads": []}
    for step in range(2):
        model.zero_grad(set_to_none=step == 0)
        expected = torch.zeros(8, 8, dtype=FP32)
        for micro in range(2):
            projection.set_requires_gradient_sync(schedule != "no_sync" or micro == 1)
            inp = torch.full((2 + micro, 8), 1.0078125, dtype=BF16, requires_grad=True)
            hooked: list[list[torch.Tensor]] = []

            def hook(module: nn.Module, args: Any) -> None:
                hooked.append(_received(module))

            handle = projection.register_forward_pre_hook(hook)
            output = (
                checkpoint(model, inp, use_reentrant=False)
                if schedule == "checkpoint"
                else model(inp)
            )
            handle.remove()
            grad_output = torch.full_like(output, 1.0078125 * (rank + 1))
            local = grad_output.float().T @ inp.detach().float()
            assert not torch.equal(local, local.bfloat16().float())  # fp32 matters here
            output.backward(grad_output)
            received = [g for hooks in hooked for g in hooks]
            out["received"].append(
                (len(received), str(received[0].dtype), torch.equal(received[0], local))
            )
            dist.all_reduce(local)
            expected.add_(local)
            if schedule == "no_sync" and micro == 0:
                continue
            grad = projection.weight.grad
            out["grads"].append(
                (
                    str(projection.weight.dtype),
                    str(grad.dtype),
                    str(grad._spec.tensor_meta.dtype),
                    torch.equal(grad.to_local(), expected.chunk(2)[rank]),
                )
            )
        with torch.no_grad():
            projection.weight.add_(projection.weight.grad.to(storage), alpha=-0.001)
    return out


@pytest.mark.parametrize("storage", [BF16, FP32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("schedule", ["sync", "no_sync", "checkpoint"])
def test_fp32_gradients_of_bf16_compute(storage: torch.dtype, schedule: str) -> None:
    reshard = schedule != "sync"  # both settings, across the cases
    for r in run_distributed(_fp32_gradient_job, 2, storage, schedule, reshard, timeout=120):
        # every backward hands the unsharded parameter one fp32 gradient, exactly the
        # fp32 product of its bf16 operands
        assert all(rec == (1, "torch.float32", True) for rec in r["received"]), r
        # the sharded gradient: fp32 in a parameter of either storage dtype, the exact
        # fp32 sum over ranks (and micro-batches without sync)
        assert r["grads"] and all(
            g == (str(storage), "torch.float32", "torch.float32", True) for g in r["grads"]
        ), r


def _explicit_reduce_dtype_job(reduce_dtype: torch.dtype) -> dict[str, Any]:
    rank = dist.get_rank()
    projection = _Projection(BF16)
    projection.register_parameter("unused", nn.Parameter(torch.zeros(8, 8, dtype=BF16)))
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=reduce_dtype, grad_dtype=FP32)
    fully_shard(projection, mp_policy=policy)
    projection.set_reduce_scatter_unused_params(True)
    projection.set_gradient_divide_factor(1.0)
    projection.set_force_sum_reduction_for_comms(True)
    inp = torch.full((2, 8), 1.0078125, dtype=BF16)
    output = projection(inp)
    grad_output = torch.full_like(output, 1.0078125 * (rank + 1))
    expected = (grad_output.float().T @ inp.float()).to(reduce_dtype)
    dist.all_reduce(expected)  # reduced in reduce_dtype, as the reduce-scatter
    output.backward(grad_output)
    grad, unused = projection.weight.grad, projection.unused.grad
    return {
        "dtype": str(grad.dtype),
        "value": torch.equal(grad.to_local(), expected.float().chunk(2)[rank]),
        "unused": (str(unused.dtype), int(torch.count_nonzero(unused.to_local()))),
    }


@pytest.mark.parametrize("reduce_dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_explicit_reduce_dtype_and_unused_parameter(reduce_dtype: torch.dtype) -> None:
    for r in run_distributed(_explicit_reduce_dtype_job, 2, reduce_dtype, timeout=120):
        assert r == {"dtype": "torch.float32", "value": True, "unused": ("torch.float32", 0)}, r


def _conversion_job(storage: torch.dtype) -> dict[str, Any]:
    """Gradients survive ``module.to``-style conversions in their grad_dtype, exactly,
    also a conversion that fails part way; training then continues from them."""
    inp = torch.full((3, 8), 1.0078125, dtype=BF16)
    out: dict[str, Any] = {}
    for conversion in ("bfloat16", "half", "to", "fails"):
        model = nn.Sequential(_Projection(storage), _Projection(storage))
        model[0].register_buffer("sentinel", torch.ones(1))
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=BF16, grad_dtype=FP32))
        model(inp).backward(torch.full_like(inp, 1.0078125))
        params = list(model.parameters())
        expected = [p.grad.to_local().clone() for p in params]
        if conversion == "fails":

            def fail_on_buffer(t: torch.Tensor) -> torch.Tensor:
                if t.numel() == 1:
                    raise RuntimeError("buffer conversion failed")
                return t.to(torch.float16)

            try:
                model._apply(fail_on_buffer)
            except RuntimeError:
                pass
        elif conversion == "to":
            model.to(dtype=BF16)
        else:
            getattr(model, conversion)()
        kept = [
            (str(p.grad_dtype), str(p.grad.dtype), torch.equal(p.grad.to_local(), e))
            for p, e in zip(params, expected)
        ]
        model.to(dtype=storage)
        model(inp).backward(torch.full_like(inp, 1.0078125))
        again = [torch.equal(p.grad.to_local(), e * 2) for p, e in zip(params, expected)]
        out[conversion] = (kept, again, all(p is q for p, q in zip(params, model.parameters())))
    return out


@pytest.mark.parametrize("storage", [BF16, FP32], ids=["bf16", "fp32"])
def test_conversions_keep_gradients_in_grad_dtype(storage: torch.dtype) -> None:
    for r in run_distributed(_conversion_job, 2, storage, timeout=120):
        for conversion, (kept, again, same_objects) in r.items():
            assert kept == [("torch.float32", "torch.float32", True)] * 2, (conversion, kept)
            assert again == [True, True] and same_objects, (conversion, again)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64, "float32"])
def test_grad_dtype_must_be_floating_point(dtype: Any) -> None:
    with pytest.raises(ValueError, match="floating-point dtype"):
        MixedPrecisionPolicy(grad_dtype=dtype)


def test_grad_dtype_is_keyword_only_and_off_by_default() -> None:
    policy = MixedPrecisionPolicy(BF16, FP32, None, False)
    assert policy.grad_dtype is None and policy.cast_forward_inputs is False
    assert MixedPrecisionPolicy(grad_dtype=FP32).grad_dtype is FP32
