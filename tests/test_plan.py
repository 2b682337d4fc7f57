"""Auto-wrap, the memory/communication estimator, the planner and the CLI
(``fsdp_compose.plan``).

* policies resolve to the expected units (class, class name, parameter count,
  callable, Hugging Face ``_no_split_modules``, tied weights), bad policies fail
  clearly before anything is modified;
* ``auto_wrap`` on the example GPT (a plan with mixed reshard settings,
  activation checkpointing and prefetch depth 2) and on a transformers Llama:
  the same losses and parameters as one process on the global batch (2 ranks);
* the estimator against allocated tensor bytes measured with torch's
  ``MemTracker`` at W = 1, 2 and 4; Muon's owner-step term;
* the planner's plan, applied with ``auto_wrap``, runs within its budget (2 ranks);
* the CLI's errors for bad input (the 70B config's checks: ``test_plan_70b.py``).
"""

from __future__ import annotations

import copy
import json
import os
import sys

import pytest
import torch
from gpt import GPT, Block, GPTConfig, loss_fn
from helpers import (
    gpt_batches,
    local_slice,
    mean_across_ranks,
    rank_world,
    train_side_by_side,
)
from torch import nn

from fsdp_compose import MixedPrecisionPolicy
from fsdp_compose.plan import (
    MemoryEstimate,
    ShardingPlan,
    UnitPlan,
    auto_wrap,
    estimate,
    parse_bytes,
    plan_to_budget,
    resolve_plan,
)

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BENCH = os.path.join(_REPO, "benchmarks")
LLAMA_70B = os.path.join(_BENCH, "configs", "llama3_70b.json")
TINY = {"vocab_size": 97, "block_size": 16, "n_layer": 3, "n_head": 2, "n_embd": 32}


def _meta_gpt(**kw: object) -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(**{**TINY, **kw}))  # type: ignore[arg-type]


def _llama(layers: int = 2) -> nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(cfg)


# ---------------------------------------------------------------------------
# policies (no ranks)
# ---------------------------------------------------------------------------


def _names(plan: ShardingPlan) -> list[str]:
    return [u.name for u in plan.units]


def test_policies_resolve_bottom_up_root_last() -> None:
    model = _meta_gpt()
    blocks = ["blocks.0", "blocks.1", "blocks.2", "<root>"]
    assert _names(resolve_plan(model, {Block})) == blocks
    assert _names(resolve_plan(model, ["Block"])) == blocks
    assert _names(resolve_plan(model, lambda m, fqn: isinstance(m, Block))) == blocks
    # by size: a block holds 12.7k parameters; the list of blocks is the first
    # subtree above 30k once nothing inside it was taken
    assert _names(resolve_plan(model, 30_000)) == ["blocks", "<root>"]
    assert _names(resolve_plan(model, 10_000)) == blocks
    with torch.device("meta"):
        llama = _llama()
    assert _names(resolve_plan(llama)) == ["model.layers.0", "model.layers.1", "<root>"]


def test_policy_leaves_tied_weights_to_the_enclosing_unit() -> None:
    plan = resolve_plan(_meta_gpt(tie_weights=True), ["Block", "Embedding", "Linear"])
    names = [u.name for u in plan.units]
    assert "tok_emb" not in names and "lm_head" not in names
    assert {fqn for fqn, _ in plan.skipped} == {"tok_emb", "lm_head"}
    assert "pos_emb" in names  # not tied: a unit of its own


def test_bad_policies_and_plans_fail_clearly() -> None:
    model = _meta_gpt()
    with pytest.raises(ValueError, match=r"does not contain: \['Blok'\]; it contains"):
        resolve_plan(model, ["Blok"])
    with pytest.raises(ValueError, match="no _no_split_modules"):
        resolve_plan(model)
    with pytest.raises(TypeError, match="not a bool"):
        resolve_plan(model, True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="last unit must be the root"):
        ShardingPlan((UnitPlan(("blocks.0",)),))
    with pytest.raises(ValueError, match="appears in two units"):
        ShardingPlan((UnitPlan(("blocks.0",)), UnitPlan(("blocks.0",)), UnitPlan(("",))))
    bad = ShardingPlan((UnitPlan(("blocks.9",)), UnitPlan(("",))))
    with pytest.raises(ValueError, match=r"does not have: \['blocks.9'\]"):
        auto_wrap(_meta_gpt(), plan=bad)
    with pytest.raises(ValueError, match="holds 8 ranks, not world size 6"):
        estimate(model, batch=1, seq=8, world_size=6, mesh_shape=(2, 4), policy={Block})
    with pytest.raises(ValueError, match="reshard_after_forward=3 is invalid"):
        estimate(model, batch=1, seq=8, world_size=4, policy={Block}, reshard_after_forward=3)
    with pytest.raises(ValueError, match="unknown optimizer"):
        estimate(model, batch=1, seq=8, world_size=2, policy={Block}, optimizer="lion")
    with pytest.raises(ValueError, match="cannot read '80 parsecs'"):
        parse_bytes("80 parsecs")
    assert parse_bytes("1.5GiB") == 3 * 2**29 and parse_bytes("80GB") == 80 * 10**9


