"""``tools/run_torch_fsdp_tests.py``: the swap reaches the fsdp_compose run only, and
``--swap`` swaps the extra names torch main's test files import.

Each case runs the tool on a small test file written in torch's style (the tool
runs real pytest child processes, as on torch's own files); torch's own test files
are not part of the repository.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "run_torch_fsdp_tests.py"
API = "torch.distributed.fsdp._fully_shard._fsdp_api"

# torch 2.13 has no _select_largest_first: only a swap makes the second test pass.
TORCH_STYLE_TESTS = """
import torch.distributed.fsdp as fsdp
from torch.distributed.fsdp._fully_shard import _fsdp_api

import fsdp_compose


def test_fully_shard_is_fsdp_compose():
    assert fsdp.fully_shard is fsdp_compose.fully_shard


def test_select_largest_first():
    items = [("a", 40), ("b", 100), ("c", 30), ("d", 100)]
    assert _fsdp_api._select_largest_first(items, 240) == ["b", "d", "a"]
    assert _fsdp_api._select_largest_first(items, 170) == ["b"]
    assert _fsdp_api._select_largest_first(items[::-1], 200) == ["b", "d"]


def test_fully_shard_is_torch():
    assert fsdp.fully_shard is not fsdp_compose.fully_shard
"""


def _run_tool(path: Path, *options: str) -> tuple[int, dict[str, tuple[str, str]]]:
    """Exit status and, per test name, (torch's outcome, fsdp_compose's outcome)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(TOOL), "--timeout", "240", *options, str(path)]
    done = subprocess.run(
        command, cwd=path.parent, env=env, capture_output=True, text=True, timeout=600
    )
    rows = {}
    for line in done.stdout.splitlines():
        cells = [cell.strip() for cell in line.split("|")]
        if len(cells) == 4 and "::" in cells[0]:
            rows[cells[0].rsplit("::", 1)[1]] = (cells[1], cells[2])
    return done.returncode, rows


@pytest.fixture(scope="module")
def torch_style_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("torch_tests") / "test_torch_style.py"
    path.write_text(TORCH_STYLE_TESTS)
    return path


def test_swaps_fully_shard_and_the_swap_option_in_the_fsdp_compose_run_only(
    torch_style_file: Path,
) -> None:
    # One run of the tool (two pytest child processes) checks both: fully_shard and
    # the --swap name are swapped in the fsdp_compose run, and nothing in torch's.
    swap = f"--swap={API}._select_largest_first=fsdp_compose._offload_budget._select_largest_first"
    status, rows = _run_tool(torch_style_file, swap)
    assert rows == {
        "test_fully_shard_is_fsdp_compose": ("failed", "passed"),
        "test_select_largest_first": ("failed", "passed"),
        "test_fully_shard_is_torch": ("passed", "failed"),
    }
    assert status == 1  # a test torch passes and fsdp_compose fails


def test_malformed_swap_is_refused_before_running(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(TOOL), "--swap", "cpu_offload_by_budget", "x.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "TORCH_MODULE.NAME=FSDP_COMPOSE_MODULE.NAME" in done.stderr
