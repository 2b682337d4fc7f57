"""The code layout: the FSDP2-equivalent core apart from the extensions.

The core (``CORE``) is what torch's FSDP2 also has: the annotator, ``FSDPModule``,
the hooks, the scheduler, the unit (state machine, flat buffer, gradient
reduction), the sharded parameter, the collectives (public ones; gloo's exchanges
register as a route),
the mesh, the policies, and the small shared modules they need. Every
capability beyond FSDP2 is an extension: it imports the core and attaches to its
registration points (documented module attributes such as ``route_providers``,
``explain_failure`` and ``launch_hook`` in ``_collectives``, the schedule
``observer`` in ``_scheduler``, ``root_init_checks`` and ``iter_state_reset`` in
``_hooks``, step handlers in ``_optim``), and no core module imports it.

Also here: the side channels the layout removed stay removed (a root's step
reaches its collectives through its own context; schedule settings are one typed
object per tree).
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator

import pytest
import torch
from helpers import fake_process_group
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_compose
from fsdp_compose import MixedPrecisionPolicy, _collective_hooks, _collectives, fully_shard
from fsdp_compose.debug import CollectiveMismatchError

PACKAGE = os.path.dirname(fsdp_compose.__file__)

#: The FSDP2-equivalent core, see the README's layout table.
CORE = (
    "_collectives",
    "_compat",
    "_errors",
    "_flat_buffer",
    "_fsdp_module",
    "_fully_shard",
    "_hooks",
    "_mesh",
    "_policies",
    "_reduce",
    "_scheduler",
    "_sharded_param",
    "_unit",
)
#: Capabilities beyond FSDP2 (modules and subpackages of ``fsdp_compose``).
EXTENSIONS = (
    "_collective_hooks",
    "_env",  # the FSDP_COMPOSE_* variables: only extensions read any
    "_failures",
    "_full_state_dict",
    "_gloo",
    "_grad_scaler",
    "_guard",
    "_host_memory",
    "_missing_root",
    "_misuse",
    "_optim",
    "_pipelining",
    "_recovery",
    "_shared",
    "_stall",
    "_validation",
    "debug",
    "plan",
    "safetensors_io",
    "trace",
    "whole_matrix",
)
CORE_LINE_BUDGET = 4000


def _lines(path: str) -> int:
    with open(path) as f:
        return sum(1 for _ in f)


def _imported(name: str) -> Iterator[tuple[int, str]]:
    """(line, top-level fsdp_compose module) for every import in module ``name``,
    including imports inside functions."""
    with open(os.path.join(PACKAGE, name + ".py")) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:  # from .x import ...
                yield node.lineno, node.module.split(".")[0]
            elif node.level == 1:  # from . import x, y
                for alias in node.names:
                    yield node.lineno, alias.name
            elif node.level == 0 and node.module and node.module.startswith("fsdp_compose."):
                yield node.lineno, node.module.split(".")[1]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("fsdp_compose."):
                    yield node.lineno, alias.name.split(".")[1]


def test_every_module_is_core_or_extension() -> None:
    found = {
        entry.removesuffix(".py")
        for entry in os.listdir(PACKAGE)
        if (entry.endswith(".py") and entry != "__init__.py")
        or os.path.isfile(os.path.join(PACKAGE, entry, "__init__.py"))
    }
    assert found == set(CORE) | set(EXTENSIONS), (
        f"not classified: {sorted(found - set(CORE) - set(EXTENSIONS))}; "
        f"gone: {sorted(set(CORE) | set(EXTENSIONS) - found)}"
    )


def test_core_imports_no_extension() -> None:
    offending = [
        f"{name}.py:{line} imports {target}"
        for name in CORE
        for line, target in _imported(name)
        if target in EXTENSIONS
    ]
    assert not offending, offending


def test_core_within_its_line_budget() -> None:
    """Issue 17's target: the core is at most 4,000 lines (``wc -l``)."""
    counts = {name: _lines(os.path.join(PACKAGE, name + ".py")) for name in CORE}
    total = sum(counts.values())
    assert total <= CORE_LINE_BUDGET, (total, counts)


def test_no_module_over_700_lines() -> None:
    counts = {
        os.path.relpath(os.path.join(root, f), PACKAGE): _lines(os.path.join(root, f))
        for root, _, files in os.walk(PACKAGE)
        for f in files
        if f.endswith(".py")
    }
    over = {name: n for name, n in counts.items() if n > 700}
    assert not over, over


# -- side channels ------------------------------------------------------------


def _tiny() -> nn.Module:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    for layer in model:
        fully_shard(layer, mesh=init_device_mesh("cpu", (4,)))
    return fully_shard(model, mesh=init_device_mesh("cpu", (4,)))


