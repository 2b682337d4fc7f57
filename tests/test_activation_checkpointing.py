"""Activation checkpointing (``torch.utils.checkpoint``) with fully_shard.

Checkpointed regions inside a unit, around a unit (the hooks run inside the
region and again, as a recomputation, in backward), around two units, and
torch's ``checkpoint_wrapper`` applied before ``fully_shard``: parity with one
process, the all-gathers per unit per step, that the recomputation really ran,
and the memory that checkpointing saves (resident set size of each rank); and
reentrant checkpointing around units, against FSDP2 in the same job.
"""

from __future__ import annotations

import copy
import ctypes
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import (
    collective_log,
    full,
    local_slice,
    mean_across_ranks,
    rank_world,
    train_side_by_side,
)
from torch.utils.checkpoint import checkpoint

from fsdp_compose import fully_shard

LOSS_TOL, GRAD_TOL, PARAM_TOL = 1e-5, 1e-6, 1e-4  # as in test_parity.py


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 8 * dim)
        self.proj = nn.Linear(8 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """A residual MLP block whose activations (8x wide) dwarf its parameters."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.mlp = MLP(dim)
        self.checkpoint_mlp = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        h = checkpoint(self.mlp, h, use_reentrant=False) if self.checkpoint_mlp else self.mlp(h)
        return x + h


class Net(nn.Module):
    """``n`` blocks and a head. ``mode`` says where activations are checkpointed:
    ``"inside"`` each block's MLP (inside its unit), ``"around"`` each block call
    (its unit's hooks inside the region), ``"pairs"`` two block calls at a time."""

    def __init__(self, dim: int = 32, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n))
        self.head = nn.Linear(dim, 1)
        self.mode = "none"

    def set_mode(self, mode: str) -> None:
        self.mode = mode
        for block in self.blocks:
            block.checkpoint_mlp = mode == "inside"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "around":
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False)
        elif self.mode == "pairs":
            for a, b in zip(self.blocks[::2], self.blocks[1::2]):
                x = checkpoint(lambda t, a=a, b=b: b(a(t)), x, use_reentrant=False)
        else:
            for block in self.blocks:
                x = block(x)
        return self.head(x).squeeze(-1)  # (B, T)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def _wrap_with_torch_checkpoint_wrapper(model: Net) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def _parity_job(mode: str, steps: int = 3) -> dict:
    _, world = rank_world()
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    if mode == "wrapper":
        _wrap_with_torch_checkpoint_wrapper(model)  # before fully_shard, as in torchtitan
    else:
        model.set_mode(mode)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if mode == "pairs":
        # No backward prefetch: the recomputation of the pair's first block must
        # gather that block's parameters itself, before its own pre-backward.
        model.set_prefetch_depth(backward=0)
    mlp_calls = [0]
    wrapped = "_checkpoint_wrapped_module." if mode == "wrapper" else ""
    first_mlp = model.blocks[0].get_submodule(wrapped + "mlp")
    first_mlp.register_forward_pre_hook(lambda *_: mlp_calls.__setitem__(0, mlp_calls[0] + 1))

    counts, calls = [], []
    gen = torch.Generator().manual_seed(1)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(4 * world, 16, 32, generator=gen), torch.randn(4 * world, 16, generator=gen)

    def record(*_: object) -> None:
        counts.append(dict(log.counts()))
        calls.append(mlp_calls[0])

    with collective_log(model) as log:
        parity = train_side_by_side(
            model, ref, steps, batch, _loss, log=log, after_backward=record,
            before_model=lambda step: mlp_calls.__setitem__(0, 0),
            rename=lambda n: n.replace("._checkpoint_wrapped_module", ""),
        )
    units = [b._fsdp_state().unit.name for b in model.blocks]
    return {"loss_diffs": parity["loss_diffs"], "grad_diff": parity["grad_diff"],
            "param_diff": parity["param_diff"], "counts": counts, "mlp_calls": calls, "units": units}


