"""Parameters shared across units ([Note: shared parameters]).

A tied embedding and LM head annotated as separate units, and one weight shared by
blocks in different units (ALBERT-style), train at parity with one process on the
global batch; the shared parameter is sharded once, gathered once per forward and
per backward, and reduced once per step. Cases are grouped into one job per world
size to keep the suite fast.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from gpt import GPT, GPTConfig, loss_fn, make_batch
from helpers import (
    collective_log,
    local_slice,
    max_grad_diff,
    max_param_diff,
    mean_across_ranks,
    rank_world,
)
from models import SharedWeightBlocks

from fsdp_compose import FSDPModule, fully_shard

TINY = dict(vocab_size=97, block_size=16, n_layer=3, n_head=2, n_embd=32, tie_weights=True)
LOSS_TOL = 1e-5
GRAD_TOL = 1e-6
PARAM_TOL = 1e-4  # AdamW after a few steps; see test_parity.PARAM_TOL


def build(kind: str, *, seed: int = 0, **kwargs: Any) -> tuple[nn.Module, nn.Module]:
    """(reference, sharded copy): ``gpt`` annotates the tied ``tok_emb`` and
    ``lm_head`` as units of their own; ``albert`` one unit per block."""
    torch.manual_seed(seed)
    ref: nn.Module = GPT(GPTConfig(**TINY)) if kind == "gpt" else SharedWeightBlocks()
    model = copy.deepcopy(ref)
    shard(model, kind, **kwargs)
    return ref, model


def shard(model: nn.Module, kind: str, **kwargs: Any) -> None:
    root_kwargs = {k: v for k, v in kwargs.items() if k != "reshard_after_forward"}
    if kind == "gpt":
        fully_shard(model.tok_emb, **kwargs)
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model.lm_head, **kwargs)
    else:
        for block in model.blocks:
            fully_shard(block, **kwargs)
    fully_shard(model, **root_kwargs)


def tied(model: nn.Module, kind: str) -> bool:
    if kind == "gpt":
        return model.lm_head.weight is model.tok_emb.weight
    b = model.blocks
    return b[1].mix.weight is b[0].mix.weight and b[3].mix.weight is b[0].mix.weight


def owner_unit(model: nn.Module, kind: str) -> Any:
    owner = model.tok_emb if kind == "gpt" else model.blocks[0]
    return owner._fsdp_state().unit


def batch(kind: str, step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "gpt":
        return make_batch(GPTConfig(**TINY), n, step)
    gen = torch.Generator().manual_seed(step)
    return torch.randn(n, 6, generator=gen), torch.randn(n, generator=gen)


def loss_of(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return loss_fn(out, y) if kind == "gpt" else F.mse_loss(out, y)


def _parity_case(kind: str, raf: bool | int, steps: int = 3) -> dict:
    rank, world = rank_world()
    ref, model = build(kind, reshard_after_forward=raf)
    out: dict = {
        "tied": tied(model, kind),
        "n_params": (len(list(model.parameters())), len(list(ref.parameters()))),
        "keys_equal": list(model.state_dict()) == list(ref.state_dict()),
        "borrower_is_fsdp": isinstance(model.lm_head if kind == "gpt" else model.blocks[1], FSDPModule),
    }
    unit = owner_unit(model, kind)
    between: list[str] = []
    if kind == "albert":  # block 2 runs between two uses of the shared weight
        model.blocks[2].register_forward_hook(lambda *_: between.append(unit.state.value))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    loss_diffs, after_forward = [], []
    with collective_log() as log:
        for step in range(steps):
            x, y = batch(kind, step, 2 * world)
            ref_loss = loss_of(kind, ref(x), y)
            ref_loss.backward()
            log.clear()
            loss = loss_of(kind, model(local_slice(x, rank, world)), local_slice(y, rank, world))
            after_forward.append(unit.state.value)
            loss.backward()
            if step == 0:
                out["grad_diff"] = max_grad_diff(model, ref)
            out["tied_after_backward"] = tied(model, kind)
            ref_opt.step()
            ref_opt.zero_grad()
            opt.step()
            opt.zero_grad()
            loss_diffs.append(abs(mean_across_ranks(loss.item()) - ref_loss.item()))
        out["counts"] = dict(log.counts())
    out.update(
        loss_diffs=loss_diffs,
        param_diff=max_param_diff(model, ref),
        after_forward=after_forward,
        after_backward=unit.state.value,
        between=between,
        owner=unit.name,
        tied_end=tied(model, kind),
    )
    return out


def _parity_job(cases: list[tuple[str, bool | int]]) -> list[dict]:
    return [_parity_case(kind, raf) for kind, raf in cases]


def _check_parity(r: dict, kind: str, raf: bool | int, world: int) -> None:
    what = (kind, raf, world)
    assert r["tied"] and r["tied_after_backward"] and r["tied_end"], what
    assert r["n_params"][0] == r["n_params"][1], (what, r["n_params"])
    assert r["keys_equal"] and r["borrower_is_fsdp"], what
    assert max(r["loss_diffs"]) <= LOSS_TOL, (what, r["loss_diffs"])
    assert r["grad_diff"] <= GRAD_TOL, (what, r["grad_diff"])
    assert r["param_diff"][0] <= PARAM_TOL, (what, r["param_diff"])
    # Freed after its last use of the forward, per reshard_after_forward, and
    # after backward; held between two uses (ALBERT: around block 2).
    expected_state = {True: "sharded", False: "unsharded"}.get(raf, "partially_sharded")  # type: ignore[call-overload]
    assert r["after_forward"] == [expected_state] * len(r["after_forward"]), (what, r["after_forward"])
    assert r["after_backward"] == "sharded", what
    if kind == "albert":
        assert r["between"][1:] == ["unsharded"] * (len(r["between"]) - 1), (what, r["between"])
    # One gather per forward, one per backward unless kept, one reduction per step.
    counts, owner = r["counts"], r["owner"]
    assert counts[("all_gather", owner)] == (1 if raf is False else 2), (what, counts)
    assert counts[("reduce_scatter", owner)] == 1, (what, counts)
    if kind == "gpt":
        assert not any("lm_head" in label for _, label in counts), counts  # no unit of its own


PARITY_CASES = {
    2: [("gpt", True), ("gpt", False), ("albert", True), ("albert", False)],
    3: [("gpt", True), ("albert", False)],  # uneven rows: 97 and 16 over 3 ranks
    4: [("gpt", 2), ("albert", 2), ("gpt", False)],
}


@pytest.mark.parametrize("world_size", sorted(PARITY_CASES))
def test_shared_parity(world_size: int) -> None:
    from dist_utils import run_distributed

    cases = PARITY_CASES[world_size]
    for per_rank in run_distributed(_parity_job, world_size, cases, timeout=240):
        for (kind, raf), r in zip(cases, per_rank):
            _check_parity(r, kind, raf, world_size)
