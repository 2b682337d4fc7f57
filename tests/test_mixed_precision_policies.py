"""torch 2.15's mixed precision API on every torch: ``MixedPrecisionPolicy(
param_dtype_override_fn=...)`` and ``reduce_dtype=None`` following the installed
torch's FSDP2 (2.15: the parameters' dtype; up to 2.14: ``param_dtype``), and
policies imported from ``torch.distributed.fsdp`` passed to fsdp_compose's
``fully_shard``.

Each case runs torch's own ``fully_shard`` on the same input: where the installed
torch lacks the feature, on the FSDP2 program that means the same (a separate
unit for the parameters kept in fp32, an explicit ``reduce_dtype``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from dist_utils import run_distributed
from helpers import full, local_slice, rank_world
from torch.distributed import fsdp as torch_fsdp

import fsdp_compose
from fsdp_compose import MixedPrecisionPolicy, fully_shard
from fsdp_compose._runtime import _compat

WORLD = 2
BF16 = torch.bfloat16
TORCH_HAS_OVERRIDE = "param_dtype_override_fn" in {
    f.name for f in torch_fsdp.MixedPrecisionPolicy.__dataclass_fields__.values()
}


class _Scale(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen_dtype = self.weight.dtype  # the unsharded parameter's dtype
        return (x.float() * self.weight).to(x.dtype)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = nn.Linear(6, 16, bias=False)
        self.scale = _Scale(16)
        self.lin2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen_dtype = self.lin2.weight.dtype  # the root unit's
        return self.lin2(torch.tanh(self.scale(self.lin1(x))))


def _keep_1d_fp32(param: nn.Parameter) -> torch.dtype | None:
    return torch.float32 if param.ndim == 1 and param.numel() == 16 else None


def _grads_after_step(model: nn.Module) -> dict[str, torch.Tensor]:
    rank, world = rank_world()
    x = torch.randn(4 * world, 6, generator=torch.Generator().manual_seed(5))
    (model(local_slice(x, rank, world)).float().pow(2).mean() * 100).backward()
    return {n: full(p.grad).clone() for n, p in model.named_parameters()}


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def _override_job() -> dict:
    base = _Net()
    calls: list[tuple[int, ...]] = []

    def keep(param: nn.Parameter) -> torch.dtype | None:
        calls.append(tuple(param.shape))
        return _keep_1d_fp32(param)

    ours = copy.deepcopy(base)
    fully_shard(
        ours,
        mp_policy=MixedPrecisionPolicy(
            param_dtype=BF16, reduce_dtype=torch.float32, param_dtype_override_fn=keep
        ),
    )
    out: dict = {"calls": sorted(calls)}
    grads = _grads_after_step(ours)
    out["seen"] = (str(ours.seen_dtype), str(ours.scale.seen_dtype))
    out["sharded"] = sorted({str(p.dtype) for p in ours.parameters()})
    out["grad_dtypes"] = sorted({str(g.dtype) for g in grads.values()})
    # The same program without the override: the kept parameter in its own unit.
    ref = copy.deepcopy(base)
    fp32 = torch_fsdp.MixedPrecisionPolicy(reduce_dtype=torch.float32)
    torch_fsdp.fully_shard(ref.scale, mp_policy=fp32)
    mp = torch_fsdp.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    torch_fsdp.fully_shard(ref, mp_policy=mp)
    ref_grads = _grads_after_step(ref)
    out["ref_seen"] = (str(ref.seen_dtype), str(ref.scale.seen_dtype))
    out["diff_two_units"] = _diff(grads, ref_grads)
    if TORCH_HAS_OVERRIDE:  # torch 2.15+: its own override, one unit
        theirs = copy.deepcopy(base)
        policy = torch_fsdp.MixedPrecisionPolicy(  # type: ignore[call-arg]
            param_dtype=BF16, reduce_dtype=torch.float32, param_dtype_override_fn=_keep_1d_fp32
        )
        torch_fsdp.fully_shard(theirs, mp_policy=policy)
        out["diff_torch_override"] = _diff(grads, _grads_after_step(theirs))
    # Without the override, the same model computes in bf16 throughout.
    plain = copy.deepcopy(base)
    fully_shard(plain, mp_policy=MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32))
    out["diff_no_override"] = _diff(grads, _grads_after_step(plain))
    return out


def test_param_dtype_override_fn_as_fsdp2_215() -> None:
    for r in run_distributed(_override_job, WORLD):
        # Called once per managed parameter, with the original parameter.
        assert r["calls"] == sorted([(16, 6), (16,), (3, 16), (3,)]), r["calls"]
        assert r["seen"] == ("torch.bfloat16", "torch.float32") == r["ref_seen"], r
        assert r["sharded"] == ["torch.float32"] and r["grad_dtypes"] == ["torch.float32"], r
        assert r["diff_two_units"] < 1e-6, r
        assert r.get("diff_torch_override", 0.0) < 1e-6, r
        assert r["diff_no_override"] > 1e-4, r  # the override changes the numbers


def _override_refusals_job() -> dict:
    def bad(result: object):
        return MixedPrecisionPolicy(param_dtype=BF16, param_dtype_override_fn=lambda p: result)

    errors = {}
    for name, policy in {"fp16": bad(torch.float16), "not_a_dtype": bad("fp32")}.items():
        model = nn.Linear(4, 4)
        with pytest.raises(ValueError, match="param_dtype_override_fn must return") as info:
            fully_shard(model, mp_policy=policy)
        errors[name] = str(info.value)
        assert not isinstance(model, fsdp_compose.FSDPModule)  # left unchanged
    with pytest.raises(TypeError, match="must be callable"):
        MixedPrecisionPolicy(param_dtype_override_fn=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # keyword-only, as in torch 2.15
        MixedPrecisionPolicy(None, None, None, True, _keep_1d_fp32)  # type: ignore[misc]
    return errors


def test_param_dtype_override_fn_refusals() -> None:
    for r in run_distributed(_override_refusals_job, WORLD):
        assert "torch.float16" in r["fp16"] and "str" in r["not_a_dtype"], r


def _reduce_dtype_job() -> dict:
    # Plain layers: their gradients are computed in bf16 either way, so on torch
    # up to 2.14 an explicit fp32 reduce_dtype is what 2.15's None means. (2.15 also
    # hands type-promoted gradients, like _Scale's, over in fp32: checked on 2.15.)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    follows = _compat.REDUCE_IN_PARAM_DTYPE
    out: dict = {}
    try:
        for semantics in (follows, not follows):
            _compat.REDUCE_IN_PARAM_DTYPE = semantics  # this rank process only
            ours = copy.deepcopy(base)
            fully_shard(ours, mp_policy=MixedPrecisionPolicy(param_dtype=BF16))
            grads = _grads_after_step(ours)
            # The FSDP2 program that means the same on the installed torch.
            explicit = copy.deepcopy(base)
            reduce_dtype = torch.float32 if semantics else BF16
            mp = torch_fsdp.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=reduce_dtype)
            torch_fsdp.fully_shard(explicit, mp_policy=mp)
            out[f"diff_explicit_{semantics}"] = _diff(grads, _grads_after_step(explicit))
            out[f"grads_{semantics}"] = grads
            if semantics == follows:  # the default: torch's reduce_dtype=None itself
                theirs = copy.deepcopy(base)
                none = torch_fsdp.MixedPrecisionPolicy(param_dtype=BF16)
                torch_fsdp.fully_shard(theirs, mp_policy=none)
                out["diff_default"] = _diff(grads, _grads_after_step(theirs))
    finally:
        _compat.REDUCE_IN_PARAM_DTYPE = follows
    out["semantics_differ"] = _diff(out.pop("grads_True"), out.pop("grads_False"))
    return out


def test_reduce_dtype_none_follows_installed_torch() -> None:
    for r in run_distributed(_reduce_dtype_job, WORLD):
        assert r["diff_default"] == 0.0, r
        assert r["diff_explicit_True"] == 0.0 and r["diff_explicit_False"] == 0.0, r
        assert r["semantics_differ"] > 0.0, r  # fp32 and bf16 reductions are told apart


def _torch_policies_job() -> dict:
    base = _Net()
    ours = copy.deepcopy(base)
    mp = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    fully_shard(ours.lin1, mp_policy=mp, offload_policy=fsdp_compose.CPUOffloadPolicy())
    fully_shard(ours, mp_policy=mp)
    grads = _grads_after_step(ours)
    # The same program with the policies imported from torch.distributed.fsdp.
    with_torch = copy.deepcopy(base)
    torch_mp = torch_fsdp.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    fully_shard(with_torch.lin1, mp_policy=torch_mp, offload_policy=torch_fsdp.CPUOffloadPolicy())
    fully_shard(with_torch, mp_policy=torch_mp, offload_policy=torch_fsdp.OffloadPolicy())
    out = {"diff": _diff(grads, _grads_after_step(with_torch))}
    out["seen"] = str(with_torch.seen_dtype)
    with pytest.raises(TypeError, match="mp_policy must be a MixedPrecisionPolicy"):
        fully_shard(nn.Linear(2, 2), mp_policy=object())  # type: ignore[arg-type]
    if TORCH_HAS_OVERRIDE:  # torch 2.15's fully_shard takes fsdp_compose's policy too
        theirs = copy.deepcopy(base)
        policy = MixedPrecisionPolicy(
            param_dtype=BF16, reduce_dtype=torch.float32, param_dtype_override_fn=_keep_1d_fp32
        )
        torch_fsdp.fully_shard(theirs, mp_policy=policy)  # type: ignore[arg-type]
        _grads_after_step(theirs)
        out["torch_takes_ours"] = str(theirs.scale.seen_dtype)
    return out


def test_policies_from_torch_accepted() -> None:
    for r in run_distributed(_torch_policies_job, WORLD):
        assert r["diff"] == 0.0 and r["seen"] == "torch.bfloat16", r
        assert r.get("torch_takes_ours", "torch.float32") == "torch.float32", r


def _non_contiguous_job() -> dict:
    model = nn.Linear(6, 4)
    model.weight = nn.Parameter(torch.randn(6, 4).t())  # a transposed view
    out = {}
    for name, fs in (("torch", torch_fsdp.fully_shard), ("ours", fully_shard)):
        try:
            fs(copy.deepcopy(model) if name == "torch" else model)
            out[name] = None
        except Exception as exc:
            out[name] = (type(exc).__name__, str(exc))
    out["unchanged"] = not isinstance(model, fsdp_compose.FSDPModule)
    model.weight = nn.Parameter(model.weight.contiguous())  # the fix the message names
    fully_shard(model)
    out["fixed"] = tuple(model(torch.randn(2, 6)).shape)
    return out


def test_non_contiguous_parameter_refused_as_fsdp2() -> None:
    for r in run_distributed(_non_contiguous_job, WORLD):
        assert r["torch"][0] == r["ours"][0] == "NotImplementedError", r
        assert "'weight'" in r["ours"][1] and "contiguous()" in r["ours"][1], r
        assert r["unchanged"] and r["fixed"] == (2, 4), r


def _divide_job() -> dict:
    """float16 and float64 reductions (FSDP2 divides before and after the sum there),
    with the default factor and a custom one under force-sum (which gloo runs: FSDP2's
    custom-factor ``PREMUL_SUM`` is NCCL's only), against torch's FSDP2."""
    rank = rank_world()[0]
    out = {}
    for name, dtype, factor in (
        ("fp16", torch.float16, None),
        ("fp16 /8", torch.float16, 8.0),
        ("fp64", torch.float64, None),
    ):
        results = []
        for fs in (torch_fsdp.fully_shard, fully_shard):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))
            model = model.to(torch.float64 if dtype == torch.float64 else torch.float32)
            mp = torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.float16)
            kwargs = {"mp_policy": mp} if dtype == torch.float16 else {}
            fs(model[0], **kwargs)
            fs(model, **kwargs)
            if factor is not None:
                for module in (model, model[0]):
                    module.set_gradient_divide_factor(factor)  # type: ignore[operator]
                    module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
            x = torch.randn(4, 16, dtype=dtype, generator=torch.Generator().manual_seed(rank))
            optim = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(2):
                model(x).float().square().mean().backward()
                optim.step()
                optim.zero_grad()
            results.append([p.full_tensor().detach() for p in model.parameters()])
        out[name] = all(torch.equal(a, b) for a, b in zip(*results))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_low_precision_reduction_divides_as_fsdp2(world: int) -> None:
    # FSDP2 divides float16 gradients by 2 before the sum on 2 ranks (by 2 then 1.5 on
    # 3), where fsdp_compose divided after it: same losses, parameters 1 ulp apart.
    for r in run_distributed(_divide_job, world):
        assert r == {"fp16": True, "fp16 /8": True, "fp64": True}, r
