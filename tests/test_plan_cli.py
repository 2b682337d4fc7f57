"""The planner's command line explains itself: adaptive parameter counts, the
budget in the units given and in GiB, the cost model with its source, why this
plan and the runner-up, valid JSON (nulls, no NaN); bad input exits 2 without a
traceback. Also sizes and the attention FLOPs of the profile."""

from __future__ import annotations

import json
import os

import pytest
import torch
from gpt import Block
from test_plan import TINY, _cli_in_process, _meta_gpt

from fsdp_compose.plan import parse_bytes, resolve_plan


def test_parse_bytes_refuses_what_is_not_a_whole_size() -> None:
    from fsdp_compose.plan._units import budget_text, format_count

    for bad in ("1.5", 1.5, "1e-9", "1e999", "inf", "nan", 0, -1, "lots"):
        with pytest.raises(ValueError):
            parse_bytes(bad)  # type: ignore[arg-type]
    assert parse_bytes("1.5KiB") == 1536 and parse_bytes(4096) == 4096
    assert budget_text("80GB") == "80.00 GB (74.51 GiB)" and budget_text("80GiB") == "80.00 GiB"
    assert [format_count(n) for n in (987_654, 4_900_000, 70.55e9, 512)] == [
        "0.99M",
        "4.90M",
        "70.55B",
        "512",
    ]


def test_attention_flops_are_counted() -> None:
    from fsdp_compose.plan._profile import profile_model

    model = _meta_gpt(block_size=256)
    p = sum(x.numel() for x in model.parameters())
    leaves = [u.modules[0] for u in resolve_plan(model, [Block]).units[:-1]]
    seq = 256
    prof = profile_model(model, leaves, batch=1, seq=seq, compute_dtype=None)
    total = sum(m.flops for m in prof.modules.values())
    attention = 12 * TINY["n_layer"] * seq * seq * TINY["n_embd"]  # QK^T and AV, fwd + bwd
    assert total > 6 * p * seq + 0.9 * attention, (total, 6 * p * seq, attention)


