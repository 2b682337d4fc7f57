"""Train the example GPT with tensor parallel + fsdp_compose on a 2-D mesh (dp, tp).

    torchrun --nproc-per-node 4 examples/train_tp.py                  # CPU, gloo: 2 dp x 2 tp
    torchrun --nproc-per-node 4 examples/train_tp.py --check          # + loss parity vs one process
    torchrun --nproc-per-node 8 examples/train_tp.py --replicate 2    # HSDP + TP: 2 x 2 x 2
    torchrun --nproc-per-node 4 examples/train_tp.py --mp bf16

Each transformer block is first parallelised with ``parallelize_module`` on the
``tp`` mesh dim (q, k, v and the MLP's first layer column-wise, the output
projections row-wise), then sharded with ``fully_shard`` on the ``dp`` dim; the
embeddings, final norm and head stay plain and are only dp-sharded (root unit).
Ranks of one tp group read the same data; dp groups read different slices of the
global batch. With ``--check`` every rank also trains the unsharded model on the
global batch, prints the per-step loss difference and ends with PASS or FAIL
against the tolerances of ``examples/check.py`` (exit status 1 on FAIL).
"""

from __future__ import annotations

import argparse
import copy
import logging
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from check import report
from fsdp_compose import MixedPrecisionPolicy, fully_shard
from gpt import GPT, PRESETS, loss_fn, make_batch
from launch import finish, init_distributed

_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def apply_tensor_parallel(model: GPT, tp_mesh: DeviceMesh) -> GPT:
    """Megatron-style TP inside each block: the column-parallel layers produce
    this rank's heads / hidden units, the row-parallel ones sum partial outputs
    (one all-reduce each for attention and MLP). Block inputs and outputs stay
    replicated plain tensors."""
    if model.cfg.n_head % tp_mesh.size() != 0:
        raise ValueError(f"n_head={model.cfg.n_head} must be divisible by the tp size {tp_mesh.size()}")
    plan = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(),
    }
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)
    return model


def apply_tp_fsdp(
    model: GPT,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool | int = True,
) -> GPT:
    """TP on ``mesh["tp"]``, then FSDP (HSDP if the mesh has a ``replicate`` dim)
    on the data-parallel dims: each block one unit, the root the rest."""
    apply_tensor_parallel(model, mesh["tp"])
    names = mesh.mesh_dim_names or ()
    dp_mesh = mesh["replicate", "dp"] if "replicate" in names else mesh["dp"]
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    root_mp = MixedPrecisionPolicy(
        param_dtype=param_dtype,
        reduce_dtype=torch.float32,
        output_dtype=torch.float32 if param_dtype is not None else None,
    )
    fully_shard(model, mesh=dp_mesh, mp_policy=root_mp)
    return model


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients that live on several meshes.

    Under FSDP + TP the blocks' TP parameters are DTensors on the (dp, tp) mesh and
    the others (embeddings, norms, head) on the dp mesh; torch's version stacks the
    per-tensor norms of all of them, which DTensor refuses across meshes. Here each
    mesh's norm is reduced to a plain tensor first, then the totals are combined.
    """
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(mesh, []).append(p)
    norms = []
    for params in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    for params in by_mesh.values():  # foreach kernels also need one mesh per call
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree")
    p.add_argument("--replicate", type=int, default=1, help="HSDP replicas (1: plain FSDP)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--mp", choices=sorted(_DTYPES), default="fp32")
    p.add_argument("--clip", type=float, default=1.0, help="max global gradient norm")
    p.add_argument("--reshard-after-forward", type=int, default=1,
                   help="1: True, 0: False, N > 1: reshard to groups of N dp ranks")
    p.add_argument("--check", action="store_true",
                   help="also train the unsharded model on the global batch and compare losses")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    # full_tensor() of FSDP's strided shards of TP shards warns that it needs two
    # all-gathers; expected here (only the parity check gathers full tensors).
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    rank, world, device = init_distributed()
    if world % (args.tp * args.replicate):
        raise SystemExit(f"world size {world} is not divisible by tp x replicate = {args.tp * args.replicate}")
    dp = world // (args.tp * args.replicate)
    if args.replicate > 1:
        mesh = init_device_mesh(device.type, (args.replicate, dp, args.tp),
                                mesh_dim_names=("replicate", "dp", "tp"))
    else:
        mesh = init_device_mesh(device.type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_rank, dp_size = rank // args.tp, world // args.tp  # data-parallel index over replicas too

    cfg = PRESETS[args.preset]
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    ref = copy.deepcopy(model) if args.check else None
    raf = {0: False, 1: True}.get(args.reshard_after_forward, args.reshard_after_forward)
    apply_tp_fsdp(model, mesh, param_dtype=_DTYPES[args.mp], reshard_after_forward=raf)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=args.lr) if ref is not None else None
    if rank == 0:
        w = model.blocks[0].attn.q.weight
        print(f"GPT '{args.preset}': {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
              f"mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))}")
        print(f"  blocks.0.attn.q.weight: {w.placements} on {w.device_mesh.mesh_dim_names}, "
              f"global {tuple(w.shape)}, local {tuple(w.to_local().shape)}")

    per = args.batch_size // dp_size
    start = time.perf_counter()
    worst = first = 0.0
    for step in range(args.steps):
        x, y = make_batch(cfg, per * dp_size, step)
        x, y = x.to(device), y.to(device)
        xs, ys = x[dp_rank * per : (dp_rank + 1) * per], y[dp_rank * per : (dp_rank + 1) * per]
        loss = loss_fn(model(xs), ys)
        loss.backward()
        grad_norm = clip_grad_norm_(model.parameters(), args.clip)
        optim.step()
        optim.zero_grad(set_to_none=True)
        mean = loss.detach().float()
        dist.all_reduce(mean)
        mean = mean.item() / world  # tp ranks of a dp group hold the same loss
        line = f"step {step:3d} | loss {mean:.5f} | grad norm {grad_norm.item():.4f}"
        if ref is not None:
            ref_loss = loss_fn(ref(x), y)
            ref_loss.backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), args.clip)
            ref_optim.step()
            ref_optim.zero_grad(set_to_none=True)
            worst = max(worst, abs(mean - ref_loss.item()))
            first = worst if step == 0 else first
            line += (f" || one process: loss {ref_loss.item():.5f} | grad norm {ref_norm.item():.4f}"
                     f" | loss diff {abs(mean - ref_loss.item()):.2e}")
        if rank == 0:
            print(line)
    elapsed = time.perf_counter() - start
    status = 0
    if ref is not None:
        # Every rank computes the same distances (losses are all-reduced, full_tensor
        # gathers), so every rank exits with the same status.
        param_diff = max(
            (p.full_tensor() - q).abs().max().item() if isinstance(p, DTensor) else 0.0
            for p, q in zip(model.parameters(), ref.parameters())
        )
        measured = {
            "loss at step 0": first,
            "max loss diff over all steps": worst,
            "max parameter diff": param_diff,
        }
        status = report(measured, dtype=args.mp, show=rank == 0)
    elif rank == 0:
        print(f"done: {args.steps} steps in {elapsed:.1f}s")
    finish()
    raise SystemExit(status)


if __name__ == "__main__":
    main()
