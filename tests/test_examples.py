"""The examples a newcomer runs first: they run, print no warnings, give a verdict.

* ``torchrun ... examples/train_gpt.py`` (the README's demo) prints no warning;
  ``python examples/train_gpt.py`` without torchrun runs as one process.
* ``examples/train_hf.py --model gpt2`` sets the loss transformers would warn
  about; ``examples/check.py`` (every ``--check``) turns a distance over its
  tolerance, or a NaN, into FAIL and exit status 1.
* ``examples/failure_modes.py``: in debug mode every rank raises the whole
  ``CollectiveMismatchError``, run after run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parent.parent
_EXAMPLES = _ROOT / "examples"
# torch, Python and transformers warnings as they reach stderr
_WARNING = re.compile(r"Warning|warn|\[W\d{4}|^W\d{4}", re.MULTILINE)


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("FSDP_COMPOSE_", "PYTHONWARNINGS"))
    }
    env["PYTHONPATH"] = str(_ROOT)
    env["OMP_NUM_THREADS"] = "1"  # as torchrun sets it (else the launcher says so)
    return subprocess.run(
        [sys.executable, *args],
        cwd=_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )


def test_demo_prints_no_warning() -> None:
    result = _run(
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "examples/train_gpt.py",
        "--steps",
        "2",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step   1 | loss" in result.stdout
    assert not _WARNING.search(result.stderr), result.stderr[-3000:]


def test_without_torchrun_runs_as_one_process() -> None:
    result = _run("examples/train_gpt.py", "--steps", "1", "--batch-size", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "not started by torchrun, so running as one process" in result.stderr
    assert "torchrun --nproc-per-node N examples/train_gpt.py" in result.stderr
    assert "1 ranks" in result.stdout
    assert not _WARNING.search(result.stderr), result.stderr[-3000:]


def test_hf_gpt2_names_its_loss() -> None:
    """transformers derives the loss from the class name and warns for GPT-2 (once per
    rank); the example names the loss it falls back to anyway."""
    pytest.importorskip("transformers")
    from transformers.loss.loss_utils import LOSS_MAPPING

    sys.path.insert(0, str(_EXAMPLES))
    try:
        from train_hf import build_model
    finally:
        sys.path.remove(str(_EXAMPLES))
    model = build_model("gpt2")
    assert model.loss_type in LOSS_MAPPING
    assert model.loss_function is LOSS_MAPPING["ForCausalLM"]


def test_check_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(_EXAMPLES))
    try:
        from check import TOLERANCES, report
    finally:
        sys.path.remove(str(_EXAMPLES))
    good = {name: tol / 2 for name, tol in TOLERANCES["fp32"].items()}
    assert report(good) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "PASS"
    for name in good:
        for bad in (TOLERANCES["fp32"][name] * 2, float("nan")):
            assert report({**good, name: bad}) == 1
            out = capsys.readouterr().out
            assert out.strip().splitlines()[-1] == "FAIL"
            assert re.search(rf"{re.escape(name)} .*FAIL", out)
    with pytest.raises(ValueError, match="no measurement"):
        report({})
    assert report(good, show=False) == 0 and capsys.readouterr().out == ""


def test_examples_importable_from_the_repository_root() -> None:
    import importlib

    for name in ("examples.gpt", "examples.parallelize", "examples.train_gpt", "examples.check"):
        importlib.import_module(name)


def test_quick_start_installs_numpy_and_stays_quiet() -> None:
    """torch warns at import without NumPy (in the launcher and each rank) and
    torch.distributed.checkpoint's object collectives need it, so the package
    depends on it; torchrun notes OMP_NUM_THREADS unless the demo command sets it."""
    readme = (_ROOT / "README.md").read_text()
    demo = next(line for line in readme.splitlines() if "examples/train_gpt.py" in line and "pip install" in line)
    assert "OMP_NUM_THREADS=1 torchrun" in demo, demo
    deps = re.search(
        r"^dependencies = \[(.*?)\]",
        (_ROOT / "pyproject.toml").read_text(),
        re.MULTILINE | re.DOTALL,
    )
    assert deps is not None and '"numpy' in deps.group(1), deps


@pytest.mark.skipif(
    "fork" not in __import__("multiprocessing").get_all_start_methods(), reason="needs fork"
)
@pytest.mark.skipif(
    torch.__version__ < "2.13",
    reason="torch < 2.13 refuses autograd in a child forked from a process that already ran "
    "autograd (this pytest process; the example's own process has not)",
)
def test_failure_modes_debug_desync_is_deterministic() -> None:
    sys.path.insert(0, str(_EXAMPLES))
    try:
        import failure_modes
    finally:
        sys.path.remove(str(_EXAMPLES))
    for _ in range(2):
        results = failure_modes.run("desync_debug")
        assert [r[0] for r in results] == [0, 1]
        for rank, outcome, message, _seconds in results:
            assert outcome == "CollectiveMismatchError", (rank, outcome, message)
            assert "rank 0 issued all_gather for gpt.blocks.0" in message
            assert "rank 1 issued all_gather for gpt.blocks.1" in message
            assert "Every rank must run the same fully_shard units" in message  # the whole message