@pytest.mark.parametrize("mode", ["inside", "around", "pairs", "wrapper"])
def test_checkpoint_parity_and_recompute_gathers(mode: str) -> None:
    from dist_utils import run_distributed

    results = run_distributed(_parity_job, 2, mode)
    for r in results:
        assert max(r["loss_diffs"]) <= LOSS_TOL, r["loss_diffs"]
        assert r["grad_diff"] <= GRAD_TOL, r["grad_diff"]
        assert r["param_diff"] <= PARAM_TOL, r["param_diff"]
        # The checkpointed MLP ran twice per step: forward, and recomputed in backward.
        assert r["mlp_calls"] == [2] * len(r["mlp_calls"]), r["mlp_calls"]
        for counts in r["counts"]:
            for unit in r["units"]:
                # One gather for forward and one in backward, which the recomputation
                # and the unit's backward share; one reduce-scatter.
                assert counts[("all_gather", unit)] == 2, (unit, counts)
                assert counts[("reduce_scatter", unit)] == 1, (unit, counts)


# ---------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> bool:
    try:  # Linux >= 4.0: "5" resets VmHWM to the current resident set size
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _memory_job(dim: int, seq: int, batch: int) -> dict:
    """Resident memory held by activations after forward, and the peak over
    forward + backward, above the resident size before forward (MiB)."""
    rank, world = rank_world()
    # Serve every allocation above 64 KiB with its own mmap, returned to the OS on
    # free, so that the resident set size follows the live tensors.
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
    libc.mallopt(_M_TRIM_THRESHOLD, 64 * 1024)
    torch.manual_seed(0)
    ref = Net(dim)
    x = torch.randn(batch * world, seq, dim)
    y = torch.randn(batch * world, seq)
    ref_loss = _loss(ref(x), y)
    ref_loss.backward()
    results: dict[str, dict] = {}
    for mode in ("none", "inside", "around"):
        model = copy.deepcopy(ref)
        for p in model.parameters():
            p.grad = None
        model.set_mode(mode)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        xs, ys = local_slice(x, rank, world), local_slice(y, rank, world)
        for _ in range(2):  # the second iteration is measured (lazy init done)
            base = _status_mib("VmRSS")
            has_peak = _reset_peak_rss()
            loss = _loss(model(xs), ys)
            held = _status_mib("VmRSS") - base
            loss.backward()
            peak = _status_mib("VmHWM") - base if has_peak else None
            # Relative: a sum over 4096 tokens per rank carries rounding ~1e-6 in
            # absolute terms, with or without checkpointing.
            ref_grads = {n: p.grad for n, p in ref.named_parameters()}
            scale = max(g.abs().max().item() for g in ref_grads.values())
            grad_diff = max((full(p.grad) - ref_grads[n]).abs().max().item()
                            for n, p in model.named_parameters()) / scale
            for p in model.parameters():
                p.grad = None
        results[mode] = {"held_mib": held, "peak_mib": peak, "rel_grad_diff": grad_diff,
                         "loss_diff": abs(mean_across_ranks(loss.item()) - ref_loss.item())}
    return results


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_checkpoint_reduces_activation_memory() -> None:
    from dist_utils import run_distributed

    # Per rank: 8 sequences x 512 tokens x 64 features; each block saves its input,
    # the LayerNorm output and two 8x-wide MLP activations (~18 MiB), while all
    # parameters together are 0.5 MiB.
    results = run_distributed(_memory_job, 2, 64, 512, 8, timeout=180)
    for r in results:
        none, inside, around = r["none"], r["inside"], r["around"]
        for mode in (none, inside, around):
            # (3e-6 relative, the same with and without checkpointing: rounding of
            # the 2-rank vs one-process batch reduction over 4096 tokens per rank)
            assert mode["loss_diff"] <= LOSS_TOL and mode["rel_grad_diff"] <= 1e-5, r
        assert none["held_mib"] > 50, r  # the unsharded-activation baseline (~72 MiB)
        assert inside["held_mib"] < 0.25 * none["held_mib"], r  # only block inputs + LN outputs
        assert around["held_mib"] < 0.15 * none["held_mib"], r  # only block inputs
        if none["peak_mib"] is not None:
            assert inside["peak_mib"] < 0.6 * none["peak_mib"], r
            assert around["peak_mib"] < 0.6 * none["peak_mib"], r


# ---------------------------------------------------------------------------
# reentrant checkpointing, against FSDP2
# ---------------------------------------------------------------------------


