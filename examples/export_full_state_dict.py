"""Export a sharded checkpoint as one ordinary ``torch.save`` file for a plain model.

    torchrun --nproc-per-node 2 examples/checkpoint.py --dir /tmp/gpt_ckpt --steps 20
    torchrun --nproc-per-node 2 examples/export_full_state_dict.py --dir /tmp/gpt_ckpt --out /tmp/gpt.pt

The exported file is a plain state dict (parameter name -> full CPU tensor), so
anything can load it without a process group or fsdp_compose::

    model = GPT(PRESETS["demo"])
    model.load_state_dict(torch.load("/tmp/gpt.pt", weights_only=True))

The script loads the newest complete checkpoint under ``--dir`` into a sharded
model (at any world size), gathers the full state dict onto rank 0's CPU one
tensor at a time (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``:
rank 0 needs host memory for the whole model, the other ranks for one parameter),
writes it atomically, and checks that a plain model loaded from the file computes
the same logits as the sharded one.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from launch import finish
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from checkpoint import latest_checkpoint, load_checkpoint
from gpt import GPT, PRESETS, make_batch
from parallelize import apply_fsdp


def export_full_state_dict(model: torch.nn.Module, out: str) -> int:
    """Writes ``model``'s full state dict to ``out`` (from rank 0). Collective.

    Returns:
        The file size in bytes on rank 0, 0 on the other ranks.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)  # full tensors on rank 0, {} elsewhere
    size = 0
    if dist.get_rank() == 0:
        tmp = out + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, out)  # never leave a truncated file under the final name
        size = os.path.getsize(out)
    dist.barrier()
    return size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="checkpoint root written by examples/checkpoint.py")
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    p.add_argument("--out", required=True, help="output file (torch.save of a plain state dict)")
    args = p.parse_args()

    dist.init_process_group("gloo")  # CPU is enough for an export
    rank = dist.get_rank()
    cfg = PRESETS[args.preset]
    with torch.device("meta"):
        model = GPT(cfg)
    apply_fsdp(model)
    model.to_empty(device="cpu")

    found = [latest_checkpoint(args.dir) if rank == 0 else None]
    dist.broadcast_object_list(found, src=0)
    if found[0] is None:
        raise SystemExit(f"no complete checkpoint under {args.dir}")
    step = load_checkpoint(found[0][1], model)  # model only: the optimizer state is not exported
    size = export_full_state_dict(model, args.out)

    # Check the file: a plain, unsharded model loaded from it must agree with the
    # sharded model on a batch (every rank runs the sharded forward).
    x, _ = make_batch(cfg, 4, step=0)
    with torch.no_grad():
        sharded_logits = model(x)
    if rank == 0:
        plain = GPT(cfg)
        plain.load_state_dict(torch.load(args.out, weights_only=True))
        with torch.no_grad():
            diff = (plain(x) - sharded_logits).abs().max().item()
        n = sum(p.numel() for p in plain.parameters())
        print(f"exported step {step} ({n / 1e6:.2f}M parameters) to {args.out}: "
              f"{size / 2**20:.2f} MiB; plain model vs sharded logits: max |diff| = {diff:.3g}")
    finish()


if __name__ == "__main__":
    main()
