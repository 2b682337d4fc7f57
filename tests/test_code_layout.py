"""The code layout: one runtime with object seams, tools on the public API.

The runtime (the ``fsdp_compose._runtime`` subpackage) holds its
collaborators as objects: per-unit ``Comm`` objects and one event list per root
(``FSDPModule.register_observer``). The tools (``plan``, ``safetensors_io``,
``whole_matrix``, ``trace``, ``debug``) load on first access, and importing the
library registers nothing process-wide.
"""

from __future__ import annotations

import ast
import io
import os
import subprocess
import sys
import tokenize
from collections.abc import Iterator

import pytest
import torch
from helpers import fake_process_group
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_compose
from fsdp_compose import Observer, fully_shard

PACKAGE = os.path.dirname(fsdp_compose.__file__)
TOOLS = ("debug", "ft", "plan", "safetensors_io", "subclass_checkpoint", "trace", "whole_matrix")
RUNTIME_CODE_LINE_BUDGET = 3300  # the target; FSDP2's _fully_shard/ has 3,885
# What the runtime is today: it may shrink, not grow. It is over the budget (see
# test_runtime_code_line_budget); lower this as code leaves. Raised only for a feature
# an issue requires that no smaller design pays for, each recorded with its count in
# docs/architecture.md, "Size" (from 3,870: FSDP2's padded local-shard layout +24,
# FSDP2 2.16's MixedPrecisionPolicy.grad_dtype +31, torch's collective functions
# looked up at each call +1, the default reduce-scatter called with FSDP2's keywords +1,
# a tensor-subclass shard gathered into a plain tensor on one rank as by FSDP2 +1,
# state_dict() resharding gathered units on the step's thread as FSDP2 does +13;
# then FSDP2's split of low-precision gradient division, -1; FSDP2's traversal of
# dataclass inputs and outputs and its torch.func guard around unit operations +40;
# an abandoned in-place gather keeping the storage's version counter +2; no implicit
# forward prefetch in a forward that does not start at the root +2; FSDP2's partial
# path for a grouped unit run in part on its own +13; FSDP2's profiler span names +4;
# all-gather hooks set on a local shard after fully_shard +1; FSDP2's TORCH_LOGS=fsdp
# lines and a post-backward span per unit +8; a review's simplifications -2; a
# backward without a pre-backward hook finalizing nothing else, as FSDP2's +4; a
# unit recomputed by reentrant checkpointing hooked as in a forward, finalization in
# FSDP2's order, an unused backward prefetch dropped at the end of backward +15; a
# grouped unit's modules recomputed one by one, and a root without parameters hooking
# its output, as FSDP2's +3; the backward order cleared once the backwards of the
# recorded forwards have ended, as FSDP2's +8; torch's composable-API registry read
# and written as FSDP2's, so that torch's replicate composes with fully_shard +8;
# FSDP2's warning for a unit returning a view +10; outputs inside a torch.func
# transform marked for the pre-backward, as FSDP2's +20).
RUNTIME_CODE_LINE_CEILING = 4076
FILE_LINE_LIMIT = 600
FUNCTION_LINE_LIMIT = 80


def _modules() -> Iterator[tuple[str, str]]:
    """(dotted name relative to the package, path) of every module."""
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, PACKAGE)[:-3].replace(os.sep, ".")
                yield rel, path


def _runtime() -> list[tuple[str, str]]:
    """The FSDP2-equivalent runtime: the ``_runtime`` subpackage."""
    return [(n, p) for n, p in _modules() if n.split(".")[0] == "_runtime"]


def _lines(path: str) -> int:
    with open(path) as f:
        return sum(1 for _ in f)


def _imported_tops(path: str) -> set[str]:
    """The top-level fsdp_compose modules a runtime module imports (anywhere)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    tops = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                tops.add(node.module.split(".")[0])
            else:
                tops.update(a.name for a in node.names)
    return tops


def test_runtime_imports_nothing_outside_itself() -> None:
    """The runtime knows neither the tools nor fsdp_compose's checks, not even lazily:
    they reach it only as objects passed in (observers, ``Comm`` objects)."""
    for name, path in _runtime():
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1, (name, ast.unparse(node))  # only the runtime itself
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(m.startswith("fsdp_compose") for m in modules), (name, modules)


def test_no_module_assigns_another_modules_attributes() -> None:
    """No registration points: no module-level statement writes an attribute of
    another module or object."""
    for name, path in _modules():
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                assert not isinstance(target, ast.Attribute), (name, ast.unparse(node))
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                func = node.value.func
                assert not (
                    isinstance(func, ast.Attribute) and func.attr in ("append", "extend", "add")
                ), (name, ast.unparse(node))


def test_no_file_over_the_limit() -> None:
    over = {n: _lines(p) for n, p in _modules() if _lines(p) > FILE_LINE_LIMIT}
    assert not over, over


_NOT_CODE = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
}


def code_lines(source: str) -> int:
    """The lines of ``source`` that carry code: those holding a token other than a
    comment or a line break, less the lines of module, class and function
    docstrings. Blank lines, comments and docstrings are free; a string that is an
    expression's value (an error message) is code on every line it spans."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, first.end_lineno + 1))  # type: ignore[operator]
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _NOT_CODE:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def test_code_lines_counts_code_only() -> None:
    source = (
        '"""Module doc.\n\nMore."""\n\n# a comment\n'
        "def f(x):\n"
        '    """Doc."""\n'
        "    y = (x +  # why\n"
        "         1)\n"
        "\n"
        '    raise ValueError("a"\n'
        '                     "b")\n'
    )
    assert code_lines(source) == 5  # def, the two lines of y, the two of the raise


