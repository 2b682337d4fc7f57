"""Gradient accumulation of CPU-offloaded units in the planner: where the bytes held
between micro-batches live (the device, in both modes, as the runtime keeps them),
what crosses between host and device per micro-batch, and a gloo job checking the
runtime's accumulators against the planner's held bytes.

[Note: choosing the accumulation mode] in ``fsdp_compose/plan/_accumulation.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from helpers import rank_world
from test_offload_budget import _tiny_lm  # the same four-block model
from test_plan_accumulation import _ONE, W
from torch.distributed.device_mesh import init_device_mesh

from fsdp_compose import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from fsdp_compose.plan import CostModel, PlanResult, plan_to_budget

M = 8  # micro-batches per step
# A slow rank, fully overlapped: every block's extra reduce-scatters hide (all sharded
# but the root); the same rank without overlap keeps every unit unsharded.
_SLOW = CostModel(flop_rate=1e3, bandwidth=25e9, latency=0.0, overlap=1.0)
_SLOW_SERIAL = CostModel(flop_rate=1e3, bandwidth=25e9, latency=0.0, overlap=0.0)


def _plan(offload: OffloadPolicy, budget: int = 10**9, **kwargs: Any) -> PlanResult:
    return plan_to_budget(_tiny_lm(), budget, offload_policy=offload, **{**_ONE, **kwargs})


def _held(result: PlanResult) -> dict[str, int]:
    return {a.name: a.held for a in result.accumulation}


@pytest.mark.parametrize("cost", [_SLOW, _SLOW_SERIAL], ids=["sharded", "unsharded"])
def test_offloaded_units_hold_on_the_device(cost: CostModel) -> None:
    on_device = _plan(OffloadPolicy(), grad_accum=M, cost=cost)
    offloaded = _plan(CPUOffloadPolicy(), grad_accum=M, cost=cost)
    one = _plan(CPUOffloadPolicy(), grad_accum=1, cost=cost)
    modes = {a.mode for a in offloaded.accumulation if a.name != "<root>"}
    assert modes == {"sharded" if cost is _SLOW else "unsharded"}
    # The same choice and held bytes whether the unit is offloaded or not ...
    assert offloaded.accumulation == on_device.accumulation
    # ... counted in the device peak on top of the offloaded estimate ...
    held = sum(_held(offloaded).values())
    assert held > 0
    assert offloaded.peak_bytes == offloaded.estimate.peak_bytes_per_rank + held
    assert offloaded.estimate.peak_bytes_per_rank < on_device.estimate.peak_bytes_per_rank
    # ... and nothing on the host: the offloaded state is that of one micro-batch per step.
    assert offloaded.host_bytes == one.host_bytes > 0
    assert on_device.host_bytes == 0


def test_offloaded_copies_per_micro_batch() -> None:
    sharded = _plan(CPUOffloadPolicy(), grad_accum=M, cost=_SLOW)
    unsharded = _plan(CPUOffloadPolicy(), grad_accum=M, cost=_SLOW_SERIAL)
    one = _plan(CPUOffloadPolicy(), grad_accum=1, cost=_SLOW)
    for result in (sharded, unsharded):
        assert result.step is not None and one.step is not None
        # shards go to the device before every micro-batch's gathers; the reduced
        # gradients come back once per step, at the synchronizing hand-over, in both modes
        assert result.step.host_to_device_bytes == M * one.step.host_to_device_bytes > 0
        assert result.step.device_to_host_bytes == one.step.device_to_host_bytes > 0
        text = result.table()
        assert "offloaded units hold theirs on the device too (both modes)" in text, text
    on_device = _plan(OffloadPolicy(), grad_accum=M, cost=_SLOW)
    assert "offloaded units hold" not in on_device.table()


def test_offloaded_sharded_step_time_adds_only_reduce_scatters() -> None:
    from fsdp_compose.plan._cost import step_cost

    result = _plan(CPUOffloadPolicy(), grad_accum=1)
    est = result.estimate
    units = list(est.units)
    latency, bandwidth = 1e-3, 1e6
    serial = CostModel(
        flop_rate=sum(u.flops for u in units), bandwidth=bandwidth, latency=latency, overlap=0
    )
    block = next(u for u in units if u.name == "blocks.1")
    scatter = latency + (W - 1) * block.grad_reduce_bytes / bandwidth
    unsharded = step_cost(est, serial, 1, M, ())
    sharded = step_cost(est, serial, 1, M, {"blocks.1"})
    # Serially, sharding an offloaded unit adds its M - 1 reduce-scatters and no copy:
    # the fp32 sum stays on the device between micro-batches.
    assert sharded.step_s == pytest.approx(unsharded.step_s + (M - 1) * scatter)
    assert sharded.host_copy_s == unsharded.host_copy_s
    assert sharded.host_optimizer_s == unsharded.host_optimizer_s > 0


def test_offloaded_sharded_accumulation_is_device_memory() -> None:
    """Offloading leaves the accumulators on the device: a budget with room for every
    sharded sum fits, one byte less does not, offloaded or not; with room for the
    unsharded gradients too, the offloaded units go back to unsharded."""
    # the held bytes of units on the device: the offloaded ones must hold as much
    on_device = _plan(OffloadPolicy(), grad_accum=M).accumulation
    all_sharded = sum(a.held_sharded for a in on_device)
    all_unsharded = sum(a.held_unsharded for a in on_device)
    for offload in (OffloadPolicy(), CPUOffloadPolicy()):
        base = _plan(offload, grad_accum=M).estimate.peak_bytes_per_rank
        tight = _plan(offload, base + all_sharded, grad_accum=M)
        assert tight.fits and {a.mode for a in tight.accumulation} == {"sharded"}
        assert tight.peak_bytes == base + all_sharded
        assert not _plan(offload, base + all_sharded - 1, grad_accum=M).fits
        roomy = _plan(offload, base + all_unsharded, grad_accum=M)
        assert roomy.fits and {a.mode for a in roomy.accumulation} == {"unsharded"}


def test_offload_by_budget_frees_states_not_accumulators() -> None:
    """A budget that unsharded accumulation on the device exceeds: sharding every unit
    is not enough either, so ``offload_by_budget`` offloads units; the memory it frees
    is their states (not their accumulators, which stay on the device), and the
    accumulation chosen after offloading is counted in the same device peak."""
    plain = _plan(OffloadPolicy(), grad_accum=M)
    base = plain.estimate.peak_bytes_per_rank
    all_sharded = sum(a.held_sharded for a in plain.accumulation)
    budget = base + all_sharded - 1  # sharding everything misses by a byte
    assert not _plan(OffloadPolicy(), budget, grad_accum=M).fits
    result = _plan(OffloadPolicy(), budget, grad_accum=M, offload_by_budget=True)
    assert result.fits and result.plan is not None, result.table()
    offloaded = [u.name for u in result.plan.units if u.offload]
    assert offloaded
    units = {u.name: u for u in plain.estimate.units}
    freed = sum(
        units[n].sharded_bytes + units[n].grad_bytes + units[n].optimizer_bytes for n in offloaded
    )
    assert result.estimate.peak_bytes_per_rank == base - freed
    # the modes chosen after offloading, at the bytes units on the device hold
    on_device = {a.name: a for a in plain.accumulation}
    held = sum(
        on_device[a.name].held_sharded if a.mode == "sharded" else on_device[a.name].held_unsharded
        for a in result.accumulation
    )
    assert result.peak_bytes == base - freed + held <= budget
    assert result.host_bytes == freed


# --- the runtime: what an offloaded unit holds between micro-batches ----------------

DIM = 32


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(3) for m in (nn.Linear(DIM, DIM), nn.Tanh())))


_MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _accumulators_job() -> dict[str, Any]:
    """Per mode, after each of 3 backwards without sync: the pending gradients'
    (devices, dtypes, bytes per unit) and whether any sharded ``.grad`` (the
    offloaded, host-side one) exists; then after a synchronizing backward."""
    rank, world = rank_world()
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for mode in ("unsharded", "sharded"):
        model = _model()
        for i in (0, 2, 4):
            fully_shard(model[i], mesh=mesh, mp_policy=_MP, offload_policy=CPUOffloadPolicy())
        fully_shard(model, mesh=mesh, mp_policy=_MP, offload_policy=CPUOffloadPolicy())
        model.set_gradient_accumulation(mode)
        seen = []
        for micro in range(4):
            model.set_requires_gradient_sync(micro == 3)
            x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(10 * micro + rank))
            model(x.to(torch.bfloat16)).float().mean().backward()
            pending = model.get_pending_gradients()
            kept = [(p, t) for p, pair in pending.items() for t in pair if t is not None]
            held: dict[str, int] = {}
            for i in (0, 2, 4):
                mine = set(model[i].parameters())
                nbytes = sum(t.numel() * t.element_size() for p, t in kept if p in mine)
                if nbytes:
                    held[str(i)] = nbytes
            grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
            seen.append(
                {
                    "devices": sorted({t.device.type for _, t in kept}),
                    "dtypes": sorted({str(t.dtype) for _, t in kept}),
                    "held": held,
                    "grads": sorted({g.device.type for g in grads}),
                    "offloaded": sorted({p.to_local().device.type for p in model.parameters()}),
                }
            )
        out[mode] = seen
    return out


def test_runtime_accumulators_match_the_plan() -> None:
    from dist_utils import run_distributed

    world = 2
    with torch.device("meta"):
        meta = _model()
    results = {}
    for cost, mode in ((_SLOW_SERIAL, "unsharded"), (_SLOW, "sharded")):
        plan = plan_to_budget(
            meta,
            10**9,
            batch=1,
            seq=4,
            world_size=world,
            mp_policy=_MP,
            offload_policy=CPUOffloadPolicy(),
            policy=lambda m, fqn: isinstance(m, nn.Linear),
            groups=(1,),
            depths=(1,),
            keeps=(0,),
            activation_checkpointing=False,
            grad_accum=M,
            cost=cost,
            step_fn=lambda m, batch, seq: m(torch.zeros(batch * seq, DIM, device="meta")).sum(),
        )
        acc = {a.name: a for a in plan.accumulation}
        results[mode] = {
            n: (a.held_unsharded if mode == "unsharded" else a.held_sharded)
            for n, a in acc.items()
            if n != "<root>"
        }
    for r in run_distributed(_accumulators_job, world, timeout=300):
        for mode in ("unsharded", "sharded"):
            *between, synced = r[mode]
            for seen in between:
                # on the mesh's device (the accelerator on a GPU mesh), in the dtype of
                # accumulation, the planner's bytes; no gradient on the host yet
                assert seen["devices"] == ["cpu"], seen
                assert seen["dtypes"] == ["torch.float32"], seen
                assert seen["held"] == results[mode], (mode, seen, results[mode])
                assert seen["grads"] == [], seen
            assert synced["held"] == {} and synced["grads"] == ["cpu"], synced
            assert synced["offloaded"] == ["cpu"]
