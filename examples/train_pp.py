"""Pipeline parallel x fully sharded data parallel: train the example GPT on a
(pp, dp) mesh with ``torch.distributed.pipelining`` and fsdp_compose.

    torchrun --nproc-per-node 4 examples/train_pp.py                     # pp=2 x dp=2, GPipe
    torchrun --nproc-per-node 4 examples/train_pp.py --schedule 1f1b --check

The GPT is cut into ``pp`` stages (embeddings and the first blocks, ..., the last
blocks with the final norm and LM head). Each rank builds the full model from the
same seed and keeps its stage. Within a stage's data-parallel group each block is
a ``fully_shard`` unit and the stage module is the root of its own unit tree, so
every stage has its own scheduler. ``fsdp_compose.PipelineStage`` (a drop-in for
torch's) switches gradient reduction off for all microbatches but the last, so
each unit reduce-scatters once per step; the script prints that count. With
``--check`` every rank also trains a one-process copy of the whole model on the
global batch, prints how far the pipeline's loss and parameters are from it and
ends with PASS or FAIL against the tolerances of ``examples/check.py`` (exit
status 1 on FAIL). The loss differs by up to a few 1e-5 after some steps: AdamW
amplifies float32 rounding of near-zero gradients, as much as between two
one-process runs that split the batch differently (see [Note: --check tolerances]).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor

import fsdp_compose
from check import report
from fsdp_compose import fully_shard, trace
from gpt import GPT, PRESETS, loss_fn, make_batch
from launch import finish, init_distributed

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class GPTStage(nn.Module):
    """Blocks ``[lo, hi)`` of a :class:`GPT`, with the embeddings on the first
    stage and the final norm and LM head on the last. Shares ``gpt``'s modules,
    so its parameters are ``gpt``'s (names in ``gpt`` stay valid)."""

    def __init__(self, gpt: GPT, lo: int, hi: int) -> None:
        super().__init__()
        self.is_first, self.is_last = lo == 0, hi == len(gpt.blocks)
        if gpt.cfg.tie_weights and not (self.is_first and self.is_last):
            raise ValueError("tied embeddings cannot be split across pipeline stages")
        if self.is_first:
            self.tok_emb, self.pos_emb = gpt.tok_emb, gpt.pos_emb
        self.blocks = nn.ModuleList(gpt.blocks[lo:hi])
        if self.is_last:
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:  # x: token ids (B, T)
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.size(1), device=x.device))
        for block in self.blocks:
            x = block(x)
        if self.is_last:
            x = self.lm_head(self.ln_f(x))  # logits (B, T, V)
        return x


def stage_bounds(n_layer: int, n_stages: int, stage: int) -> tuple[int, int]:
    """Block range of ``stage`` when ``n_layer`` blocks are split evenly."""
    if n_layer < n_stages:
        raise ValueError(f"{n_layer} blocks cannot fill {n_stages} pipeline stages")
    per, extra = divmod(n_layer, n_stages)
    lo = stage * per + min(stage, extra)
    return lo, lo + per + (1 if stage < extra else 0)


