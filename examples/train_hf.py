"""Train a Hugging Face ``transformers`` model with fsdp_compose.

    torchrun --nproc-per-node 4 examples/train_hf.py                       # Llama, CPU, gloo
    torchrun --nproc-per-node 4 examples/train_hf.py --model gpt2 --check
    torchrun --nproc-per-node 4 examples/train_hf.py --gradient-checkpointing

The model is built from a small config (no weights are downloaded; the script
sets ``HF_HUB_OFFLINE=1``). Each decoder layer is a ``fully_shard`` unit and the
model itself is the root unit, holding the embeddings, the final norm and the LM
head (GPT-2 ties its LM head to the token embedding: both stay in the root unit
here; they could also be units of their own, sharing the weight). The batch is left-padded: the
attention mask and the ``-100`` labels of the padding reach the layers as keyword
arguments, exactly as in fine-tuning. With ``--check`` every rank also trains an
unsharded copy on the global batch, prints the distance to it and ends with PASS
or FAIL against the tolerances of ``examples/check.py`` (exit status 1 on FAIL).

transformers is an example/test dependency only (``pip install -e ".[test]"``).
"""

from __future__ import annotations

import argparse
import copy
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # build from a config; never download

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from check import report
from fsdp_compose import fully_shard
from launch import finish, init_distributed

VOCAB, SEQ, PAD = 128, 32, 4  # PAD: left-padding tokens per sequence


def build_model(name: str) -> nn.Module:
    """A small randomly initialised causal LM (call under the same seed on every rank)."""
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=SEQ,
        )
        return LlamaForCausalLM(config)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # deterministic, for --check
            bos_token_id=0, eos_token_id=0,
        )
        model = GPT2LMHeadModel(config)
        # transformers picks the loss from the class name; "GPT2LMHeadModel" names
        # none, so every process would warn and fall back to this same causal-LM loss.
        model.loss_type = "ForCausalLM"
        return model
    raise ValueError(f"unknown model {name!r}")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder layers (Llama: model.layers, GPT-2: transformer.h)."""
    inner = getattr(model, "model", None) or model.transformer
    return inner.layers if hasattr(inner, "layers") else inner.h


def apply_fsdp(model: nn.Module, mesh: DeviceMesh | None = None) -> None:
    """One unit per decoder layer, and the model as the root unit."""
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def make_batch(batch_size: int, step: int) -> dict[str, torch.Tensor]:
    """A deterministic left-padded batch: counting sequences (learnable) behind
    ``PAD`` padding tokens that are masked out and ignored by the loss. Every
    sequence has the same number of real tokens, so each rank's mean loss is
    comparable with the global one."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (batch_size, 1), generator=gen)
    stride = torch.randint(1, 8, (batch_size, 1), generator=gen)
    ids = (start + stride * torch.arange(SEQ)) % VOCAB
    mask = torch.ones_like(ids)
    mask[:, :PAD] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["llama", "gpt2"], default="llama")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="transformers' own (non-reentrant) activation checkpointing per layer")
    p.add_argument("--check", action="store_true", help="compare with one process on the global batch")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    rank, world, device = init_distributed()
    if args.batch_size % world:
        raise SystemExit(f"--batch-size must be a multiple of the number of ranks ({world})")
    mesh = init_device_mesh(device.type, (world,))

    torch.manual_seed(0)  # the same initial weights on every rank
    with torch.device(device):
        model = build_model(args.model)
    model.train()
    reference = copy.deepcopy(model) if args.check else None
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_fsdp(model, mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=args.lr) if reference else None
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"{type(model).__name__} ({args.model}): {n / 1e6:.2f}M parameters, {world} ranks, "
              f"{len(decoder_layers(model))} layer units + root")

    local = args.batch_size // world
    start = time.perf_counter()
    loss_diffs: list[float] = []
    for step in range(args.steps):
        batch = make_batch(args.batch_size, step)
        mine = {k: v[rank * local : (rank + 1) * local].to(device) for k, v in batch.items()}
        loss = model(**mine, use_cache=False).loss  # mask and labels are keyword arguments
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world
        line = f"step {step:3d} | loss {mean_loss.item():.4f}"
        if reference is not None:
            ref_loss = reference(**{k: v.to(device) for k, v in batch.items()}, use_cache=False).loss
            ref_loss.backward()
            ref_optim.step()
            ref_optim.zero_grad(set_to_none=True)
            diff = abs(mean_loss.item() - ref_loss.item())
            loss_diffs.append(diff)
            line += f" | one-process loss {ref_loss.item():.4f} (diff {diff:.1e})"
        if rank == 0:
            print(line)
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(f"{args.steps} steps in {elapsed:.1f}s")

    status = 0
    if reference is not None:
        # The same numbers on every rank (all-reduced losses, gathered parameters).
        ref_params = dict(reference.named_parameters())
        worst = 0.0
        for name, p in model.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            worst = max(worst, (full.detach() - ref_params[name].detach()).abs().max().item())
        measured = {
            "loss at step 0": loss_diffs[0] if loss_diffs else 0.0,
            "max loss diff over all steps": max(loss_diffs, default=0.0),
            "max parameter diff": worst,
        }
        status = report(measured, show=rank == 0)
    finish()
    raise SystemExit(status)


if __name__ == "__main__":
    main()