def test_comm_bytes_and_sharded_state_closed_form() -> None:
    """fp32, W=4: every block is gathered twice and reduced once, the root
    (kept after forward) gathered once; each sends (W-1)/W of the full bytes."""
    model = _meta_gpt()
    w = 4
    est = estimate(model, batch=2, seq=16, world_size=w, policy={Block})
    root, blocks = est.units[0], est.units[1:]
    frac = (w - 1) / w
    assert all(b.all_gather_bytes == round(frac * b.unsharded_bytes) * 2 for b in blocks)
    assert root.all_gather_bytes == round(frac * root.unsharded_bytes)
    expected = sum(u.all_gather_bytes + round(frac * u.unsharded_bytes) for u in est.units)
    assert est.comm_bytes_per_rank_per_step == expected
    p = sum(x.numel() for x in model.parameters())
    # padded shards: ceil(rows / W) rows per parameter, so slightly above 16 P / W
    state = sum(est.breakdown[k] for k in ("params", "grads", "optimizer_state"))
    assert 16 * p / w <= state <= 16 * p / w * 1.02
    assert est.peak_bytes_per_rank == sum(est.breakdown.values())
    # HSDP (2 replicas x 2 shards): half the shard traffic, plus the replica all-reduce
    hsdp = estimate(model, batch=2, seq=16, mesh_shape=(2, 2), policy={Block})
    assert hsdp.breakdown["params"] > est.breakdown["params"]
    # bf16 compute halves the gathered bytes
    bf16 = estimate(
        model,
        batch=2,
        seq=16,
        world_size=w,
        policy={Block},
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
    )
    assert bf16.units[1].unsharded_bytes * 2 == blocks[0].unsharded_bytes


# ---------------------------------------------------------------------------
# auto_wrap: parity with one process (2 ranks)
# ---------------------------------------------------------------------------


def _auto_wrap_gpt_job() -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(**TINY)  # type: ignore[arg-type]
    ref = GPT(cfg)
    model = copy.deepcopy(ref)
    plan = ShardingPlan(
        (
            UnitPlan(("blocks.0",), True, True),
            UnitPlan(("blocks.1", "blocks.2"), False, False),
            UnitPlan(("",)),
        ),
        prefetch_depth=2,
    )
    units = auto_wrap(model, plan=plan)
    parity = train_side_by_side(model, ref, 3, gpt_batches(cfg), loss_fn)
    return {
        "units": [u._fsdp_state().unit.name for u in units],
        "loss_diffs": parity["loss_diffs"],
        "param_diff": parity["param_diff"],
        "depth": model._fsdp_state().scheduler.settings.forward_depth,
    }


def _auto_wrap_llama_job() -> dict:
    from train_hf import make_batch as hf_batch

    rank, world = rank_world()
    torch.manual_seed(0)
    ref = _llama()
    model = copy.deepcopy(ref)
    units = auto_wrap(model)  # the model's _no_split_modules: LlamaDecoderLayer
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    diffs = []
    for step in range(2):
        batch = hf_batch(2 * world, step)
        ref_loss = ref(**batch, use_cache=False).loss
        ref_loss.backward()
        local = {k: local_slice(v, rank, world) for k, v in batch.items()}
        loss = model(**local, use_cache=False).loss
        loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        diffs.append(abs(mean_across_ranks(loss.item()) - ref_loss.item()))
    names = [type(u).__name__ for u in units]  # FSDP<orig class>
    return {"units": names, "loss_diffs": diffs}


