"""A pytest plugin: every skipped test's reason ends with what enables it.

``pytest.importorskip`` reports "could not import 'torchao...'"; a reader of the
summary (``-ra``, the project's default) also needs the command that installs the
missing package. The hint is appended to the reason of skipped tests and of
skipped test modules (a module-level ``importorskip`` skips at collection).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

#: a word in the skip reason -> what enables the test
HINTS = {
    "torchao": 'pip install -e ".[torchao]" (torchao 0.18.0)',
    "torchft": 'pip install -e ".[ft]" (torchft 0.2.0)',
    "transformers": 'pip install -c constraints.txt -e ".[test]"',
    "safetensors": 'pip install -c constraints.txt -e ".[test]"',
    "accelerate": 'pip install -c constraints.txt -e ".[test]"',
    "bitsandbytes": 'pip install -c constraints.txt -e ".[test]"',
    "CUDA": "a machine with a CUDA GPU (the test runs there as is)",
    "torch <": "the torch release the reason names (tools/torch_matrix.sh runs the suite on several)",
    "torch's": "the torch release the reason names (tools/torch_matrix.sh runs the suite on several)",
    "g++": "a C++ compiler (g++) for torch.compile's CPU backend",
}


def hint(reason: str) -> str:
    """``reason`` with what enables the test appended (unchanged when none is known)."""
    for word, enable in HINTS.items():
        if word in reason and "enable:" not in reason:
            return f"{reason} [enable: {enable}]"
    return reason


def _add_hint(report: Any) -> None:
    longrepr = report.longrepr
    if report.skipped and isinstance(longrepr, tuple) and len(longrepr) == 3:
        path, lineno, reason = longrepr
        report.longrepr = (path, lineno, hint(str(reason)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Generator[None, Any, None]:
    outcome = yield
    _add_hint(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    _add_hint(outcome.get_result())
