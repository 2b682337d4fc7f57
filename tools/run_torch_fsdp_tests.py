"""Runs torch's own FSDP2 tests twice, with torch's ``fully_shard`` and with
fsdp_compose's swapped in, and prints one line per test.

The swap is the one-line import change a user makes: in a child process only,
``torch.distributed.fsdp.fully_shard`` (and its old ``_composable.fsdp`` path) is
replaced by ``fsdp_compose.fully_shard`` before pytest imports the test files;
everything else (``FSDPModule``, the policies, the test base classes) stays
torch's. Nothing is patched in the calling process or in a library.

torch's tests are not in the wheel: pass test files from a pytorch checkout
(``test/distributed/_composable/fsdp/test_fully_shard_*.py``) whose version
matches the installed torch (or newer test files, for API that torch's main
branch adds: with torch's ``fully_shard`` those fail). Tests that need an
accelerator skip on CPU; the CPU-runnable ones use ``FSDPTestMultiThread`` (ranks
as threads) or gloo. ``--cpu`` runs the accelerator-only ``FSDPTest`` cases on the
CPU too, in the child processes only: ``skip_if_lt_x_gpu`` no longer skips, and
ranks are forked (so that they see the swap) as gloo processes.

``--swap TORCH_NAME=FSDP_COMPOSE_NAME`` (repeatable) swaps one more name, in the
fsdp_compose run only, for test files that import API torch's main branch adds
outside ``fully_shard`` (both are dotted paths to a module attribute; the torch
module must exist in the installed torch, the attribute need not), e.g.
``--swap torch.distributed.fsdp._fully_shard._fsdp_api.cpu_offload_by_budget=fsdp_compose.cpu_offload_by_budget``.

Usage:
    python tools/run_torch_fsdp_tests.py [--cpu] [--swap T=F]... [--timeout S] [-k EXPR] FILE_OR_DIR...

Exit status: 0 when every test fsdp_compose fails also fails (or skips) with torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from typing import Any

MODES = ("torch", "fsdp_compose")


def _swap_in_fsdp_compose() -> None:
    """Makes ``from torch.distributed.fsdp import fully_shard`` give fsdp_compose's."""
    import torch.distributed._composable.fsdp as old_path
    import torch.distributed.fsdp as fsdp

    import fsdp_compose

    fsdp.fully_shard = fsdp_compose.fully_shard  # type: ignore[assignment]
    old_path.fully_shard = fsdp_compose.fully_shard  # type: ignore[assignment]


def _parse_swap(swap: str) -> tuple[str, str, str, str]:
    """``torch.module.name=fsdp_compose.module.name`` -> the two modules and names."""
    torch_name, _, ours = swap.partition("=")
    torch_module, _, attribute = torch_name.rpartition(".")
    our_module, _, our_attribute = ours.rpartition(".")
    if not (torch_module and attribute and our_module and our_attribute):
        raise ValueError(f"--swap wants TORCH_MODULE.NAME=FSDP_COMPOSE_MODULE.NAME, got {swap!r}")
    return torch_module, attribute, our_module, our_attribute


def _swap_names(swaps: list[str]) -> None:
    """``--swap``: sets each torch module attribute to fsdp_compose's, in this process."""
    for swap in swaps:
        torch_module, attribute, our_module, our_attribute = _parse_swap(swap)
        value = getattr(importlib.import_module(our_module), our_attribute)
        setattr(importlib.import_module(torch_module), attribute, value)


def _run_on_cpu() -> None:
    """``--cpu``: torch's accelerator-only ``FSDPTest`` cases as gloo ranks on the CPU.

    Test files import ``skip_if_lt_x_gpu`` when pytest collects them, after this
    runs; ranks are forked rather than spawned, so they keep the swap; each rank
    joins a gloo group without ``FSDPTest``'s accelerator count check."""
    import torch.distributed as dist
    import torch.multiprocessing
    import torch.testing._internal.common_distributed as common_distributed
    from torch.testing._internal.common_fsdp import FSDPTest

    def skip_if_lt_x_gpu(x: int, *, allow_cpu: bool = False) -> Any:
        return lambda func: func

    def fork_processes(self: Any) -> None:
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    def run_rank(cls: Any, rank: int, test_name: str, file_name: str, pipe: Any, **_: Any) -> None:
        self = cls(test_name)
        self.rank, self.file_name = rank, file_name
        url = f"file://{file_name}"
        dist.init_process_group("gloo", init_method=url, world_size=self.world_size, rank=rank)
        try:
            self.run_test(test_name, pipe)
        finally:
            dist.destroy_process_group()

    common_distributed.skip_if_lt_x_gpu = skip_if_lt_x_gpu
    common_distributed.MultiProcessTestCase._spawn_processes = fork_processes
    FSDPTest._run = classmethod(run_rank)


def _child(mode: str, junit: str, pytest_args: list[str], cpu: bool, swaps: list[str]) -> int:
    import pytest

    if cpu:
        _run_on_cpu()
    if mode == "fsdp_compose":
        _swap_in_fsdp_compose()
        _swap_names(swaps)
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


def _run(
    mode: str, pytest_args: list[str], timeout: float, workdir: str, cpu: bool, swaps: list[str]
) -> dict:
    junit = os.path.join(workdir, f"{mode}.xml")
    command = [sys.executable, __file__, "--child", mode, "--junit", junit]
    command += [*(["--cpu"] if cpu else []), *(f"--swap={swap}" for swap in swaps)]
    command += ["--", *pytest_args]
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
    parser.add_argument(
        "--cpu", action="store_true", help="run accelerator-only FSDPTest cases on gloo/CPU"
    )
    parser.add_argument(
        "--swap",
        action="append",
        default=[],
        metavar="TORCH_NAME=FSDP_COMPOSE_NAME",
        help="also swap this name in the fsdp_compose run (repeatable)",
    )
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--junit", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child:
        return _child(args.child, args.junit, [*args.paths, *rest], args.cpu, args.swap)
    if not args.paths:
        parser.error("pass torch's FSDP2 test files (from a pytorch checkout)")
    for swap in args.swap:
        try:
            _parse_swap(swap)
        except ValueError as error:
            parser.error(str(error))
    pytest_args = [*args.paths, *(["-k", args.keyword] if args.keyword else [])]
    with tempfile.TemporaryDirectory() as workdir:
        torch_results, ours = (
            _run(m, pytest_args, args.timeout, workdir, args.cpu, args.swap) for m in MODES
        )
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
