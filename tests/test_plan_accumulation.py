"""The planner's gradient accumulation choice (``plan_to_budget(grad_accum=M)``,
``--grad-accum M``): per unit, unsharded or sharded accumulation from memory and
bandwidth, with both costs. No processes: the model lives on the meta device."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_offload_budget import _tiny_lm  # the same four-block model

from fsdp_compose import MixedPrecisionPolicy
from fsdp_compose.plan import CostModel, plan_to_budget

W = 4

# One candidate: W = 4, bf16 compute, fp32 reduction, every block resharded.
_ONE: dict[str, Any] = {
    "batch": 1,
    "seq": 4,
    "world_size": W,
    "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "policy": lambda m, fqn: fqn.startswith("blocks."),
    "groups": (1,),
    "depths": (1,),
    "keeps": (0,),
    "activation_checkpointing": False,
}


def test_one_micro_batch_is_unchanged() -> None:
    model = _tiny_lm()
    default = plan_to_budget(model, 10**9, **_ONE)
    one = plan_to_budget(model, 10**9, grad_accum=1, **_ONE)
    assert one.table() == default.table() and one.to_dict() == default.to_dict()
    assert one.accumulation == () and "accumulation" not in one.to_dict()
    assert one.peak_bytes == one.estimate.peak_bytes_per_rank
    assert "gradient accumulation" not in one.table()
    assert one.plan is not None and {u.accumulation for u in one.plan.units} == {"unsharded"}
    assert all("accumulation" not in u for u in one.to_dict()["plan"]["units"])


def test_costs_match_the_formulas() -> None:
    m = 8
    result = plan_to_budget(_tiny_lm(), 10**9, grad_accum=m, **_ONE)
    acc = {a.name: a for a in result.accumulation}
    # A block: Linear(32, 32), N = 32 * 32 + 32 = 1056 (divisible by W), r = a = 4 (fp32).
    n, r = 1056, 4
    block = acc["blocks.2"]
    assert block.held_unsharded == n * r
    assert block.held_sharded == n // W * max(4, r)
    assert block.sent_unsharded == (W - 1) * n // W * r
    assert block.sent_sharded == m * (W - 1) * n // W * r
    assert block.reduce_scatters == (1, m)
    # The root: embedding 16 x 32 (rows padded 16 -> 16) and head 16 x 32.
    root = acc["<root>"]
    assert root.held_unsharded == 2 * 16 * 32 * r
    assert root.held_sharded == 2 * 16 * 32 // W * 4


def test_hsdp_costs() -> None:
    m, replicate = 4, 2
    one = {**_ONE, "world_size": replicate * W, "mesh_shape": (replicate, W)}
    result = plan_to_budget(_tiny_lm(), 10**9, grad_accum=m, **one)
    block = {a.name: a for a in result.accumulation}["blocks.0"]
    n, r = 1056, 4
    replica = 2 * (replicate - 1) / replicate * n / W
    assert block.sent_unsharded == round((W - 1) * n / W * r + replica * r)
    assert block.sent_sharded == round(m * (W - 1) * n / W * r + replica * 4)


def test_ample_memory_keeps_unsharded_fewer_bytes() -> None:
    result = plan_to_budget(_tiny_lm(), 10**9, grad_accum=8, **_ONE)
    assert result.fits
    assert {a.mode for a in result.accumulation} == {"unsharded"}
    assert all(a.sent_unsharded < a.sent_sharded for a in result.accumulation)
    assert all("fewer bytes sent" in a.reason for a in result.accumulation)
    # the held bytes count towards the peak
    held = sum(a.held_unsharded for a in result.accumulation)
    assert result.peak_bytes == result.estimate.peak_bytes_per_rank + held
    text = result.table()
    assert "gradient accumulation over 8 micro-batches: 0 of 5 units sharded" in text
    assert "held unsharded" in text and "sent sharded" in text
    d = result.to_dict()
    assert d["grad_accum"] == 8 and d["accumulation"][0]["mode"] == "unsharded"


def test_unsharded_does_not_fit_so_sharded_is_chosen() -> None:
    model = _tiny_lm()
    ample = plan_to_budget(model, 10**9, grad_accum=8, **_ONE)
    base = ample.estimate.peak_bytes_per_rank
    acc = ample.accumulation
    all_sharded = sum(a.held_sharded for a in acc)
    all_unsharded = sum(a.held_unsharded for a in acc)
    # Room for everything sharded plus one block's difference: not all can stay unsharded.
    block = {a.name: a for a in acc}["blocks.0"]
    budget = base + all_sharded + (block.held_unsharded - block.held_sharded)
    assert budget < base + all_unsharded
    result = plan_to_budget(model, budget, grad_accum=8, **_ONE)
    assert result.fits and result.peak_bytes <= budget
    modes = [a.mode for a in result.accumulation]
    assert "sharded" in modes and "unsharded" in modes, modes
    sharded = [a for a in result.accumulation if a.mode == "sharded"]
    assert all("does not fit" in a.reason for a in sharded)
    # the plan carries the modes, for auto_wrap (and its dict, for JSON)
    assert result.plan is not None
    assert [u.accumulation for u in result.plan.units] == [
        {a.name: a.mode for a in result.accumulation}[u.name] for u in result.plan.units
    ]
    units = result.to_dict()["plan"]["units"]
    assert [u["accumulation"] for u in units] == [u.accumulation for u in result.plan.units]
    # Without accumulation the same budget fits with room to spare; with nothing
    # but sharded accumulation's memory it does not fit at all.
    assert not plan_to_budget(model, base + all_sharded - 1, grad_accum=8, **_ONE).fits


def test_hidden_communication_chooses_sharded() -> None:
    # A slow rank: each block's backward outlasts a reduce-scatter, fully overlapped.
    slow = CostModel(flop_rate=1e3, bandwidth=25e9, latency=0.0, overlap=1.0)
    result = plan_to_budget(_tiny_lm(), 10**9, grad_accum=8, cost=slow, **_ONE)
    modes = {a.name: a.mode for a in result.accumulation}
    # Every unit whose backward is followed by another's is sharded; the root, last
    # in backward, has nothing to hide under.
    assert modes["<root>"] == "unsharded"
    assert {modes[f"blocks.{i}"] for i in range(4)} == {"sharded"}
    assert all("hide under compute" in a.reason for a in result.accumulation if a.mode == "sharded")
    # No overlap (gloo on a CPU): nothing is hidden.
    gloo = CostModel(flop_rate=1e3, bandwidth=25e9, latency=0.0, overlap=0.0)
    result = plan_to_budget(_tiny_lm(), 10**9, grad_accum=8, cost=gloo, **_ONE)
    assert {a.mode for a in result.accumulation} == {"unsharded"}


def test_bad_grad_accum() -> None:
    with pytest.raises(ValueError, match="micro-batches per step"):
        plan_to_budget(_tiny_lm(), 10**9, grad_accum=0, **_ONE)


def test_cli_grad_accum(capsys: pytest.CaptureFixture[str]) -> None:
    from fsdp_compose.plan.__main__ import main

    assert (
        main(["x:y", "--world-size", "2", "--batch", "1", "--seq", "4", "--grad-accum", "4"]) == 2
    )
    assert "--budget" in capsys.readouterr().err


def test_step_time_counts_every_micro_batch_and_sharded_reduce_scatters() -> None:
    from fsdp_compose.plan._cost import step_cost

    m = 4
    result = plan_to_budget(_tiny_lm(), 10**9, **_ONE)
    est = result.estimate
    units = list(est.units)
    compute = sum(u.flops for u in units)
    latency, bandwidth = 1e-3, 1e6
    serial = CostModel(flop_rate=compute, bandwidth=bandwidth, latency=latency, overlap=0)

    def seconds(nbytes: float) -> float:
        return latency + nbytes / bandwidth if nbytes else 0.0

    gathers = sum(
        seconds(u.all_gather_bytes - u.backward_gather_bytes) + seconds(u.backward_gather_bytes)
        for u in units
    )
    reductions = sum(seconds(u.reduce_bytes) for u in units)
    one = step_cost(est, serial, 1)
    assert step_cost(est, serial, 1, 1, ()) == one  # one micro-batch: as before
    assert one.step_s == pytest.approx(1.0 + gathers + reductions)
    # unsharded accumulation: M micro-batches of compute and all-gathers, one reduction
    unsharded = step_cost(est, serial, 1, m, ())
    assert unsharded.compute_s == pytest.approx(m * 1.0)
    assert unsharded.step_s == pytest.approx(m * (1.0 + gathers) + reductions)
    # a sharded unit adds a reduce-scatter to each micro-batch without sync
    block = next(u for u in units if u.name == "blocks.1")
    scatter = seconds((W - 1) * block.grad_reduce_bytes)
    sharded = step_cost(est, serial, 1, m, {"blocks.1"})
    assert sharded.step_s == pytest.approx(unsharded.step_s + (m - 1) * scatter)
    # fully overlapped on a slow rank, the extra reduce-scatters hide under backward
    slow = CostModel(flop_rate=compute, bandwidth=1e12, latency=0.0, overlap=1.0)
    assert step_cost(est, slow, 1, m, {"blocks.1"}).step_s == pytest.approx(
        step_cost(est, slow, 1, m, ()).step_s
    )


def test_planner_step_time_includes_the_chosen_modes() -> None:
    from fsdp_compose.plan._cost import step_cost

    m = 8
    model = _tiny_lm()
    ample = plan_to_budget(model, 10**9, grad_accum=m, **_ONE)
    acc = ample.accumulation
    block = {a.name: a for a in acc}["blocks.0"]
    base = ample.estimate.peak_bytes_per_rank
    budget = base + sum(a.held_sharded for a in acc) + block.held_unsharded - block.held_sharded
    result = plan_to_budget(model, budget, grad_accum=m, **_ONE)
    assert result.plan is not None
    sharded = {a.name for a in result.accumulation if a.mode == "sharded"}
    assert sharded
    depth = result.plan.prefetch_depth
    assert result.step == step_cost(result.estimate, result.cost, depth, m, sharded)
    # the sharded units' reduce-scatters cost time: slower than all unsharded, which
    # does not fit this budget
    assert result.step_time_s > step_cost(result.estimate, result.cost, depth, m, ()).step_s
    assert f" ({m} micro-batches): compute" in result.table()
    assert "micro-batches): compute" not in plan_to_budget(model, 10**9, **_ONE).table()