def test_auto_wrap_gpt_plan_parity() -> None:
    from dist_utils import run_distributed

    for r in run_distributed(_auto_wrap_gpt_job, 2):
        # one FSDPModule per annotated module; blocks.1 and blocks.2 share a unit
        assert r["units"] == ["blocks.0", "blocks.1, blocks.2", "blocks.1, blocks.2", "root"], r[
            "units"
        ]
        assert max(r["loss_diffs"]) <= 1e-5, r["loss_diffs"]
        assert r["param_diff"] <= 1e-4, r["param_diff"]
        assert r["depth"] == 2


def test_auto_wrap_hf_llama_parity() -> None:
    pytest.importorskip("transformers")
    from dist_utils import run_distributed

    for r in run_distributed(_auto_wrap_llama_job, 2, timeout=240):
        assert r["units"] == ["FSDPLlamaDecoderLayer"] * 2 + ["FSDPLlamaForCausalLM"], r["units"]
        assert max(r["loss_diffs"]) <= 1e-5, r["loss_diffs"]


# ---------------------------------------------------------------------------
# estimator accuracy against measured peaks; planner in a real run
# ---------------------------------------------------------------------------


def _measure_job(case: dict, plan: ShardingPlan | None = None) -> dict:
    if _BENCH not in sys.path:
        sys.path.insert(0, _BENCH)
    import estimator_accuracy

    return estimator_accuracy.measure_rank(case, "test", plan=plan)


def _predict(case: dict) -> MemoryEstimate:
    if _BENCH not in sys.path:
        sys.path.insert(0, _BENCH)
    import estimator_accuracy

    return estimator_accuracy.predict(estimator_accuracy.Case(**case), "test")


@pytest.mark.parametrize(
    "world, case",
    [
        (1, {"model": "gpt", "world_size": 1, "batch": 4, "seq": 128}),
        (2, {"model": "tied", "world_size": 2, "reshard": False, "batch": 4, "seq": 128}),
        (4, {"model": "gpt", "world_size": 4, "bf16": True, "batch": 4, "seq": 64}),
    ],
    ids=["gpt-W1", "tied-W2-noreshard", "gpt-W4-bf16"],
)
def test_estimate_within_10_percent_of_measured_peak(world: int, case: dict) -> None:
    from dist_utils import run_distributed

    est = _predict(case)
    predicted = est.peak_bytes_per_rank
    ranks = run_distributed(_measure_job, world, case, timeout=240)
    measured = max(r["measured"] for r in ranks)
    assert 0.9 <= measured / predicted <= 1.1, (measured / 2**20, predicted / 2**20)
    # bytes sent per step, from the sizes of the collectives each rank issued
    for r in ranks:
        assert abs(r["sent"] - est.comm_bytes_per_rank_per_step) <= 0.01 * max(1, r["sent"]), (
            r["sent"],
            est.comm_bytes_per_rank_per_step,
        )


def test_cost_model_overlap() -> None:
    """With ``overlap=1`` prefetching hides the all-gathers behind compute; with
    ``overlap=0`` communication takes the compute's time whatever the schedule, so
    the step is compute plus every collective and prefetching gains nothing."""
    from fsdp_compose.plan import CostModel
    from fsdp_compose.plan._planner import step_time

    model = _meta_gpt()
    est = {
        d: estimate(
            model,
            batch=2,
            seq=16,
            world_size=4,
            plan=resolve_plan(model, [Block], prefetch_depth=d),
        )
        for d in (0, 1)
    }
    compute = sum(u.flops for u in est[0].units)
    flop_rate = compute / 1.0  # one second of compute per step
    nbytes = est[0].comm_bytes_per_rank_per_step
    collectives = sum(
        (u.all_gather_bytes > u.backward_gather_bytes)
        + (u.backward_gather_bytes > 0)
        + (u.reduce_bytes > 0)
        for u in est[0].units
    )
    latency = 1e-3
    full = CostModel(flop_rate=flop_rate, bandwidth=nbytes / 0.5, latency=latency)
    serial = CostModel(flop_rate=flop_rate, bandwidth=nbytes / 0.5, latency=latency, overlap=0)
    comm = 0.5 + collectives * latency
    step = {d: step_time(est[d], full, d)[0] for d in (0, 1)}
    assert step[1] < step[0] < 1.0 + comm  # prefetch overlaps, depth 0 overlaps reductions
    for d in (0, 1):
        assert step_time(est[d], serial, d)[0] == pytest.approx(1.0 + comm)
        half = step_time(est[d], CostModel(flop_rate, nbytes / 0.5, latency, 0.5), d)[0]
        assert half == pytest.approx((step[d] + 1.0 + comm) / 2)
    # one rank communicates nothing, but recompute still costs its forward again
    one = {
        ck: estimate(
            model, batch=2, seq=16, world_size=1, plan=resolve_plan(model, [Block], checkpoint=ck)
        )
        for ck in (False, True)
    }
    assert step_time(one[False], full, 1)[0] == pytest.approx(1.0)
    blocks = sum(u.flops for u in one[True].units if u.checkpoint) / compute
    assert step_time(one[True], full, 1)[0] == pytest.approx(1.0 + blocks / 3)
    for bad in (-0.1, 1.5, float("nan"), "1"):
        with pytest.raises(ValueError, match="overlap"):
            CostModel(overlap=bad)  # type: ignore[arg-type]