def build_stage(gpt: GPT, stage: int, n_stages: int, dp_mesh: DeviceMesh) -> GPTStage:
    """Cuts ``gpt``'s stage out and shards it over ``dp_mesh``: one unit per block,
    and the stage module (embeddings / head) as the root unit."""
    module = GPTStage(gpt, *stage_bounds(len(gpt.blocks), n_stages, stage))
    for block in module.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(module, mesh=dp_mesh)
    return module


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (one per rank of a dp group)")
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default="gpipe")
    p.add_argument("--microbatches", type=int, default=4, help="per step, per data-parallel rank")
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--check", action="store_true", help="compare with one process on the global batch")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    rank, world, device = init_distributed()
    if world % args.pp:
        raise SystemExit(f"--pp {args.pp} must divide the number of ranks ({world})")
    dp = world // args.pp
    if args.batch_size % (dp * args.microbatches):
        raise SystemExit("--batch-size must be a multiple of dp x --microbatches")
    mesh = init_device_mesh(device.type, (args.pp, dp), mesh_dim_names=("pp", "dp"))
    stage_idx, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")

    torch.manual_seed(0)  # the same full model on every rank; each keeps its stage
    cfg = PRESETS[args.preset]
    with torch.device(device):
        gpt = GPT(cfg)
    reference = copy.deepcopy(gpt) if args.check else None
    module = build_stage(gpt, stage_idx, args.pp, mesh["dp"])
    stage = fsdp_compose.PipelineStage(module, stage_idx, args.pp, device, group=mesh["pp"].get_group())
    schedule = SCHEDULES[args.schedule](stage, args.microbatches, loss_fn=loss_fn)
    optim = torch.optim.AdamW(module.parameters(), lr=args.lr)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=args.lr) if reference else None
    # Units with parameters: one per block, plus the root where it holds the
    # embeddings or the head.
    n_units = len(module.blocks) + int(module.is_first or module.is_last)
    if rank == 0:
        print(f"GPT '{args.preset}': {sum(p.numel() for p in gpt.parameters()) / 1e6:.1f}M parameters, "
              f"pp={args.pp} x dp={dp}, {args.schedule}, {args.microbatches} microbatches per step")

    local = args.batch_size // dp
    start = time.perf_counter()
    loss_diffs: list[float] = []
    for step in range(args.steps):
        x, y = make_batch(cfg, args.batch_size, step)  # the global batch, on every rank
        x = x[dp_rank * local : (dp_rank + 1) * local].to(device)
        y = y[dp_rank * local : (dp_rank + 1) * local].to(device)
        losses: list[torch.Tensor] = []
        with trace.recording(module) as timeline:  # the timeline lists every collective
            if stage.is_first:
                schedule.step(x)
            elif stage.is_last:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
        reduce_scatters = sum(e.get("cat") == "reduce_scatter" for e in timeline.events())
        optim.step()
        optim.zero_grad(set_to_none=True)
        # The last stage knows the loss: average it over microbatches and dp ranks,
        # then send it to global rank 0 for printing.
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros((), device=device)
        dist.all_reduce(loss)  # only the last stage's dp ranks contribute
        loss /= dp
        line = (f"step {step:3d} | loss {loss.item():.4f} | "
                f"reduce-scatters on rank 0: {reduce_scatters} ({n_units} units)")
        if reference is not None:
            xg, yg = make_batch(cfg, args.batch_size, step)
            ref_loss = loss_fn(reference(xg.to(device)), yg.to(device))
            ref_loss.backward()
            ref_optim.step()
            ref_optim.zero_grad(set_to_none=True)
            diff = abs(loss.item() - ref_loss.item())
            loss_diffs.append(diff)
            line += f" | one-process loss {ref_loss.item():.4f} (diff {diff:.1e})"
        if rank == 0:
            print(line)
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(f"{args.steps} steps in {elapsed:.1f}s")

    status = 0
    if reference is not None:
        # Parameter distance to the one-process run, over this stage's parameters.
        ref_params = dict(reference.named_parameters())
        mine = {id(p) for p in module.parameters()}
        worst = torch.zeros((), device=device)
        for name, p in gpt.named_parameters():
            if id(p) in mine:
                full = p.full_tensor() if isinstance(p, DTensor) else p
                worst = torch.maximum(worst, (full.detach() - ref_params[name].detach()).abs().max())
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # every rank: the same verdict
        measured = {
            "loss at step 0": loss_diffs[0] if loss_diffs else 0.0,
            "max loss diff over all steps": max(loss_diffs, default=0.0),
            "max parameter diff": worst.item(),
        }
        status = report(measured, show=rank == 0)
    finish()
    raise SystemExit(status)


if __name__ == "__main__":
    main()
