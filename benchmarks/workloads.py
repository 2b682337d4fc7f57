"""The model, data and training step, identical for every implementation compared.

Implementations (``IMPLS``):

* ``single``: one process, unwrapped model, trains the whole global batch.
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` around the whole model.
* ``fsdp2``: torch's ``torch.distributed.fsdp.fully_shard``, applied to each
  transformer block, then to the root (as ``examples/parallelize.py`` does).
* ``fsdp_compose``: ``fsdp_compose.fully_shard``, applied exactly the same way.

Every implementation builds the examples' GPT on the meta device, shards it (FSDP
only), materializes it on the CPU and initializes it with ``init_weights(seed)``,
so all of them start from the same parameters (the init draws full tensors in the
same order and each FSDP rank keeps its shard). Each rank trains on its slice of
the same global batch (``examples/gpt.make_batch``) with AdamW and no gradient
clipping, so losses are directly comparable with the single process.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

from gpt import GPT, PRESETS, GPTConfig, loss_fn, make_batch  # noqa: E402

IMPLS = ("single", "ddp", "fsdp2", "fsdp_compose")
FSDP_IMPLS = ("fsdp2", "fsdp_compose")
LR = 1e-3
SEED = 0


def fully_shard_fn(impl: str) -> Callable[..., nn.Module]:
    """The ``fully_shard`` of ``impl`` (both have FSDP2's signature)."""
    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    elif impl == "fsdp_compose":
        from fsdp_compose import fully_shard
    else:
        raise ValueError(f"{impl!r} is not an FSDP implementation")
    return fully_shard


def shard_blocks_then_root(
    model: nn.Module,
    blocks: list[nn.Module],
    impl: str,
    mesh: object,
    reshard_after_forward: bool,
) -> None:
    """One unit per block, then the root with its default (keeps its parameters
    after forward, since backward needs them first): the same for both FSDPs."""
    fully_shard = fully_shard_fn(impl)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh)


def build_gpt(preset: str, impl: str, reshard_after_forward: bool = True) -> nn.Module:
    """The examples' GPT for ``impl``, initialized identically on every rank.

    FSDP ranks only ever allocate their own shards (meta-device build); the
    others allocate the whole model, as they would in real use.
    """
    cfg = PRESETS[preset]
    with torch.device("meta"):
        model = GPT(cfg)
    if impl in FSDP_IMPLS:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        shard_blocks_then_root(model, list(model.blocks), impl, mesh, reshard_after_forward)
    model.to_empty(device="cpu")
    model.init_weights(seed=SEED)
    if impl == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    return model


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # torch's default AdamW on CPU tensors (single-tensor loop) for everyone.
    return torch.optim.AdamW(model.parameters(), lr=LR)


@dataclass(frozen=True)
class Batches:
    """The global batch of each step and this rank's slice of it."""

    cfg: GPTConfig
    global_batch: int
    rank: int
    world_size: int

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.world_size

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = make_batch(self.cfg, self.global_batch, step)
        lo, hi = self.rank * self.local_batch, (self.rank + 1) * self.local_batch
        return x[lo:hi], y[lo:hi]


def train_step(
    model: nn.Module, optim: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Forward, backward, optimizer step; returns the (detached) local mean loss."""
    x, y = batch
    loss = loss_fn(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return loss.detach()


def unit_param_bytes(preset: str) -> dict[str, int]:
    """Full (unsharded) fp32 parameter bytes: of the whole model, of the root unit
    (everything outside the blocks) and of the largest block unit."""
    cfg = PRESETS[preset]
    with torch.device("meta"):
        ref = GPT(cfg)
    total = sum(p.numel() * p.element_size() for p in ref.parameters())
    block = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in ref.blocks)
    return {"total": total, "root": total - cfg.n_layer * block, "block": block}
