"""Pipeline parallel x FSDP on 4 ranks (pp=2 x dp=2): ``torch.distributed.pipelining``
schedules driving stages whose modules are fsdp_compose roots.

Every rank trains its stage and, alongside, a one-process copy of the whole GPT on
the global batch; losses, gradients before the first optimizer step and parameters
after a few AdamW steps must match it. Reduce-scatters are counted per step.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig, loss_fn, make_batch
from helpers import collective_log, full
from models import TINY_GPT
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.pipelining import PipelineStage as TorchPipelineStage
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from train_pp import GPTStage, build_stage

import fsdp_compose
from fsdp_compose import fully_shard

TINY = GPTConfig(**{**TINY_GPT, "n_layer": 4})
N_MICRO = 4
MICRO_SIZE = 2
LOSS_TOL, GRAD_TOL, PARAM_TOL = 1e-5, 1e-6, 1e-4  # as in test_parity.py


def _train(stages: list, schedule, modules: list, gpt: GPT, ref: GPT, mesh, steps: int) -> dict:
    """Runs ``steps`` schedule steps next to the one-process reference; returns the
    parity figures and the collectives issued on this rank per step."""
    dp_rank, dp = mesh.get_local_rank("dp"), mesh.size(1)
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_params = dict(ref.named_parameters())
    mine = {id(p) for p in params}
    owned = [(name, p) for name, p in gpt.named_parameters() if id(p) in mine]
    global_batch = dp * N_MICRO * MICRO_SIZE
    is_first = any(s.is_first for s in stages)
    is_last = any(s.is_last for s in stages)
    loss_diffs, counts = [], []
    grad_diff = None
    for step in range(steps):
        x, y = make_batch(TINY, global_batch, step)
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        local = slice(dp_rank * N_MICRO * MICRO_SIZE, (dp_rank + 1) * N_MICRO * MICRO_SIZE)
        losses: list[torch.Tensor] = []
        with collective_log(*modules) as log:
            # contiguous: torch 2.11's PipelineStage checks input strides
            args = (x[local].contiguous(),) if is_first else ()
            kwargs = {"target": y[local].contiguous(), "losses": losses} if is_last else {}
            schedule.step(*args, **kwargs)
        counts.append(dict(log.counts()))
        if step == 0:
            grad_diff = max((full(p.grad) - ref_params[n].grad).abs().max().item() for n, p in owned)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        # Mean over microbatches and dp ranks, on the last stage's ranks only.
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        dist.all_reduce(loss)
        loss_diffs.append(abs(loss.item() / dp - ref_loss.item()))
    param_diff = max((full(p.detach()) - ref_params[n].detach()).abs().max().item() for n, p in owned)
    return {
        "loss_diffs": loss_diffs,
        "grad_diff": grad_diff,
        "param_diff": param_diff,
        "counts": counts,
        "units": sorted(
            m._fsdp_state().unit.name
            for module in modules
            for m in module.modules()
            if isinstance(m, fsdp_compose.FSDPModule) and m._fsdp_state().unit is not None
        ),
        "forwards": [m._fsdp_state().scheduler.step for m in modules],
    }


def _pp_job(schedule_name: str, stage_cls_name: str, steps: int = 3) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh.get_local_rank("pp")
    torch.manual_seed(0)
    ref = GPT(TINY)
    gpt = copy.deepcopy(ref)
    stage_cls = {"fsdp_compose": fsdp_compose.PipelineStage, "torch": TorchPipelineStage}[stage_cls_name]
    if schedule_name == "interleaved":
        # Two stages per rank (4 in all), each its own fully_shard root.
        modules = [build_stage(gpt, s, 4, mesh["dp"]) for s in (pp_rank, pp_rank + 2)]
        stages = [
            stage_cls(m, s, 4, torch.device("cpu"), group=mesh["pp"].get_group())
            for m, s in zip(modules, (pp_rank, pp_rank + 2))
        ]
        schedule = ScheduleInterleaved1F1B(stages, N_MICRO, loss_fn=loss_fn)
    else:
        modules = [build_stage(gpt, pp_rank, 2, mesh["dp"])]
        stages = [stage_cls(modules[0], pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group())]
        schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
        schedule = schedule_cls(stages[0], N_MICRO, loss_fn=loss_fn)
    result = _train(stages, schedule, modules, gpt, ref, mesh, steps)
    result["settings_after"] = [
        (u.options.requires_gradient_sync, u.options.reshard_after_backward)
        for m in modules
        for u in m._fsdp_state().units_in_subtree(True)
    ]
    return result


def _check_parity(results: list[dict]) -> None:
    for r in results:
        assert max(r["loss_diffs"]) <= LOSS_TOL, r["loss_diffs"]
        assert r["grad_diff"] <= GRAD_TOL, r["grad_diff"]
        assert r["param_diff"] <= PARAM_TOL, r["param_diff"]


def _reduce_scatters(counts: dict) -> dict[str, int]:
    return {label: n for (kind, label), n in counts.items() if kind == "reduce_scatter"}


@pytest.mark.slow  # 4-rank jobs on a 2-core machine
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp_dp_parity_one_reduce_scatter_per_step(schedule: str) -> None:
    from dist_utils import run_distributed

    results = run_distributed(_pp_job, 4, schedule, "fsdp_compose", timeout=300)
    _check_parity(results)
    for r in results:
        assert len(r["units"]) == 3  # two blocks and the root (embeddings or head) per stage
        for counts in r["counts"]:
            # Each unit reduces the sum over the 4 microbatches exactly once.
            assert _reduce_scatters(counts) == {u: 1 for u in r["units"]}, counts
        # Settings are back to normal after the step.
        assert all(sync and reshard for sync, reshard in r["settings_after"]), r["settings_after"]


@pytest.mark.slow
def test_pp_dp_interleaved_two_stages_per_rank() -> None:
    from dist_utils import run_distributed

    results = run_distributed(_pp_job, 4, "interleaved", "fsdp_compose", 2, timeout=300)
    _check_parity(results)
    for r in results:
        for counts in r["counts"]:
            assert sum(_reduce_scatters(counts).values()) == len(r["units"]), counts


@pytest.mark.slow
@pytest.mark.skipif(
    not hasattr(TorchFSDPModule, "finalize_backward"),
    reason="torch's PipelineStage finalizes FSDP2 through public methods from torch 2.15 on",
)
def test_torch_pipeline_stage_recognises_units() -> None:
    """torch's own PipelineStage sees fsdp_compose units as FSDP2 modules (they are
    instances of torch's FSDPModule) and ends backward with manual finalization:
    one reduce-scatter per unit and step, at parity."""
    from dist_utils import run_distributed

    results = run_distributed(_pp_job, 4, "gpipe", "torch", 2, timeout=300)
    _check_parity(results)
    for r in results:
        for counts in r["counts"]:
            assert _reduce_scatters(counts) == {u: 1 for u in r["units"]}, counts


def _split_backward_job() -> str:
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh.get_local_rank("pp")
    torch.manual_seed(0)
    module = GPTStage(GPT(TINY), 2 * pp_rank, 2 * pp_rank + 2)
    fully_shard(module, mesh=mesh["dp"])
    stage = fsdp_compose.PipelineStage(module, pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    with pytest.raises(NotImplementedError, match="zero-bubble") as err:
        stage.backward_maybe_with_nosync("input", {})
    return str(err.value)


def test_split_backward_schedules_raise() -> None:
    from dist_utils import run_distributed

    (message, _) = run_distributed(_split_backward_job, 2)
    assert "full backward per microbatch" in message


def _microbatch_backward_prefetch_job() -> list[int]:
    """GPipe's pattern without a pipeline: two forwards, then their two backwards
    (gradient sync only on the last). Returns the backward prefetches per backward."""
    from helpers import local_slice, rank_world

    from fsdp_compose import trace

    rank, world = rank_world()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY_GPT))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    prefetches = []
    for step in range(2):  # the second step has a recorded order to prefetch from
        losses = []
        model.set_requires_gradient_sync(False)
        for micro in range(2):
            x, y = make_batch(TINY, 2 * world, 10 * step + micro)
            losses.append(loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world)))
        for micro, loss in enumerate(losses):
            model.set_requires_gradient_sync(micro == len(losses) - 1)
            with trace.recording(model) as timeline:
                loss.backward()
            if step == 1:
                prefetches.append(sum(e.get("cat") == "prefetch" for e in timeline.events()))
    return prefetches


def test_every_microbatch_backward_prefetches() -> None:
    from dist_utils import run_distributed

    for prefetches in run_distributed(_microbatch_backward_prefetch_job, 2):
        assert prefetches[0] > 0, prefetches
        assert prefetches[1] == prefetches[0], prefetches