def test_planned_run_fits_its_budget() -> None:
    from dist_utils import run_distributed

    if _BENCH not in sys.path:
        sys.path.insert(0, _BENCH)
    import estimator_accuracy

    case = {"model": "gpt", "world_size": 2, "batch": 4, "seq": 128}
    model = estimator_accuracy.build_meta("gpt", "test")
    loose = plan_to_budget(model, 1 << 40, batch=4, seq=128, world_size=2, policy=["Block"])
    tight = plan_to_budget(model, 1, batch=4, seq=128, world_size=2, policy=["Block"])
    assert loose.fits and not tight.fits
    assert "more than the budget" in tight.table() and tight.shortfall_bytes > 0
    smallest, largest = tight.estimate.peak_bytes_per_rank, loose.estimate.peak_bytes_per_rank
    budget = (smallest + largest) // 2
    result = plan_to_budget(model, budget, batch=4, seq=128, world_size=2, policy=["Block"])
    assert result.fits and result.estimate.peak_bytes_per_rank <= budget
    ranks = run_distributed(_measure_job, 2, case, result.plan, timeout=240)
    measured = max(r["measured"] for r in ranks)
    assert measured <= budget, (measured / 2**20, budget / 2**20, result.table())
    # the bytes each rank sent, from the sizes of the collectives it issued
    predicted_sent = result.estimate.comm_bytes_per_rank_per_step
    for r in ranks:
        assert abs(r["sent"] / predicted_sent - 1) < 0.01, (r["sent"], predicted_sent)


def test_headroom_holds_the_plan_below_the_budget() -> None:
    """``headroom`` leaves that fraction of the budget free: the plan chosen for a
    budget with headroom h is the one chosen for (1 - h) of it, and a bad value is
    refused."""
    if _BENCH not in sys.path:
        sys.path.insert(0, _BENCH)
    import estimator_accuracy

    model = estimator_accuracy.build_meta("gpt", "test")
    kwargs = {"batch": 4, "seq": 128, "world_size": 2, "policy": ["Block"]}
    loose = plan_to_budget(model, 1 << 40, **kwargs)
    budget = loose.estimate.peak_bytes_per_rank  # the fastest plan just fits
    plain = plan_to_budget(model, budget, **kwargs)
    kept = plan_to_budget(model, budget, headroom=0.2, **kwargs)
    assert plain.fits and kept.fits
    assert kept.estimate.peak_bytes_per_rank <= 0.8 * budget
    assert kept.estimate.peak_bytes_per_rank < plain.estimate.peak_bytes_per_rank
    same = plan_to_budget(model, int(budget * 0.8), **kwargs)
    assert same.estimate.peak_bytes_per_rank == kept.estimate.peak_bytes_per_rank
    with pytest.raises(ValueError, match="headroom"):
        plan_to_budget(model, budget, headroom=1.0, **kwargs)


def test_cpu_headroom_is_larger_for_checkpointed_plans() -> None:
    """On CPU the default headroom is 0.13, and 0.18 for a plan that checkpoints
    (glibc's heap grows more over the steps when recompute interleaves with the
    gradients): a budget the smallest checkpointed plan fits with 0.13 but not 0.18
    fits nothing by default, and the report names the headroom."""
    if _BENCH not in sys.path:
        sys.path.insert(0, _BENCH)
    import estimator_accuracy

    model = estimator_accuracy.build_meta("gpt", "test")
    kwargs = {"batch": 4, "seq": 128, "world_size": 2, "policy": ["Block"], "device": "cpu"}
    smallest = {
        ck: estimate(
            model, plan=resolve_plan(model, ["Block"], checkpoint=ck, prefetch_depth=0), **kwargs
        ).peak_bytes_per_rank
        for ck in (False, True)
    }
    budget = int(smallest[True] / 0.85)  # 0.82 of it < the checkpointed plan <= 0.87 of it
    assert smallest[False] > 0.87 * budget  # no plan without checkpointing fits either way
    default = plan_to_budget(model, budget, **kwargs)
    assert not default.fits and default.headroom == 0.18
    assert default.budget_bytes == int(budget * (1 - 0.18)) and default.requested_bytes == budget
    assert "less the headroom of 0.18" in default.table()
    uniform = plan_to_budget(model, budget, headroom=0.13, **kwargs)
    assert uniform.fits and uniform.choice["checkpoint"] and uniform.headroom == 0.13
    loose = plan_to_budget(model, 1 << 40, activation_checkpointing=False, **kwargs)
    assert loose.fits and loose.headroom == 0.13
    on_cuda = plan_to_budget(model, budget, **{**kwargs, "device": "cuda"})
    assert on_cuda.headroom == 0.0 and on_cuda.budget_bytes == budget


