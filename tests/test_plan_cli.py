"""The planner's command line explains itself: adaptive parameter counts, the
budget in the units given and in GiB, the cost model with its source, why this
plan and the runner-up, valid JSON (nulls, no NaN); bad input exits 2 without a
traceback. Also sizes and the attention FLOPs of the profile."""

from __future__ import annotations

import json
import os

import pytest
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