def _runtime_code_lines() -> int:
    total = 0
    for _, path in _runtime():
        with open(path) as f:
            total += code_lines(f.read())
    return total


@pytest.mark.xfail(
    strict=True,
    reason="the runtime is over its code-line budget (docs/architecture.md, 'Size'): the "
    "tools' launch path, observer values and FSDP2 2.16's gradient and offload features "
    "added to it have not been paid for by a smaller design yet; strict, so meeting the "
    "budget turns this into a failure to fix",
)
def test_runtime_code_line_budget() -> None:
    """Everything FSDP2 does, counted in code lines: the ``_runtime`` subpackage as a
    whole. Explanations cost nothing, so they are never what keeps it in budget."""
    total = _runtime_code_lines()
    budget = RUNTIME_CODE_LINE_BUDGET
    assert total <= budget, f"the runtime is {total} code lines, over {budget}"


def test_runtime_code_lines_do_not_grow() -> None:
    """Until the budget is met, the runtime may not grow past what it is."""
    total = _runtime_code_lines()
    ceiling = RUNTIME_CODE_LINE_CEILING
    assert total <= ceiling, f"the runtime grew to {total} code lines, over {ceiling}"


def _long_functions() -> list[tuple[str, str, int]]:
    found = []
    for name, path in _modules():
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body[1:] if ast.get_docstring(node) else node.body
                if not body:
                    continue
                length = body[-1].end_lineno - body[0].lineno + 1  # type: ignore[operator]
                if length > FUNCTION_LINE_LIMIT:
                    found.append((name, node.name, length))
    return found


def test_function_length() -> None:
    long = _long_functions()
    assert not long, f"functions over {FUNCTION_LINE_LIMIT} lines (code, not docstrings): {long}"


_IMPORT_PROBE = """
import sys, threading, torch
from torch.optim import optimizer as o
before = (len(o._global_optimizer_pre_hooks), len(o._global_optimizer_post_hooks), threading.active_count())
import fsdp_compose
after = (len(o._global_optimizer_pre_hooks), len(o._global_optimizer_post_hooks), threading.active_count())
tools = sorted(m for m in sys.modules if m.split(".")[:2][-1] in {tools})
print(before == after, tools)
fsdp_compose.trace, fsdp_compose.plan
print(sorted(m for m in sys.modules if m in ("fsdp_compose.trace", "fsdp_compose.plan")))
"""


def test_import_registers_nothing_and_tools_load_lazily() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_COMPOSE_")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE.replace("{tools}", repr(set(TOOLS)))],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    first, second = result.stdout.splitlines()[-2:]
    assert first == "True []", result.stdout
    assert second == "['fsdp_compose.plan', 'fsdp_compose.trace']", result.stdout


def _tiny() -> nn.Module:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    for layer in model:
        fully_shard(layer, mesh=init_device_mesh("cpu", (4,)))
    return fully_shard(model, mesh=init_device_mesh("cpu", (4,)))


class _Steps(Observer):
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int]] = []

    def on_collective(self, event: str, info: fsdp_compose.CollectiveInfo) -> None:  # type: ignore[override]
        if event == "issue":
            self.seen.append((info.kind, info.label, info.step))


def test_two_roots_keep_their_own_steps_and_observers() -> None:
    """Two roots in one process (e.g. two pipeline stages) count their own steps
    and tell their own observers; nothing is process-wide."""
    with fake_process_group(4, 1):
        torch.manual_seed(0)
        first, second = _tiny(), _tiny()
        a, b = _Steps(), _Steps()
        first.register_observer(a)
        second.register_observer(b)
        for _ in range(3):
            first(torch.randn(2, 8)).sum().backward()
        second(torch.randn(2, 8)).sum().backward()
    assert first._fsdp_state().scheduler.step == 3
    assert second._fsdp_state().scheduler.step == 1
    assert {step for *_, step in a.seen} == {1, 2, 3}, a.seen
    assert {step for *_, step in b.seen} == {1}, b.seen
    # each of the 3 units: one all-gather and one reduce-scatter per step
    assert len(b.seen) >= 4 and all(kind != "all_reduce" for kind, *_ in b.seen), b.seen


def test_settings_made_before_the_parent_is_annotated_apply_to_the_tree() -> None:
    with fake_process_group(4, 0):
        mesh = init_device_mesh("cpu", (4,))
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        fully_shard(model[0], mesh=mesh).set_prefetch_depth(forward=2)
        fully_shard(model[1], mesh=mesh).set_unsharded_memory_limit(1 << 20)
        observer = _Steps()
        model[1].register_observer(observer)  # on a subtree: adopted by the root
        fully_shard(model, mesh=mesh)
        model[0].set_is_last_backward(False)  # after: the shared object, as on the root
        model(torch.randn(2, 8)).sum().backward()
        settings = model._fsdp_state().scheduler.settings
        assert (settings.forward_depth, settings.max_unsharded_bytes) == (2, 1 << 20), settings
        assert settings.is_last_backward is False, settings
        assert model[1]._fsdp_state().settings is settings
        assert observer.seen, "an observer registered on a subtree sees the tree's collectives"


def test_an_observer_raising_at_issue_refuses_the_collective() -> None:
    """What the debug checks rely on: an observer raising at ``issue`` stops the
    collective before it is launched, with its own exception."""

    class Refuse(Observer):
        def on_collective(self, event: str, info: fsdp_compose.CollectiveInfo) -> None:  # type: ignore[override]
            if event == "issue":
                raise ValueError(f"refused {info.kind} for {info.label}")

    with fake_process_group(4, 0):
        model = _tiny()
        model.register_observer(Refuse())
        with pytest.raises(ValueError, match="refused all_gather for 0"):
            model(torch.randn(2, 8))