class _ReentrantNet(nn.Module):
    """Blocks called as transformers 4.x's ``gradient_checkpointing_enable()`` calls
    its layers (``checkpoint(layer.__call__, ...)``, reentrant there by default),
    reentrant (``"reentrant"``) or not (``"non_reentrant"``), or directly (``"none"``)."""

    def __init__(self, mode: str, head: bool, dim: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLP(dim) for _ in range(3))
        self.head, self.mode = nn.Linear(dim, 4) if head else nn.Identity(), mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.mode == "none":
                x = x + block(x)
            else:
                x = x + checkpoint(block.__call__, x, use_reentrant=self.mode == "reentrant")
        return self.head(x)


def _reentrant_job(cases: list[tuple[str, bool, bool, str]]) -> dict:
    """Per case (checkpointing, reshard_after_forward, whether the input requires
    grad, the units: one per block, the first two blocks one unit, or one per block
    under a root without parameters of its own), fsdp_compose and FSDP2 train the
    same steps: losses, the all-gathers and
    reduce-scatters in issue order (each reduce-scatter with the number of blocks then
    holding unsharded parameters), and the final parameters."""
    from helpers import collectives_by_size
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import DTensor

    out = {}
    for case in cases:
        mode, reshard, input_grad, units = case
        for name, shard in (("fsdp2", torch_fully_shard), ("fsdp_compose", fully_shard)):
            torch.manual_seed(0)
            model = _ReentrantNet(mode, head=units != "root without parameters")
            if units == "two blocks grouped":
                shard([model.blocks[0], model.blocks[1]], reshard_after_forward=reshard)
                shard(model.blocks[2], reshard_after_forward=reshard)
            else:
                for block in model.blocks:
                    shard(block, reshard_after_forward=reshard)
            shard(model)
            optim = torch.optim.SGD(model.parameters(), lr=0.1)
            inputs = torch.Generator().manual_seed(torch.distributed.get_rank())
            losses, sizes = [], []

            def gathered_blocks(blocks: nn.ModuleList = model.blocks) -> int:
                return sum(not isinstance(b.fc.weight, DTensor) for b in blocks)

            with collectives_by_size(sizes, gathered_blocks):
                for step in range(2):
                    x = torch.randn(4, 16, generator=inputs).requires_grad_(input_grad)
                    loss = model(x).sum()
                    sizes.append(("backward", step))
                    loss.backward()
                    optim.step()
                    optim.zero_grad()
                    losses.append(loss.item())
            params = [p.full_tensor().detach() for p in model.parameters()]
            # (an all-gather's count depends on when a prefetch is issued, not a result)
            sizes = [s if s[0] == "reduce_scatter" else s[:2] for s in sizes]
            out[case, name] = (losses, sizes, params)
    return out


_REENTRANT_CASES = [
    ("reentrant", True, True, "blocks"),
    ("reentrant", False, True, "blocks"),
    ("reentrant", True, False, "blocks"),
    ("reentrant", True, True, "two blocks grouped"),
    ("reentrant", True, True, "root without parameters"),
    ("non_reentrant", True, True, "blocks"),
    ("none", True, False, "blocks"),
]


def test_reentrant_checkpointing_as_fsdp2() -> None:
    # Reentrant checkpointing runs each block's first forward without grad (nothing
    # hooked) and recomputes it inside backward, with its own backward inside the
    # checkpoint's: there the block must reduce and reshard, as under FSDP2, not at
    # the end of backward with every block still gathered (a grouped unit once per
    # module, as FSDP2; a root without parameters still ends the outer backward).
    # The same collectives in the same order (finalization's too: FSDP2's pre-order)
    # and at most one block gathered at each reduce-scatter when resharding.
    from dist_utils import run_distributed

    for r in run_distributed(_reentrant_job, 2, _REENTRANT_CASES, timeout=180.0):
        for case in _REENTRANT_CASES:
            (losses, sizes, params), fsdp2 = r[case, "fsdp_compose"], r[case, "fsdp2"]
            assert losses == fsdp2[0], (case, losses, fsdp2[0])
            assert sizes == fsdp2[1], (case, sizes, fsdp2[1])
            assert all(torch.equal(a, b) for a, b in zip(params, fsdp2[2])), case
            if case[1]:
                scattered = [s[2] for s in sizes if s[0] == "reduce_scatter"]
                assert max(scattered) <= (2 if "grouped" in case[3] else 1), (case, sizes)