def test_cli_output_explains_itself(
    tmp_path: os.PathLike[str], capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    small = _small_llama_config(tmp_path)
    args = [small, "--world-size", "2", "--batch", "1", "--seq", "8"]
    code, out = _cli_in_process(capsys, *args, "--budget", "1GB", "--device", "cpu")
    assert code == 0, out
    assert "K parameters (fp32)" in out or "M parameters (fp32)" in out, out
    assert "1.00 GB (953.67 MiB)" in out, out
    assert "cost model (default for device=cpu (gloo))" in out and "why: " in out, out
    code, out = _cli_in_process(capsys, *args, "--budget", "1GiB", "--flop-rate", "1e12")
    assert "cost model (given: --flop-rate; the rest default for device=cuda" in out, out
    code, out = _cli_in_process(capsys, *args, "--budget", "1GiB", "--json")
    doc = json.loads(out)
    assert doc["config"]["reduce_dtype"] is None and doc["plan"]["cost"]["source"], doc
    code, out = _cli_in_process(capsys, *args, "--budget", "1KiB", "--json")
    assert code == 1
    doc = json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in --json output"))
    assert doc["plan"]["fits"] is False and doc["plan"]["step_time_s"] is None


def _small_llama_config(tmp_path: os.PathLike[str], **over: object) -> str:
    path = os.path.join(tmp_path, "small.json")
    with open(path, "w") as f:
        json.dump(
            {
                "model_type": "llama",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "vocab_size": 64,
                **over,
            },
            f,
        )
    return path


def test_cli_bad_values_exit_2(
    tmp_path: os.PathLike[str], capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    args = ["--world-size", "2", "--batch", "1", "--seq", "8"]
    bad = _small_llama_config(tmp_path, hidden_size=-32)
    code, err = _cli_in_process(capsys, bad, *args)
    assert code == 2 and "Traceback" not in err and "error:" in err, err
    code, err = _cli_in_process(capsys, "tests.models:no_such_thing", *args)
    assert code == 2, err
    code, err = _cli_in_process(capsys, "json:loads", *args)  # a factory that raises
    assert code == 2 and "the factory json:loads raised TypeError" in err, err
    for budget in ("1e999", "1.5", "1e-9"):
        code, err = _cli_in_process(
            capsys, _small_llama_config(tmp_path), *args, "--budget", budget
        )
        assert code == 2 and "Traceback" not in err, (budget, err)


def test_budget_without_a_unit_is_an_error(
    tmp_path: os.PathLike[str], capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    args = [_small_llama_config(tmp_path), "--world-size", "2", "--batch", "1", "--seq", "8"]
    code, err = _cli_in_process(capsys, *args, "--budget", "80")
    assert code == 2 and "'80' has no unit" in err and "GiB" in err and "GB" in err, err
    code, err = _cli_in_process(capsys, *args, "--budget", "80 GiB")
    assert code == 0, err
    code, err = _cli_in_process(capsys, *args, "--budget", "80GiB", "--host-budget", "1GiB")
    assert code == 2 and "--host-budget" in err and "--offload" in err, err


def test_progress_goes_to_stderr_only_on_long_runs(
    tmp_path: os.PathLike[str], capsys: pytest.CaptureFixture[str]
) -> None:
    import io

    from fsdp_compose.plan.__main__ import _Progress

    pytest.importorskip("transformers")
    args = [_small_llama_config(tmp_path), "--world-size", "2", "--batch", "1", "--seq", "8"]
    from fsdp_compose.plan.__main__ import main

    assert main([*args, "--budget", "1GiB"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "plan:" in captured.out  # a short run prints no progress
    stream = io.StringIO()
    progress = _Progress(after=0.0, every=3600.0, stream=stream)
    progress.stage("model profiled")
    for i in range(1, 11):
        progress(i, 10)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("plan: model profiled (") and len(lines) == 2, lines
    assert lines[1].startswith("plan: 10/10 candidates evaluated"), lines


def _two_linears() -> torch.nn.Module:
    """Token ids -> embedding (8 x 4) -> two Linear(4, 4) blocks -> head (4 x 8)."""
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(8, 4)
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4, bias=False) for _ in range(2))
            self.head = torch.nn.Linear(4, 8, bias=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.emb(ids)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    with torch.device("meta"):
        return Tiny()


def test_offload_cost_by_hand() -> None:
    """W = 2, fp32, AdamW. Shards: the root (embedding + head, 64 elements) 32
    elements = 128 B, each block (16 elements) 8 = 32 B. Offload copies the shards
    in before every gather (the root once, it keeps them; each block in forward and
    again in backward): 128 + 2 * 2 * 32 = 256 B; the gradient shards out:
    128 + 2 * 32 = 192 B; the host holds params + grads + 2 AdamW states =
    4 * 192 = 768 B. At 64 B/s of copies and 96 B/s of host optimizer step, with
    no overlap and free collectives: step = compute + 448 / 64 + 768 / 96 = compute + 15 s."""
    from fsdp_compose import CPUOffloadPolicy
    from fsdp_compose.plan import CostModel, estimate, resolve_plan
    from fsdp_compose.plan._cost import step_cost

    model = _two_linears()
    plan = resolve_plan(model, lambda m, fqn: fqn.startswith("blocks."), prefetch_depth=1)
    kw = {"batch": 1, "seq": 4, "world_size": 2, "plan": plan}
    off = estimate(model, offload_policy=CPUOffloadPolicy(), **kw)
    on_device = estimate(model, **kw)
    compute = sum(u.flops for u in off.units)
    cost = CostModel(
        flop_rate=compute, bandwidth=1e30, latency=0.0, overlap=0.0,
        host_bandwidth=64.0, host_optimizer_rate=96.0,
    )  # fmt: skip
    c = step_cost(off, cost, 1)
    assert (c.host_to_device_bytes, c.device_to_host_bytes) == (256, 192)
    assert off.host_bytes_per_rank == 768
    assert c.host_copy_s == pytest.approx(7.0) and c.host_optimizer_s == pytest.approx(8.0)
    assert c.compute_s == pytest.approx(1.0) and c.step_s == pytest.approx(16.0)
    without = step_cost(on_device, cost, 1)
    assert without.step_s == pytest.approx(1.0) and without.host_optimizer_s == 0
    # never faster with offload than the same plan without, over the whole search space
    from fsdp_compose.plan._planner import candidate_plans

    gpu = CostModel()
    for _, p in candidate_plans(plan):
        kw["plan"] = p
        a = step_cost(
            estimate(model, offload_policy=CPUOffloadPolicy(), **kw), gpu, p.prefetch_depth
        )
        b = step_cost(estimate(model, **kw), gpu, p.prefetch_depth)
        assert a.step_s > b.step_s, (p, a, b)


def test_reasons_follow_the_compared_numbers_on_ties() -> None:
    """Two plans tie on step time: the one sending fewer bytes is chosen, and the
    reason says so; a candidate ranked before it (it does not fit) is described
    by what it beats the chosen one on, never as needing more memory when it needs
    less."""
    from fsdp_compose.plan._cost import StepCost
    from fsdp_compose.plan._planner import _explain, _Scored

    def scored(step: float, nbytes: int, peak: int, cap: int = 100, depth: int = 0) -> _Scored:
        choice = {"group": 1, "keep": 0, "checkpoint": False, "prefetch_depth": depth}
        return _Scored(choice, StepCost(step, step, 0.0), nbytes, peak, cap)

    chosen, tied = scored(1.0, 10, 90, depth=1), scored(1.0, 20, 50, depth=2)
    # the fastest overall: as fast, fewer bytes, a lower peak than the chosen one, but
    # over its own (smaller) cap
    fastest = scored(1.0, 5, 80, cap=60)
    reason, runner_up = _explain([chosen, tied], fastest, 3)
    assert "one as fast that sends fewer bytes does not fit (peak 80 B, over 60 B)" in reason
    assert "need more memory" not in reason
    assert "ties on step time with 1 other(s) and sends the fewest bytes" in reason
    assert runner_up is not None and runner_up["versus"] == "as fast, sends 10 B more per step"
    reason, runner_up = _explain([chosen, scored(1.5, 10, 40)], chosen, 2)
    assert reason.endswith("no candidate is predicted faster")
    assert runner_up is not None and runner_up["versus"] == "500.0 ms slower"
    reason, _ = _explain([chosen], scored(0.5, 10, 200), 2)
    assert "faster ones do not fit (the fastest: 500.0 ms, peak 200 B, over 100 B)" in reason
