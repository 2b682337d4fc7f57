"""Runs torch's own FSDP2 tests twice, with torch's ``fully_shard`` and with
fsdp_compose's swapped in, and prints one line per test.

The swap is the one-line import change a user makes: in a child process only,
``torch.distributed.fsdp.fully_shard`` (and its old ``_composable.fsdp`` path) is
replaced by ``fsdp_compose.fully_shard`` before pytest imports the test files;
everything else (``FSDPModule``, the policies, the test base classes) stays
torch's. Nothing is patched in the calling process or in a library.

torch's tests are not in the wheel: pass test files from a pytorch checkout
(``test/distributed/_composable/fsdp/test_fully_shard_*.py``) whose version
matches the installed torch. Tests that need an accelerator skip on CPU; the
CPU-runnable ones use ``FSDPTestMultiThread`` (ranks as threads) or gloo.

Usage:
    python tools/run_torch_fsdp_tests.py [--timeout S] [-k EXPR] FILE_OR_DIR...

Exit status: 0 when every test fsdp_compose fails also fails (or skips) with torch.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree

MODES = ("torch", "fsdp_compose")


def _swap_in_fsdp_compose() -> None:
    """Makes ``from torch.distributed.fsdp import fully_shard`` give fsdp_compose's."""
    import torch.distributed._composable.fsdp as old_path
    import torch.distributed.fsdp as fsdp

    import fsdp_compose

    fsdp.fully_shard = fsdp_compose.fully_shard  # type: ignore[assignment]
    old_path.fully_shard = fsdp_compose.fully_shard  # type: ignore[assignment]


def _child(mode: str, junit: str, pytest_args: list[str]) -> int:
    import pytest

    if mode == "fsdp_compose":
        _swap_in_fsdp_compose()
    args = ["-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *pytest_args]
    return int(pytest.main(args))


def _outcomes(junit: str) -> dict[str, tuple[str, str]]:
    """test id -> (passed | failed | skipped, first line of the reason)."""
    results: dict[str, tuple[str, str]] = {}
    if not os.path.exists(junit):
        return results
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                text = (node.get("message") or node.text or "").strip()
                lines = [ln for ln in text.splitlines() if ln.strip()]
                errors = [
                    ln for ln in lines if "Error" in ln.split(":")[0] and "exited with" not in ln
                ]
                reason = (errors or lines or [""])[-1].strip()[:200]
                break
        results[test_id] = (outcome, reason)
    return results


def _run(mode: str, pytest_args: list[str], timeout: float, workdir: str) -> dict:
    junit = os.path.join(workdir, f"{mode}.xml")
    command = [sys.executable, __file__, "--child", mode, "--junit", junit, "--", *pytest_args]
    env = {**os.environ, "PYTORCH_PRINT_REPRO_ON_FAILURE": "0"}
    try:
        subprocess.run(command, timeout=timeout, check=False, env=env)
    except subprocess.TimeoutExpired:
        print(f"{mode}: timed out after {timeout:.0f}s", file=sys.stderr)
    return _outcomes(junit)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", help="torch test files or directories")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per mode")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--junit", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child:
        return _child(args.child, args.junit, [*args.paths, *rest])
    if not args.paths:
        parser.error("pass torch's FSDP2 test files (from a pytorch checkout)")
    pytest_args = [*args.paths, *(["-k", args.keyword] if args.keyword else [])]
    with tempfile.TemporaryDirectory() as workdir:
        torch_results, ours = (_run(m, pytest_args, args.timeout, workdir) for m in MODES)
    regressions = 0
    print("test | torch | fsdp_compose | fsdp_compose's failure")
    for test_id in sorted(set(torch_results) | set(ours)):
        theirs_outcome = torch_results.get(test_id, ("missing", ""))[0]
        outcome, reason = ours.get(test_id, ("missing", ""))
        regressions += outcome in ("failed", "missing") and theirs_outcome == "passed"
        print(f"{test_id} | {theirs_outcome} | {outcome} | {reason if outcome != 'passed' else ''}")
    counts = {m: {} for m in MODES}  # type: dict[str, dict[str, int]]
    for mode, results in zip(MODES, (torch_results, ours)):
        for outcome, _ in results.values():
            counts[mode][outcome] = counts[mode].get(outcome, 0) + 1
    for mode in MODES:
        print(f"{mode}: " + ", ".join(f"{n} {o}" for o, n in sorted(counts[mode].items())))
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
