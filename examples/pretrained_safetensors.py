"""Fine-tune a Hugging Face model from its safetensors weights, then export it back.

    torchrun --nproc-per-node 2 examples/pretrained_safetensors.py                 # Llama
    torchrun --nproc-per-node 4 examples/pretrained_safetensors.py --model gpt2 --check

No download: rank 0 first writes a randomly initialised model with
``save_pretrained`` to ``--pretrained`` (stand-in for a downloaded checkpoint
directory). Then every rank:

1. builds the model on the meta device and annotates it with ``fully_shard``
   (nothing is allocated yet);
2. ``load_safetensors``: each rank reads only its own rows of each tensor from
   the memory-mapped files, straight into its shards;
3. trains a few steps;
4. ``save_safetensors``: writes Hugging Face's layout to ``--out``, one tensor
   gathered at a time; with the config next to it, ``from_pretrained`` loads it.

With ``--check``, rank 0 loads the export with ``from_pretrained`` and compares
its logits with the sharded model's. Needs ``pip install -e ".[safetensors,test]"``.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import torch.distributed as dist
from launch import finish
from train_hf import apply_fsdp, build_model, make_batch

from fsdp_compose.safetensors_io import load_safetensors, save_safetensors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["llama", "gpt2"], default="llama")
    p.add_argument("--pretrained", default="/tmp/fsdp_compose_pretrained")
    p.add_argument("--out", default="/tmp/fsdp_compose_finetuned")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--check", action="store_true", help="from_pretrained(out) must match the sharded model")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        torch.manual_seed(0)
        build_model(args.model).save_pretrained(args.pretrained)  # the "downloaded" checkpoint
    dist.barrier()

    with torch.device("meta"):
        model = build_model(args.model)                    # no memory allocated
    if hasattr(model, "model"):  # Llama's rotary frequencies are a buffer no checkpoint holds
        model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    apply_fsdp(model)                                      # one unit per decoder layer + root
    load_safetensors(model, args.pretrained)               # each rank reads its own rows

    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        batch = make_batch(2 * world, step)
        mine = {k: v[2 * rank : 2 * rank + 2] for k, v in batch.items()}
        loss = model(**mine, use_cache=False).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        if rank == 0:
            print(f"step {step} | loss {loss.item():.4f}")

    save_safetensors(model, args.out)                      # HF layout, streamed tensor by tensor
    if rank == 0:
        model.config.save_pretrained(args.out)
        print(f"exported to {args.out}: {sorted(os.listdir(args.out))}")
    if args.check:
        batch = make_batch(4, 0)
        with torch.no_grad():
            sharded = model(**batch, use_cache=False).logits
        if rank == 0:
            from transformers import AutoModelForCausalLM

            plain = AutoModelForCausalLM.from_pretrained(args.out).eval()
            with torch.no_grad():
                diff = (plain(**batch, use_cache=False).logits - sharded).abs().max().item()
            print(f"from_pretrained(export) vs sharded model: max |logits diff| = {diff:.3g}")
            if diff > 1e-5:
                raise SystemExit("CHECK FAILED: the export does not reproduce the sharded model")
    finish()


if __name__ == "__main__":
    main()
