"""CPUOffloadPolicy: sharded parameters, gradients and optimizer states on the CPU.

One check runs on both meshes. On a CPU mesh (gloo, CI) the policy is accepted and
changes nothing: training is bit-identical to the run without it. On a CUDA mesh
(NCCL, ``@pytest.mark.gpu``) shards and gradients must live in (optionally pinned)
host memory while forward and backward run on the GPU, with the same numbers as
an unsharded GPU reference.
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig, loss_fn, make_batch
from helpers import local_slice
from models import TINY_GPT
from torch.distributed.device_mesh import init_device_mesh

from fsdp_compose import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

TINY = {**TINY_GPT, "n_layer": 2}
GRAD_TOL = 1e-5  # GPU reductions run in another order than the reference's
PARAM_TOL = 1e-4


def _shard(base: GPT, mesh, policy: OffloadPolicy, mp: MixedPrecisionPolicy | None = None) -> GPT:
    model = copy.deepcopy(base)
    kwargs = {"mesh": mesh, "offload_policy": policy, "mp_policy": mp or MixedPrecisionPolicy()}
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _shard_of(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return torch.chunk(full.detach().cpu(), world, dim=0)[rank]


def _offload_check(device_type: str) -> dict:
    """Trains with and without CPUOffloadPolicy next to an unsharded reference on
    ``device_type``; two backwards per step so that offloaded gradients are both
    created and accumulated."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = device_type == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device_type, (world,))
    cfg = GPTConfig(**TINY)
    torch.manual_seed(0)
    base = GPT(cfg)  # built on the CPU: offloaded shards are cut from it in place
    ref = copy.deepcopy(base).to(device)
    models = {
        "none": _shard(base.to(device), mesh, OffloadPolicy()),
        "pinned": _shard(base.cpu(), mesh, CPUOffloadPolicy(pin_memory=True)),
        "pageable": _shard(base.cpu(), mesh, CPUOffloadPolicy(pin_memory=False)),
    }
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    out: dict = {"world": world, "losses": {k: [] for k in models}}
    for step in range(2):
        for micro in range(2):
            x, y = make_batch(cfg, 2 * world, 10 * step + micro)
            loss_fn(ref(x.to(device)), y.to(device)).backward()
            for name, model in models.items():
                # inputs stay on the CPU: the root moves them to the mesh's device
                logits = model(local_slice(x, rank, world))
                loss = loss_fn(logits, local_slice(y, rank, world).to(device))
                loss.backward()
                out["losses"][name].append(loss.item())
        if step == 0:
            for name, model in models.items():
                params = list(model.parameters())
                out[f"{name}_shard_devices"] = sorted({p.to_local().device.type for p in params})
                out[f"{name}_grad_devices"] = sorted({p.grad.to_local().device.type for p in params})
                out[f"{name}_pinned"] = all(
                    p.to_local().is_pinned() for p in params if p.to_local().numel()
                )
                out[f"{name}_grad_diff"] = max(
                    (p.grad.to_local().cpu() - _shard_of(q.grad, rank, world)).abs().max().item()
                    for p, q in zip(params, ref.parameters())
                )
        for opt in (*opts.values(), ref_opt):
            opt.step()
            opt.zero_grad()
    for name, model in models.items():
        out[f"{name}_param_diff"] = max(
            (p.detach().to_local().cpu() - _shard_of(q, rank, world)).abs().max().item()
            for p, q in zip(model.parameters(), ref.parameters())
        )
        out[f"{name}_state_devices"] = sorted(
            {v.to_local().device.type for s in opts[name].state.values() for v in s.values() if v.dim()}
        )
    # Low-precision compute from offloaded float32 shards.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    bf16 = _shard(base.cpu(), mesh, CPUOffloadPolicy(), mp)
    x, y = make_batch(cfg, 2 * world, 0)
    logits = bf16(local_slice(x, rank, world))
    loss_fn(logits, local_slice(y, rank, world).to(device)).backward()
    out["bf16_logits"] = (str(logits.dtype), logits.device.type)
    out["bf16_grads"] = sorted(
        {(str(p.grad.dtype), p.grad.to_local().device.type) for p in bf16.parameters()}
    )
    return out


def _assert_offload(results: list[dict], device_type: str) -> None:
    offloaded = device_type != "cpu"
    for r in results:
        assert r["none_shard_devices"] == [device_type]
        for name in ("pinned", "pageable"):
            # on a CPU mesh the policy is a no-op; on an accelerator, host memory
            assert r[f"{name}_shard_devices"] == ["cpu"]
            assert r[f"{name}_grad_devices"] == ["cpu"]
            assert r[f"{name}_state_devices"] == ["cpu"]
        assert r["pinned_pinned"] == offloaded
        assert not r["pageable_pinned"], r
        for name in ("none", "pinned", "pageable"):
            assert r[f"{name}_grad_diff"] <= GRAD_TOL, (name, r[f"{name}_grad_diff"])
            assert r[f"{name}_param_diff"] <= PARAM_TOL, (name, r[f"{name}_param_diff"])
        if not offloaded:  # nothing changes at all
            assert r["losses"]["pinned"] == r["losses"]["none"] == r["losses"]["pageable"]
        assert r["bf16_logits"] == ("torch.bfloat16", device_type)
        assert r["bf16_grads"] == [("torch.float32", "cpu")]


def test_cpu_offload_is_a_no_op_on_a_cpu_mesh() -> None:
    from dist_utils import run_distributed

    _assert_offload(run_distributed(_offload_check, 2, "cpu"), "cpu")


def _gpu_worker(rank: int, world: int, init_file: str, result_dir: str) -> None:
    import pickle

    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # gloo for CPU tensors (e.g. clipping offloaded gradients), NCCL for CUDA ones
    dist.init_process_group(
        "cpu:gloo,cuda:nccl", init_method=f"file://{init_file}", rank=rank, world_size=world
    )
    try:
        result = _offload_check("cuda")
    finally:
        dist.destroy_process_group()
    with open(os.path.join(result_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_offload_on_cuda_mesh() -> None:
    import pickle

    import torch.multiprocessing as mp

    world = min(torch.cuda.device_count(), 2)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg")
        mp.spawn(_gpu_worker, args=(world, init_file, tmp), nprocs=world, join=True)
        results = []
        for rank in range(world):
            with open(os.path.join(tmp, f"{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    _assert_offload(results, "cuda")
