"""Unusual parameters and loading, each against a single-process reference: a mixed-dtype unit reduced in one dtype, complex parameters, a first
forward under ``torch.inference_mode()``, ``load_state_dict(assign=True)`` after a
step and into a meta-device model (shards then own their memory)."""

from __future__ import annotations

import copy

import torch
from dist_utils import run_distributed
from gpt import GPT, GPTConfig, loss_fn, make_batch
from helpers import full, local_slice, max_param_diff, rank_world
from models import TINY_GPT
from torch import nn

from fsdp_compose import MixedPrecisionPolicy, fully_shard

TINY = {**TINY_GPT, "n_layer": 2}


def _shard_gpt(model: GPT) -> GPT:
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, cfg: GPTConfig, steps: range, sharded: bool
) -> list[float]:
    rank, world = rank_world()
    losses = []
    for step in steps:
        x, y = make_batch(cfg, 2 * world, step)
        if sharded:
            x, y = local_slice(x, rank, world), local_slice(y, rank, world)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# -- 1. mixed-dtype unit with reduce_dtype --------------------------------------


class _MixedDtype(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 6).to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * self.gain.float()).sum(-1)


def _mixed_dtype_job() -> dict:
    rank, world = rank_world()
    torch.manual_seed(0)
    ref = _MixedDtype()
    model = copy.deepcopy(ref)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    x = torch.randn(4 * world, 8)
    out = {}
    for step in range(2):
        loss = model(local_slice(x, rank, world)).pow(2).mean()
        loss.backward()
        ref_loss = ref(x).pow(2).mean()
        ref_loss.backward()
        out[f"grad_fc_{step}"] = (
            (full(model.fc.weight.grad) - ref.fc.weight.grad).abs().max().item()
        )
        out[f"grad_gain_{step}"] = (
            (full(model.gain.grad).float() - ref.gain.grad.float()).abs().max().item()
        )
        out["gain_grad_dtype"] = str(model.gain.grad.dtype)
        for m in (model, ref):
            m.zero_grad()
    return out


def test_mixed_dtype_unit_with_reduce_dtype() -> None:
    for r in run_distributed(_mixed_dtype_job, 2):
        assert r["gain_grad_dtype"] == "torch.bfloat16", r
        for step in range(2):
            assert r[f"grad_fc_{step}"] < 1e-5, r
            assert r[f"grad_gain_{step}"] < 2e-2, r  # bf16 gradient rounding


# -- 2. complex parameters --------------------------------------------------------


class _Spectral(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 5, dtype=torch.complex64) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.complex64) @ self.w).abs()


class _ComplexNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.spectral = _Spectral()
        self.out = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.spectral(self.inp(x))).squeeze(-1)