def test_two_roots_keep_their_own_steps() -> None:
    """Two roots in one process (e.g. two pipeline stages) name their own steps
    in their collectives; a launch wrapper sees them."""
    seen: list[tuple[str, int]] = []

    def record(call: _collective_hooks.CollectiveCall, issue: _collectives.Issue) -> object:
        seen.append((call.label, call.step))
        return issue(call.group)

    with fake_process_group(4, 1):
        torch.manual_seed(0)
        first, second = _tiny(), _tiny()
        _collective_hooks.add_launch_wrapper(record)
        try:
            for _ in range(3):
                first(torch.randn(2, 8)).sum().backward()
            second(torch.randn(2, 8)).sum().backward()
        finally:
            _collective_hooks.remove_launch_wrapper(record)
    assert first._fsdp_state().scheduler.step == 3, first._fsdp_state().scheduler.step
    assert second._fsdp_state().scheduler.step == 1, second._fsdp_state().scheduler.step
    steps = [step for _, step in seen]
    per_root = 2 * 3  # each of the 3 units: one all-gather and one reduce-scatter
    assert len(steps) >= 4 * per_root, seen
    assert steps[-per_root:] == [1] * per_root, seen  # the second root's first step
    assert max(steps) == 3, seen


def test_settings_made_before_the_parent_is_annotated_apply_to_the_tree() -> None:
    with fake_process_group(4, 0):
        mesh = init_device_mesh("cpu", (4,))
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        fully_shard(model[0], mesh=mesh).set_prefetch_depth(forward=2)
        fully_shard(model[1], mesh=mesh).set_unsharded_memory_limit(1 << 20)
        fully_shard(model, mesh=mesh)
        model[0].set_is_last_backward(False)  # after: the shared object, as on the root
        model(torch.randn(2, 8)).sum().backward()
        settings = model._fsdp_state().scheduler.settings
        assert (settings.forward_depth, settings.max_unsharded_bytes) == (2, 1 << 20), settings
        assert settings.is_last_backward is False, settings
        assert model[1]._fsdp_state().settings is settings


def test_launch_wrapper_errors() -> None:
    """A wrapper's CollectiveMismatchError reaches the caller as is; any other
    RuntimeError is reported as a failure of the collective it wrapped."""

    def mismatch(call: _collective_hooks.CollectiveCall, issue: _collectives.Issue) -> object:
        raise CollectiveMismatchError(f"ranks disagree on {call.kind} for {call.label}")

    def broken(call: _collective_hooks.CollectiveCall, issue: _collectives.Issue) -> object:
        raise RuntimeError("Connection closed by peer")

    with fake_process_group(2, 0):
        group = torch.distributed.group.WORLD
        for wrapper, error, text in (
            (mismatch, CollectiveMismatchError, "ranks disagree on all_gather for probe"),
            (broken, RuntimeError, r"all_gather for probe \(step 7\) failed on rank 0"),
        ):
            _collective_hooks.add_launch_wrapper(wrapper)
            try:
                with pytest.raises(error, match=text):
                    _collectives.all_gather(torch.empty(4), torch.ones(2), group, "probe", step=7)
            finally:
                _collective_hooks.remove_launch_wrapper(wrapper)
        _collectives.all_gather(torch.empty(4), torch.ones(2), group, "probe").wait()


def test_core_trains_with_the_extensions_detached() -> None:
    """The core alone (parameter sharing, full-state-dict loading and the checks
    beyond FSDP2 detached from their registration points) trains like the
    unwrapped model; a weight tied across units then gets one copy per unit, as
    in FSDP2."""
    import copy

    from fsdp_compose import _fully_shard, _hooks, _unit

    attached = (_hooks.param_sharing, _unit.unit_checks, _fully_shard.load_conversion)
    checks, buffer_check = list(_fully_shard.shard_checks), _collectives.check_custom_buffer
    _hooks.param_sharing = None
    _unit.unit_checks = None
    _fully_shard.load_conversion = None
    _fully_shard.shard_checks.clear()
    _collectives.check_custom_buffer = None
    try:
        with fake_process_group(1, 0):
            torch.manual_seed(0)
            ref = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
            model = copy.deepcopy(ref)
            fully_shard(
                model[0], mp_policy=MixedPrecisionPolicy(torch.float64, output_dtype=torch.float32)
            )
            fully_shard(model[2])
            fully_shard(model)
            opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
            for _ in range(3):
                x = torch.randn(4, 8)
                for m, opt in zip((model, ref), opts):
                    m(x).square().sum().backward()
                    opt.step()
                    opt.zero_grad()
            diff = max(
                (p.full_tensor() - q).abs().max().item()
                for p, q in zip(model.parameters(), ref.parameters())
            )
            assert diff < 1e-5, diff
            tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
            tied[1].weight = tied[0].weight
            fully_shard(tied[0])
            fully_shard(tied[1])  # without _shared: a second copy, as in FSDP2
            assert tied[0].weight is not tied[1].weight
    finally:
        _hooks.param_sharing = attached[0]
        _unit.unit_checks = attached[1]
        _fully_shard.load_conversion = attached[2]
        _fully_shard.shard_checks[:] = checks
        _collectives.check_custom_buffer = buffer_check
