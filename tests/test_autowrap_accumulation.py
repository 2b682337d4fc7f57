"""The planner's accumulation modes applied by ``auto_wrap(model, plan=...)``: a
unit the plan marks ``"sharded"`` accumulates sharded, the others unsharded, with
the same gradients as the model wrapped by hand in the same modes (2 gloo ranks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from helpers import collective_log, rank_world
from torch.distributed.device_mesh import init_device_mesh

from fsdp_compose import MixedPrecisionPolicy, fully_shard
from fsdp_compose.plan import CostModel, ShardingPlan, UnitPlan, auto_wrap, plan_to_budget

BF16 = torch.bfloat16
MICRO = 4  # micro-batches per step
MP = MixedPrecisionPolicy(param_dtype=BF16)


class _LM(nn.Module):
    """Token ids -> embedding -> four Linear(32, 32) blocks -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.head = nn.Linear(32, 16, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def _plan() -> ShardingPlan:
    """The planner's plan at W = 2 over ``MICRO`` micro-batches on a slow rank: every
    block's extra reduce-scatters hide under the next block's backward, so the blocks
    accumulate sharded; the root, last in backward, stays unsharded."""
    with torch.device("meta"):
        model = _LM()
    slow = CostModel(flop_rate=1e3, bandwidth=25e9, latency=0.0, overlap=1.0)
    result = plan_to_budget(
        model,
        10**9,
        batch=1,
        seq=4,
        world_size=2,
        mp_policy=MP,
        policy=lambda m, fqn: fqn.startswith("blocks."),
        groups=(1,),
        depths=(1,),
        keeps=(0,),
        activation_checkpointing=False,
        device="cpu",
        cost=slow,
        grad_accum=MICRO,
    )
    assert result.fits and result.plan is not None
    return result.plan


def _batch(rank: int, micro: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * micro + rank)
    return torch.randint(0, 16, (2, 4), generator=gen)


def _by_hand(mesh: Any, sharded: set[str]) -> nn.Module:
    """The same units as the plan, wrapped with ``fully_shard`` and the modes set."""
    torch.manual_seed(0)
    model = _LM()
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh, mp_policy=MP)
        if f"blocks.{i}" in sharded:
            block.set_gradient_accumulation("sharded", recurse=False)
    fully_shard(model, mesh=mesh, mp_policy=MP)
    return model


def _step(model: nn.Module, rank: int) -> dict[str, tuple[bool, bool]]:
    """``MICRO`` micro-batches, sync on the last; after the first no-sync backward,
    per parameter: (holds an unsharded gradient, holds a partial shard)."""
    seen: dict[str, tuple[bool, bool]] = {}
    for micro in range(MICRO):
        model.set_requires_gradient_sync(micro == MICRO - 1)
        model(_batch(rank, micro)).float().pow(2).mean().backward()
        if micro == 0:
            names = {p: n for n, p in model.named_parameters()}
            pending = model.get_pending_gradients()
            seen = {names[p]: (u is not None, s is not None) for p, (u, s) in pending.items()}
    return seen


def _job(plan: ShardingPlan) -> dict[str, Any]:
    rank, world = rank_world()
    mesh = init_device_mesh("cpu", (world,))
    sharded = {u.name for u in plan.units if u.accumulation == "sharded"}
    out: dict[str, Any] = {}
    for name in ("auto_wrap", "by hand"):
        if name == "auto_wrap":
            torch.manual_seed(0)
            model = _LM()
            auto_wrap(model, plan=plan, mesh=mesh, mp_policy=MP)
        else:
            model = _by_hand(mesh, sharded)
        with collective_log(model) as log:
            pending = _step(model, rank)
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        rs = {label: n for (kind, label), n in log.counts().items() if kind == "reduce_scatter"}
        out[name] = (pending, grads, rs)
    return out


def test_auto_wrap_applies_the_plans_accumulation_modes() -> None:
    from dist_utils import run_distributed

    plan = _plan()
    modes = {u.name: u.accumulation for u in plan.units}
    assert modes == {
        "blocks.0": "sharded",
        "blocks.1": "sharded",
        "blocks.2": "sharded",
        "blocks.3": "sharded",
        "<root>": "unsharded",
    }, modes
    for r in run_distributed(_job, 2, plan, timeout=300):
        pending, grads, rs = r["auto_wrap"]
        # after a no-sync backward: the blocks hold fp32 shards, the root unsharded grads
        for name, held in pending.items():
            expected = (False, True) if name.startswith("blocks.") else (True, False)
            assert held == expected, (name, held)
        assert len(pending) == 2 * 4 + 2
        # a reduce-scatter per micro-batch for the sharded units, one per step for the root
        assert rs == {**{f"blocks.{i}": MICRO for i in range(4)}, "root": 1}, rs
        by_hand = r["by hand"]
        assert pending == by_hand[0] and rs == by_hand[2]
        assert all(torch.equal(grads[n], by_hand[1][n]) for n in grads)


def test_default_plans_leave_accumulation_unsharded() -> None:
    from dist_utils import run_distributed

    units = tuple(UnitPlan((f"blocks.{i}",)) for i in range(4)) + (UnitPlan(("",)),)
    for r in run_distributed(_job, 2, ShardingPlan(units), timeout=300):
        pending, grads, rs = r["auto_wrap"]
        assert set(pending.values()) == {(True, False)}, pending
        assert set(rs.values()) == {1}, rs
        assert all(torch.equal(grads[n], r["by hand"][1][n]) for n in grads)


def test_unit_plan_rejects_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match='"unsharded" or "sharded"'):
        UnitPlan(("blocks.0",), accumulation="fp32")
