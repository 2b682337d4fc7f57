"""A small GPT-style decoder (nanoGPT-like), used by the examples, tests and benchmarks.

    tokens (B, T) -> tok_emb + pos_emb -> n_layer x Block -> ln_f -> lm_head -> logits (B, T, V)

From the repository root: ``from examples.gpt import GPT, PRESETS``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 512
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    tie_weights: bool = False  # lm_head.weight is tok_emb.weight
    bias: bool = True


PRESETS = {
    # ~15M parameters: fast enough to time on a CPU
    "small": GPTConfig(vocab_size=8192, block_size=128, n_layer=6, n_head=8, n_embd=384),
    # ~200M parameters: for memory measurements (build it on the meta device)
    "large": GPTConfig(vocab_size=32000, block_size=256, n_layer=14, n_head=16, n_embd=1024),
    # demo: the README's two-rank CPU run (~1M parameters)
    "demo": GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128),
    # tiny: unit tests
    "tiny": GPTConfig(vocab_size=97, block_size=16, n_layer=3, n_head=2, n_embd=32),
}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q, k and v projections.

    Separate projections let tensor parallel shard them column-wise (each rank
    gets whole heads of q, k and v): the number of heads is derived from the
    local projection width, so the same forward runs on a TP shard with
    ``n_head / tp`` heads. Their seeded init equals that of the former fused
    ``qkv`` weight split in three.

    The key projection has no bias: a key bias adds ``q . b`` to every logit of a
    query, which the softmax cancels, so its gradient is zero up to rounding
    (in the fused layout it was the unused middle third of ``qkv.bias``).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.k.bias = None  # created first so that the seeded init of the rest is unchanged
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, nh, T, hs), nh = the heads of this rank's projection columns
        q, k, v = (
            proj(x).view(B, T, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.tok_emb.weight
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """GPT-2 style init; deterministic given ``seed``. Works on DTensor shards."""
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            full = torch.empty(p.shape, dtype=p.dtype)
            if name.endswith("bias"):
                full.zero_()
            elif "ln" in name:
                full.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith("proj.weight") else 0.02
                full.normal_(0.0, std, generator=gen)
            _copy_full_into(p, full)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, V)


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copies a full tensor into a parameter that may be a sharded DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        shard = distribute_tensor(full.to(param.device), param.device_mesh, param.placements)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def make_batch(cfg: GPTConfig, batch_size: int, step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic (tokens, targets) batch for ``step``; identical on every rank.

    Each sequence is an arithmetic progression modulo the vocabulary with a random
    start and stride, so a model can learn it (the loss visibly falls) from context.
    """
    gen = torch.Generator().manual_seed(seed * 100003 + step)
    start = torch.randint(0, cfg.vocab_size, (batch_size, 1), generator=gen)
    stride = torch.randint(1, 8, (batch_size, 1), generator=gen)
    data = (start + stride * torch.arange(cfg.block_size + 1)) % cfg.vocab_size
    return data[:, :-1], data[:, 1:]
