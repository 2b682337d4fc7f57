"""Gradient clipping and loss scaling on sharded (DTensor) gradients, FSDP and HSDP.

``torch.nn.utils.clip_grad_norm_`` must return the global norm of the one-process
reference and clip identically; a loss scaler must make the same skip-or-step
decision on every rank, even when only one rank sees an inf. ``torch.amp.GradScaler``
does so for DTensor gradients; the gradients it cannot handle (plain ones next to
DTensors) are what ``ShardedGradScaler`` is kept for.
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


def _inject_inf_on_last_rank(model: GPT, every_replica: bool = False) -> None:
    """An inf in one element of the last rank's gradient shard, after the reduction:
    no other rank can see it unless the scaler tells them. ``every_replica``: also
    on the other HSDP replicas' last shard, as an overflow in the all-reduce would be."""
    grad = model.blocks[0].mlp.fc.weight.grad
    mesh = grad.device_mesh
    last = mesh.get_local_rank(mesh.ndim - 1) == mesh.size(mesh.ndim - 1) - 1
    if last and (
        every_replica or torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
    ):
        grad.to_local().view(-1)[0] = math.inf


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

    # --- torch.amp.GradScaler: DTensor's dispatch reduces found_inf over the ----
    # sharded mesh dims, which serves DTensor-only gradients (the HSDP replicas'
    # shards are one all-reduce's output, so an overflow is on every replica).
    plain = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    backward(3, plain)
    ref.zero_grad()
    _inject_inf_on_last_rank(model, every_replica=True)
    before = _local_params(model)
    plain.step(opt)
    plain.update()
    out["torch_scaler_skipped"] = _unchanged(model, before)
    opt.zero_grad()

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
    assert all(r["torch_scaler_skipped"] for r in results), [r["torch_scaler_skipped"] for r in results]


def _mixed_gradients_job() -> dict:
    """An optimizer over a sharded module and an ignored (plain, rank-local) one."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    rank, world = rank_world()
    out: dict = {}
    for name, shard in (("fsdp_compose", fully_shard), ("torch_fsdp2", torch_fully_shard)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        shard(model, ignored_params=set(model[1].parameters()))
        x = torch.randn(2, 4)

        def backward(
            scaler: torch.amp.GradScaler, model: torch.nn.Sequential = model, x: torch.Tensor = x
        ) -> list[torch.Tensor]:
            model.zero_grad()
            scaler.scale(model(x).sum()).backward()
            if rank == world - 1:
                model[1].weight.grad[0, 0] = math.inf  # a plain gradient, on one rank
            return [p.detach().clone() for p in model[1].parameters()]

        def skipped(before: list[torch.Tensor], model: torch.nn.Sequential = model) -> bool:
            return all(torch.equal(a, p) for a, p in zip(before, model[1].parameters()))

        # torch's scaler refuses one optimizer over both kinds of gradients
        plain, optim = (
            torch.amp.GradScaler("cpu", init_scale=INIT_SCALE),
            torch.optim.SGD(model.parameters(), lr=0.1),
        )
        backward(plain)
        try:
            plain.unscale_(optim)
            out[f"{name}_torch_one_optimizer"] = "no error"
        except RuntimeError as exc:
            out[f"{name}_torch_one_optimizer"] = str(exc)
        # ... and with one optimizer per kind, the rank-local inf is not agreed on
        optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in model]
        plain = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        before = backward(plain)
        for o in optims:
            plain.step(o)
        plain.update()
        out[f"{name}_torch"] = (skipped(before), plain.get_scale())
        # ShardedGradScaler: every rank skips and backs off, with one optimizer
        scaler = ShardedGradScaler("cpu", init_scale=INIT_SCALE)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        before = backward(scaler)
        scaler.step(optim)
        scaler.update()
        out[f"{name}_sharded"] = (skipped(before), scaler.get_scale())
    return out


def test_torch_grad_scaler_cannot_mix_plain_and_dtensor_gradients() -> None:
    """What ShardedGradScaler is for: ``torch.amp.GradScaler`` raises on an
    optimizer whose gradients mix DTensors and plain tensors (ignored parameters),
    and with the two kinds in separate optimizers an inf in a plain gradient on one
    rank skips the step there only (the ranks' parameters and scales diverge). The
    same holds for torch's own fully_shard; ShardedGradScaler skips everywhere."""
    from dist_utils import run_distributed

    results = run_distributed(_mixed_gradients_job, 2, timeout=120)
    for r in results:
        for name in ("fsdp_compose", "torch_fsdp2"):
            assert "mixed torch.Tensor and DTensor" in r[f"{name}_torch_one_optimizer"], r
            assert r[f"{name}_sharded"] == (True, INIT_SCALE / 2), r
    for name in ("fsdp_compose", "torch_fsdp2"):
        assert [r[f"{name}_torch"] for r in results] == [
            (False, INIT_SCALE),
            (True, INIT_SCALE / 2),
        ], results


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
