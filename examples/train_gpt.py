"""Train the example GPT with fsdp_compose on several processes.

    torchrun --nproc-per-node 2 examples/train_gpt.py            # CPU, gloo
    torchrun --nproc-per-node 4 examples/train_gpt.py --hsdp     # 2 replicas x 2 shards
    torchrun --nproc-per-node 2 examples/train_gpt.py --mp bf16 --trace trace.json
    torchrun --nproc-per-node 2 examples/train_gpt.py --mp fp16 --offload   # loss scaling
    python examples/train_gpt.py                                  # one process, no torchrun

Every rank reads the same global batch and trains on its slice of it (the batch
must divide evenly over the ranks); the printed loss is the average over ranks,
each step prints its time and the tokens per second of the whole job, and at
the end each rank reports its memory next to what an unsharded model would hold.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fsdp_compose import ShardedGradScaler, trace
from gpt import GPT, PRESETS, loss_fn, make_batch
from launch import finish, init_distributed
from parallelize import apply_fsdp


_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--mp", choices=sorted(_DTYPES), default="fp32",
                   help="compute and all-gather dtype (gradients are reduced in float32); "
                        "fp16 adds loss scaling; on a CPU, fp16 matmuls are several times "
                        "slower than bf16 (about 7x for the demo), so use bf16 there")
    p.add_argument("--hsdp", action="store_true", help="2-D mesh: replicate x shard")
    p.add_argument("--offload", action="store_true", help="CPUOffloadPolicy (a no-op on a CPU mesh)")
    p.add_argument("--clip", type=float, default=1.0, help="max global gradient norm")
    p.add_argument("--no-reshard", action="store_true", help="reshard_after_forward=False")
    p.add_argument("--meta-init", action="store_true", help="build on the meta device, then materialize")
    p.add_argument("--trace", default=None, metavar="PATH.json",
                   help="write each rank's Chrome-trace timeline to PATH.rankN.json and all of "
                        "them merged (one track group per rank) to PATH.json")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    # With CUDA, gloo serves CPU tensors (offloaded gradients' norm for clipping).
    rank, world, device = init_distributed("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    if args.batch_size % world:
        raise SystemExit(  # said once, by rank 0; every rank exits with status 1
            f"--batch-size {args.batch_size} does not divide over {world} ranks (each rank trains "
            f"on an equal slice); pass a multiple of {world}, e.g. --batch-size "
            f"{world * max(1, round(args.batch_size / world))}" if rank == 0 else 1
        )
    torch.manual_seed(0)

    # --- model and sharding ---------------------------------------------------
    cfg = PRESETS[args.preset]
    if args.hsdp:
        if world % 2:
            raise SystemExit(f"--hsdp needs an even number of ranks (2 replicas x shards), got {world}")
        mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,))
    with torch.device("meta" if args.meta_init else device):
        model = GPT(cfg)
    apply_fsdp(
        model,
        mesh=mesh,
        param_dtype=_DTYPES[args.mp],
        reshard_after_forward=not args.no_reshard,
        offload=args.offload,
    )
    if args.meta_init:
        model.to_empty(device="cpu" if args.offload else device)
        model.init_weights(seed=0)  # each rank initializes only its shards
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # fp16 gradients underflow without loss scaling; the sharded scaler skips a
    # step on every rank when any rank overflows. Disabled, it is a pass-through.
    scaler = ShardedGradScaler(device.type, init_scale=2.0**12, enabled=args.mp == "fp16")
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"GPT '{args.preset}': {n_params / 1e6:.1f}M parameters, {world} ranks, mesh {tuple(mesh.shape)}")

    # --- training loop ----------------------------------------------------------
    local_batch = args.batch_size // world
    timeline = trace.Timeline()
    if args.trace:
        model.register_observer(timeline)  # the per-rank timeline of every unit and collective
    start = time.perf_counter()
    for step in range(args.steps):
        step_start = time.perf_counter()
        x, y = make_batch(cfg, args.batch_size, step)  # (B, T) global batch
        x = x[rank * local_batch : (rank + 1) * local_batch].to(device)  # this rank's slice
        y = y[rank * local_batch : (rank + 1) * local_batch].to(device)
        loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optim)  # clip the true gradients, not the scaled ones
        # DTensor gradients: the returned norm is the global one, over all shards
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optim)
        scaler.update()
        optim.zero_grad(set_to_none=True)
        mean_loss = loss.detach().float()
        dist.all_reduce(mean_loss)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        step_s = time.perf_counter() - step_start  # the all-reduce above waited for every rank
        if rank == 0:
            tokens = x.numel() * world
            line = (f"step {step:3d} | loss {mean_loss.item() / world:.4f} | grad norm {grad_norm.item():.3f} "
                    f"| {step_s * 1e3:.0f} ms | {tokens / step_s:,.0f} tokens/s")
            if scaler.is_enabled():
                line += f" | loss scale {scaler.get_scale():g}"
            print(line)
    elapsed = time.perf_counter() - start
    if args.trace:
        model.unregister_observer(timeline)
        root, ext = os.path.splitext(args.trace)
        paths = [f"{root}.rank{r}{ext or '.json'}" for r in range(world)]
        timeline.export_chrome_trace(paths[rank])
        dist.barrier()  # every rank's file is written before rank 0 merges them
        if rank == 0:
            trace.merge_chrome_traces(paths, args.trace)
            print(f"timeline: {args.trace} (all ranks; open in ui.perfetto.dev), per rank: {', '.join(paths)}")

    # --- per-rank memory ----------------------------------------------------------
    def mib(tensors) -> float:
        return sum(t.numel() * t.element_size() for t in tensors) / 2**20

    params = [p.to_local() for p in model.parameters()]
    states = [v.to_local() for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    report = {
        "rank": rank,
        "params": mib(params),
        "optim": mib(states),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "exposed_comm": sum(timeline.exposed_communication().values()) if args.trace else None,
    }
    # One float64 row per rank (torch's object collectives would need NumPy).
    keys = ("params", "optim", "peak_rss", "exposed_comm")
    row = torch.tensor([float("nan") if report[k] is None else report[k] for k in keys], dtype=torch.float64)
    rows = torch.empty(world * len(keys), dtype=torch.float64)
    # torch 2.13 renamed the single-tensor all-gather; older releases have the old name
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(rows, row)
    rows = rows.view(world, len(keys))
    reports = [
        {"rank": r, **{k: (None if v != v else v) for k, v in zip(keys, rows[r].tolist())}}
        for r in range(world)
    ]
    if rank == 0:
        full = n_params * 4 / 2**20
        print(f"done: {args.steps} steps in {elapsed:.1f}s; per rank, sharded vs what one unsharded "
              f"replica would hold (fp32 params {full:.2f} MiB, AdamW state {2 * full:.2f} MiB):")
        for r in reports:
            line = (f"  rank {r['rank']}: params {r['params']:.2f} of {full:.2f} MiB, "
                    f"optimizer state {r['optim']:.2f} of {2 * full:.2f} MiB, peak RSS {r['peak_rss']:.0f} MiB")
            if r["exposed_comm"] is not None:
                line += f", waited on communication {r['exposed_comm']:.3f}s"
            print(line)
    finish()


if __name__ == "__main__":
    main()
