"""Gradient clipping and loss scaling on sharded (DTensor) gradients, FSDP and HSDP.

``torch.nn.utils.clip_grad_norm_`` must return the global norm of the one-process
reference and clip identically; a loss scaler must make the same skip-or-step
decision on every rank, even when only one rank sees an inf.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from gpt import GPT, GPTConfig, loss_fn, make_batch
from helpers import local_slice, max_grad_diff, max_param_diff, rank_world
from models import TINY_GPT
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from fsdp_compose import MixedPrecisionPolicy, ShardedGradScaler, fully_shard

TINY = {**TINY_GPT, "n_layer": 2}
NORM_TOL = 1e-5
GRAD_TOL = 1e-6
PARAM_TOL = 1e-6  # SGD: an update is lr * grad, so parameters stay as close as grads
INIT_SCALE = 2.0**10
INIT_FP16_SCALE = 2.0**20  # overflows fp16 gradients of this model: the first steps are skipped


def _sharded(base: GPT, hsdp: bool, root_mp: MixedPrecisionPolicy | None = None, **kwargs) -> GPT:
    world = torch.distributed.get_world_size()
    mesh = (
        init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        if hsdp
        else init_device_mesh("cpu", (world,))
    )
    model = copy.deepcopy(base)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    if root_mp is not None:
        kwargs["mp_policy"] = root_mp
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _local_params(model: GPT) -> list[torch.Tensor]:
    return [p.detach().to_local().clone() for p in model.parameters()]


def _unchanged(model: GPT, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, p.detach().to_local()) for a, p in zip(before, model.parameters()))


def _inject_inf_on_last_rank(model: GPT) -> None:
    """An inf in one element of one rank's gradient shard, after the reduction:
    no other rank can see it unless the scaler tells them."""
    if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        model.blocks[0].mlp.fc.weight.grad.to_local().view(-1)[0] = math.inf


def _clip_and_scaler_job(hsdp: bool) -> dict:
    rank, world = rank_world()
    torch.manual_seed(0)
    cfg = GPTConfig(**TINY)
    ref = GPT(cfg)
    model = _sharded(ref, hsdp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    out: dict = {}

    def backward(step: int, scaler: torch.amp.GradScaler | None = None) -> None:
        x, y = make_batch(cfg, 2 * world, step)
        loss = loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world))
        ref_loss = loss_fn(ref(x), y)
        if scaler is not None:
            loss, ref_loss = scaler.scale(loss), ref_loss * scaler.get_scale()
        loss.backward()
        ref_loss.backward()

    # --- clip_grad_norm_: the global norm, for the inf-norm and the 2-norm -------
    backward(0)
    norms = {}
    for norm_type, max_norm in ((math.inf, 1e9), (2.0, 0.05)):  # the first does not clip
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type=norm_type)
        value = total.full_tensor() if isinstance(total, DTensor) else total
        norms[str(norm_type)] = (value.item(), ref_total.item())
    out["norms"] = norms
    out["clipped"] = norms["2.0"][1] > 0.05
    out["clip_grad_diff"] = max_grad_diff(model, ref)
    opt.step()
    ref_opt.step()
    opt.zero_grad()
    ref_opt.zero_grad()
    out["clip_param_diff"] = max_param_diff(model, ref)[0]

    # --- ShardedGradScaler, clean step: unscale_, clip, step like the reference --
    scaler = ShardedGradScaler("cpu", init_scale=INIT_SCALE)
    backward(1, scaler)
    scaler.unscale_(opt)
    for p in ref.parameters():
        p.grad.div_(INIT_SCALE)
    out["unscaled_grad_diff"] = max_grad_diff(model, ref)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    out["scaled_norm_diff"] = abs(total.full_tensor().item() - ref_total.item())
    scaler.step(opt)
    scaler.update()
    ref_opt.step()
    opt.zero_grad()
    ref_opt.zero_grad()
    out["scaler_param_diff"] = max_param_diff(model, ref)[0]
    out["clean_scale"] = scaler.get_scale()

    # --- an inf on one rank only: every rank skips and backs off ----------------
    backward(2, scaler)
    ref.zero_grad()
    _inject_inf_on_last_rank(model)
    before = _local_params(model)
    scaler.step(opt)
    scaler.update()
    out["sharded_scaler_skipped"] = _unchanged(model, before)
    out["inf_scale"] = scaler.get_scale()
    opt.zero_grad()

    # --- torch.amp.GradScaler with the same injection ----------------------------
    # DTensor reduces found_inf over the sharded mesh dims only: enough for 1-D
    # FSDP; on HSDP, a replica-local inf is not seen by the other replica.
    plain = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    backward(3, plain)
    ref.zero_grad()
    _inject_inf_on_last_rank(model)
    before = _local_params(model)
    plain.step(opt)
    plain.update()
    out["torch_scaler_skipped"] = _unchanged(model, before)
    opt.zero_grad()

    # --- ignored parameters: plain, rank-local gradients next to DTensor ones ----
    # (torch's GradScaler refuses to unscale such a mix)
    torch.manual_seed(0)
    mixed = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    fully_shard(mixed, ignored_params=set(mixed[1].parameters()))
    mixed_opt = torch.optim.SGD(mixed.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=INIT_SCALE)
    scaler.scale(mixed(torch.randn(2, 4)).sum()).backward()
    if rank == world - 1:
        mixed[1].weight.grad[0, 0] = math.inf  # a plain tensor gradient on one rank
    before = [p.detach().clone() for p in mixed[1].parameters()]
    scaler.step(mixed_opt)
    scaler.update()
    out["mixed_skipped"] = all(torch.equal(a, p) for a, p in zip(before, mixed[1].parameters()))
    out["mixed_scale"] = scaler.get_scale()
    return out


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp", "hsdp"])
def test_clip_and_scaler(hsdp: bool) -> None:
    from dist_utils import run_distributed

    results = run_distributed(_clip_and_scaler_job, 4 if hsdp else 2, hsdp, timeout=240)
    for r in results:
        for norm_type, (total, ref_total) in r["norms"].items():
            assert abs(total - ref_total) <= NORM_TOL, (norm_type, total, ref_total)
        assert r["clipped"], r
        assert r["clip_grad_diff"] <= GRAD_TOL, r["clip_grad_diff"]
        assert r["clip_param_diff"] <= PARAM_TOL, r["clip_param_diff"]
        assert r["unscaled_grad_diff"] <= GRAD_TOL, r["unscaled_grad_diff"]
        assert r["scaled_norm_diff"] <= NORM_TOL, r["scaled_norm_diff"]
        assert r["scaler_param_diff"] <= PARAM_TOL, r["scaler_param_diff"]
        assert r["clean_scale"] == INIT_SCALE
        assert r["sharded_scaler_skipped"], "an inf on one rank must skip the step everywhere"
        assert r["inf_scale"] == INIT_SCALE / 2
        assert r["mixed_skipped"] and r["mixed_scale"] == INIT_SCALE / 2
    if not hsdp:
        assert all(r["torch_scaler_skipped"] for r in results), [r["torch_scaler_skipped"] for r in results]


def _fp16_training_job(hsdp: bool) -> dict:
    """fp16 compute and fp16 reductions (gloo) with loss scaling: the scale starts
    too high, so early steps overflow and are skipped, in lockstep on every rank."""
    rank, world = rank_world()
    torch.manual_seed(0)
    cfg = GPTConfig(**TINY)
    mp = MixedPrecisionPolicy(param_dtype=torch.float16)
    root_mp = MixedPrecisionPolicy(param_dtype=torch.float16, output_dtype=torch.float32)
    model = _sharded(GPT(cfg), hsdp, root_mp, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = ShardedGradScaler("cpu", init_scale=INIT_FP16_SCALE, growth_interval=4)
    scales, losses = [], []
    for step in range(10):
        x, y = make_batch(cfg, 2 * world, step % 2)
        loss = loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        losses.append(loss.item())
    full = torch.cat([p.detach().full_tensor().reshape(-1) for p in model.parameters()])
    return {"scales": scales, "losses": losses, "checksum": full.double().sum().item(),
            "dtypes": sorted({str(p.dtype) for p in model.parameters()})}


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp", "hsdp"])
def test_fp16_training_with_loss_scaling(hsdp: bool) -> None:
    from dist_utils import run_distributed

    results = run_distributed(_fp16_training_job, 4 if hsdp else 2, hsdp, timeout=240)
    scales = results[0]["scales"]
    assert all(r["scales"] == scales for r in results), [r["scales"] for r in results]
    assert all(r["checksum"] == results[0]["checksum"] for r in results), [r["checksum"] for r in results]
    skipped = sum(1 for a, b in zip([INIT_FP16_SCALE] + scales, scales) if b < a)
    assert 0 < skipped < len(scales), scales
    for r in results:
        assert r["dtypes"] == ["torch.float32"]
        assert all(math.isfinite(v) for v in r["losses"]), r["losses"]
        assert r["losses"][-1] < r["losses"][0], r["losses"]