def _complex_job(optim: str) -> dict:
    rank, world = rank_world()
    torch.manual_seed(0)
    ref = _ComplexNet()
    model = copy.deepcopy(ref)
    fully_shard(model.spectral)
    fully_shard(model)
    make = (
        (lambda ps: torch.optim.Adam(ps, lr=1e-2))
        if optim == "adam"
        else (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    )
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    torch.manual_seed(1)
    out = {"loss": []}
    for _ in range(3):
        x, y = torch.randn(4 * world, 6), torch.randn(4 * world)
        loss = (model(local_slice(x, rank, world)) - local_slice(y, rank, world)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = (ref(x) - y).pow(2).mean()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        total = torch.tensor([loss.item()], dtype=torch.float64)
        torch.distributed.all_reduce(total)
        out["loss"].append(abs(total.item() / world - ref_loss.item()))
    out["param_diff"] = max_param_diff(model, ref)[0]
    out["dtype"] = str(model.spectral.w.dtype)
    return out


def test_complex_parameters_train_at_parity() -> None:
    for optim in ("sgd", "adam"):
        for r in run_distributed(_complex_job, 2, optim):
            assert r["dtype"] == "torch.complex64", r
            assert max(r["loss"]) < 1e-5 and r["param_diff"] < 1e-5, (optim, r)


# -- 3. first forward under inference_mode ---------------------------------------


def _inference_first_job() -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(**TINY)
    ref = GPT(cfg)
    model = _shard_gpt(copy.deepcopy(ref))
    x, _ = make_batch(cfg, 2, 0)
    with torch.inference_mode():
        eval_diff = (model(x) - ref(x)).abs().max().item()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses = _train(model, opt, cfg, range(2), True)
    ref_losses = _train(ref, ref_opt, cfg, range(2), False)
    with torch.inference_mode():  # and evaluation between steps keeps working
        model(x)
    _train(model, opt, cfg, range(2, 3), True)
    _train(ref, ref_opt, cfg, range(2, 3), False)
    return {
        "eval_diff": eval_diff,
        "param_diff": max_param_diff(model, ref)[0],
        "losses": (losses, ref_losses),
    }


def test_first_forward_under_inference_mode_then_training() -> None:
    for r in run_distributed(_inference_first_job, 2):
        assert r["eval_diff"] < 1e-5 and r["param_diff"] < 1e-5, r


# -- 4./5. load_state_dict(assign=True) ------------------------------------------


def _assign_after_step_job() -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(**TINY)
    ref = GPT(cfg)
    model = _shard_gpt(copy.deepcopy(ref))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, cfg, range(1), True)
    torch.manual_seed(5)
    fresh = GPT(cfg).state_dict()
    ref.load_state_dict(fresh)
    # A copy: torch records assign=True in the state dict's _metadata, in place.
    model.load_state_dict({k: v.clone() for k, v in fresh.items()}, assign=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _train(model, opt, cfg, range(1, 3), True)
    _train(ref, ref_opt, cfg, range(1, 3), False)
    return {"param_diff": max_param_diff(model, ref)[0]}


def test_assign_load_after_a_step_then_new_optimizer() -> None:
    for r in run_distributed(_assign_after_step_job, 2):
        assert r["param_diff"] < 1e-5, r


def _assign_into_meta_job() -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(**TINY)
    ref = GPT(cfg)
    full_sd = {k: v.clone() for k, v in ref.state_dict().items()}
    with torch.device("meta"):
        model = _shard_gpt(GPT(cfg))
    model.load_state_dict(full_sd, assign=True)
    out: dict = {"on_meta": [n for n, p in model.named_parameters() if p.is_meta]}
    # Each shard owns exactly its own bytes, not a view of the caller's full tensor.
    held, shard_bytes, views = 0, 0, []
    full_ptrs = {v.untyped_storage().data_ptr() for v in full_sd.values()}
    for name, p in model.named_parameters():
        local = p.to_local()
        held += local.untyped_storage().nbytes()
        shard_bytes += local.numel() * local.element_size()
        if local.untyped_storage().data_ptr() in full_ptrs:
            views.append(name)
    out["held"], out["shard_bytes"], out["views"] = held, shard_bytes, views
    # A CPU-built model loaded with assign=True: same ownership.
    cpu_model = _shard_gpt(GPT(cfg))
    cpu_model.load_state_dict(dict(full_sd), assign=True)
    out["cpu_views"] = [
        n
        for n, p in cpu_model.named_parameters()
        if p.to_local().untyped_storage().data_ptr() in full_ptrs
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    out["losses"] = (
        _train(model, opt, cfg, range(2), True),
        _train(ref, ref_opt, cfg, range(2), False),
    )
    out["param_diff"] = max_param_diff(model, ref)[0]
    return out


def test_assign_load_into_meta_model_loads_values_and_owns_memory() -> None:
    for r in run_distributed(_assign_into_meta_job, 2):
        assert r["on_meta"] == [], r
        assert r["views"] == [] and r["cpu_views"] == [], r
        assert r["held"] == r["shard_bytes"], r
        assert r["param_diff"] < 1e-5, r


# -- 6. a buffer aliasing a parameter -------------------------------------------


def _aliasing_buffer_job() -> dict:
    def build(case: str) -> nn.Sequential:
        with torch.device("meta" if case == "meta" else "cpu"):
            m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        if case in ("same", "meta"):  # the parameter object itself
            m[1].register_buffer("w_alias", m[1].weight)
        elif case == "view":  # the same storage
            m[1].register_buffer("w_t", m[1].weight.detach().T)
        elif case == "parent":  # above the unit that shards the parameter
            m.register_buffer("w_alias", m[1].weight)
        elif case == "ignored":  # the fix the error names: the parameter left unsharded
            m[1].register_buffer("w_alias", m[1].weight)
        return m

    out: dict = {}
    for case in ("same", "meta", "view", "parent", "ignored"):
        m = build(case)
        weight = m[1].weight
        try:
            ignored = {weight} if case == "ignored" else None
            fully_shard(m[1], ignored_params=ignored)
            fully_shard(m, ignored_params=ignored)
            out[case] = ""
        except ValueError as exc:
            out[case] = str(exc)
        out[f"{case}_plain"] = type(m[1].weight) is nn.Parameter and m[1].weight is weight
    return out


def test_buffer_aliasing_a_parameter_is_refused() -> None:
    """A buffer that is, or shares storage with, a parameter fully_shard would
    replace (on a real or meta device, or registered above the unit) raises,
    naming the buffer, the parameter and the fixes, instead of silently keeping
    the old full tensor; with the parameter in ignored_params it stays tied."""
    for r in run_distributed(_aliasing_buffer_job, 2):
        for case, buffer in (("same", "w_alias"), ("meta", "w_alias"), ("view", "w_t")):
            assert f"buffer {buffer!r} of Linear" in r[case], r[case]
            assert "parameter 'weight' of Linear" in r[case], r[case]
            assert "ignored_params" in r[case] and r[f"{case}_plain"], r
        assert "buffer 'w_alias' of Sequential" in r["parent"], r["parent"]
        assert "fully_shard(Linear)" in r["parent"], r["parent"]
        assert r["ignored"] == "" and r["ignored_plain"], r