# ---------------------------------------------------------------------------
# the command line, at scale
# ---------------------------------------------------------------------------


def _cli_in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    from fsdp_compose.plan.__main__ import main

    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse rejects bad option values itself
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.err + captured.out


def test_cli_bad_input(tmp_path: os.PathLike[str], capsys: pytest.CaptureFixture[str]) -> None:
    not_model = os.path.join(tmp_path, "tokenizer.json")
    with open(not_model, "w") as f:
        json.dump({"vocab": {}}, f)
    code, err = _cli_in_process(
        capsys, not_model, "--world-size", "8", "--batch", "1", "--seq", "8"
    )
    assert code == 2 and "is not a model config" in err and "Traceback" not in err, err
    code, err = _cli_in_process(
        capsys, LLAMA_70B, "--world-size", "6", "--mesh-shape", "2,4", "--batch", "1", "--seq", "8"
    )
    assert code == 2 and "holds 8 ranks, not world size 6" in err, err
    code, err = _cli_in_process(
        capsys, LLAMA_70B, "--world-size", "8", "--batch", "1", "--seq", "8", "--budget", "lots"
    )
    assert code == 2 and "cannot read 'lots' as a memory size" in err, err
    code, err = _cli_in_process(
        capsys, LLAMA_70B, "--world-size", "8", "--batch", "1", "--seq", "8", "--budget", "80GiB",
        "--headroom", "1.5",
    )  # fmt: skip
    assert code == 2 and "headroom is a fraction of the budget" in err, err
    code, err = _cli_in_process(
        capsys, "no.such.module:build", "--world-size", "8", "--batch", "1", "--seq", "8"
    )
    assert code == 2 and "cannot import the factory" in err, err
    small = os.path.join(tmp_path, "config.json")
    with open(small, "w") as f:
        json.dump(
            {
                "model_type": "llama",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "vocab_size": 64,
            },
            f,
        )
    code, err = _cli_in_process(
        capsys, str(tmp_path), "--world-size", "8", "--batch", "1", "--seq", "8", "--policy", "Blok"
    )
    assert code == 2 and "does not contain: ['Blok']" in err, err
    # a budget nothing fits: exit 1 and the report, not an error
    code, out = _cli_in_process(
        capsys, str(tmp_path), "--world-size", "2", "--batch", "1", "--seq", "8", "--budget", "1KiB"
    )
    assert code == 1 and "DOES NOT FIT" in out and "more than the budget" in out, out


def test_muon_owner_step_can_be_the_peak() -> None:
    from fsdp_compose.whole_matrix._exchange import ROUND_NUMEL

    # a wide tied vocabulary, a tiny batch, bfloat16 compute and reduction: the
    # owner's full embedding (with Newton-Schulz temporaries) outweighs the units
    cfg = GPTConfig(
        vocab_size=32768, block_size=16, n_layer=1, n_head=2, n_embd=128, tie_weights=True
    )
    with torch.device("meta"):
        model = GPT(cfg)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    kw = {"batch": 1, "seq": 8, "world_size": 4, "policy": [Block], "mp_policy": bf16}
    est = estimate(model, optimizer="muon", **kw)
    m, n = 128, 32768
    owner = 2 * (10 * max(ROUND_NUMEL, m * n) + 3 * m * m + 2 * m * n)
    assert est.peak_at == "optimizer step (Muon owner)"
    assert est.breakdown["unsharded"] == owner
    assert est.peak_bytes_per_rank == sum(est.breakdown.values())
    assert estimate(model, **kw).peak_at != "optimizer step (Muon owner)"  # AdamW
