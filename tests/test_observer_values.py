"""Observers get values: frozen descriptions of units, never the runtime's objects.

See [Note: observer values] in ``fsdp_compose/_runtime/_events.py``: events carry a
``UnitInfo`` (and the event's own values where it has some), observers keep their own
state, and nothing outside the runtime writes attributes on its objects.
"""

from __future__ import annotations

import ast
import dataclasses
import gc
import os
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from helpers import fake_process_group
from torch import nn

import fsdp_compose
from fsdp_compose import (
    Annotation,
    GatherInput,
    Observer,
    ParamInfo,
    UnitInfo,
    UnitOptionsInfo,
    debug,
    fully_shard,
    trace,
)
from fsdp_compose._runtime._events import UnitEvent

# _Unused's spare parameters get no gradient, on every rank alike: as intended here.
pytestmark = pytest.mark.filterwarnings("ignore:fsdp_compose.*got no gradient")


class _Record(Observer):
    """Every unit event and root init, as the values they carry."""

    def __init__(self) -> None:
        self.events: list[tuple[str, UnitInfo]] = []
        self.roots: list[tuple[UnitInfo, ...]] = []
        self.memory: list[tuple[str, UnitInfo, int, int]] = []

    def on_root_init(self, units: Sequence[UnitInfo]) -> None:
        self.roots.append(tuple(units))

    def on_unit(self, event: UnitEvent, info: UnitInfo) -> None:
        self.events.append((event, info))

    def on_memory(self, event: Any, info: UnitInfo, nbytes: int, total: int) -> None:
        self.memory.append((event, info, nbytes, total))

    def at(self, event: str) -> dict[str, UnitInfo]:
        return {info.name: info for e, info in self.events if e == event}


class _Unused(nn.Module):
    """A block whose ``spare`` parameters get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.spare = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Unused())
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def test_payloads_are_frozen() -> None:
    with fake_process_group(2, 0):
        model = _model()
        record = _Record()
        model.register_observer(record)
        model(torch.randn(2, 8)).sum().backward()
    info = record.roots[0][0]
    assert isinstance(info.params[0], ParamInfo) and isinstance(info.options, UnitOptionsInfo)
    for value, field in (
        (info, "name"),
        (info, "sharded_versions"),
        (info.params[0], "fqn"),
        (info.options, "requires_gradient_sync"),
        (GatherInput("w", ((2,),), (torch.int8,)), "sizes"),
    ):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field, None)
    for cls in (UnitInfo, ParamInfo, UnitOptionsInfo, GatherInput, Annotation):
        assert cls.__dataclass_params__.frozen, cls  # type: ignore[attr-defined]


def test_values_across_a_training_step() -> None:
    with fake_process_group(2, 0):
        model = _model()
        record = _Record()
        model.register_observer(record)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
        model.set_requires_gradient_sync(False)
        model(torch.randn(2, 8)).sum().backward()
    (units,) = record.roots
    assert [u.name for u in units] == ["0", "1"]
    first, second = units
    assert first.fqns == ("0.weight", "0.bias")
    assert second.fqns == ("1.used.weight", "1.used.bias", "1.spare.weight", "1.spare.bias")
    assert [(p.shape, p.dtype, p.requires_grad) for p in first.params] == [
        ((8, 8), torch.float32, True),
        ((8,), torch.float32, True),
    ]
    assert first.shard_ranks == (0, 1) and first.shard_rank == 0 and first.replicate_group is None
    assert first.options.reshard_after_forward is True and first.options.requires_gradient_sync
    # One id per unit, the same in every event; values only in the events that carry them.
    ids = {info.name: {i.id for e, i in record.events if i.name == info.name} for info in units}
    assert ids == {"0": {first.id}, "1": {second.id}} and first.id != second.id
    begins = [i for e, i in record.events if e == "forward_begin" and i.name == "0"]
    assert [len(i.sharded_versions or ()) for i in begins] == [2, 2, 2]
    assert begins[0].sharded_versions != begins[1].sharded_versions  # the optimizer stepped
    gathered = record.at("gathered")["0"]
    assert gathered.unsharded_version is not None and gathered.sharded_versions is None
    assert record.at("backward_end")["1"].without_grad == ("1.spare.weight", "1.spare.bias")
    assert record.at("backward_end")["0"].without_grad == ()
    ends = record.at("forward_end")["0"]  # no values of its own
    assert (ends.sharded_versions, ends.unsharded_version, ends.without_grad) == (None,) * 3
    # Settings changed: the description is rebuilt, the id kept.
    last = record.events[-1][1]
    assert last.id in (first.id, second.id) and not last.options.requires_gradient_sync
    assert {e for e, _, _, _ in record.memory} == {"alloc", "free"}
    assert all(isinstance(i, UnitInfo) for _, i, _, _ in record.memory)


def test_an_event_is_built_only_for_observers_receiving_it() -> None:
    class _Ends(Observer):
        unit_events = frozenset({"backward_end"})

        def __init__(self) -> None:
            self.seen: list[str] = []

        def on_unit(self, event: UnitEvent, info: UnitInfo) -> None:
            self.seen.append(event)

    with fake_process_group(2, 0):
        model = _model()
        ends = _Ends()
        model.register_observer(ends)
        events = model._fsdp_state().settings.events
        assert events.on_unit and ends in events.on_unit
        model(torch.randn(2, 8)).sum().backward()
    assert set(ends.seen) == {"backward_end"} and len(ends.seen) == 2


def test_observer_state_keeps_no_model_alive() -> None:
    with fake_process_group(2, 0):
        model = _model()
        record = _Record()
        model.register_observer(record)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        alive = weakref.ref(model)
        del model, opt
        gc.collect()
        assert alive() is None, gc.get_referrers(alive())
    assert record.events and record.roots  # the values outlive the model


def test_events_module_imports_nothing_from_the_unit() -> None:
    path = os.path.join(os.path.dirname(fsdp_compose.__file__), "_runtime", "_events.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.module != "_unit" and "_unit" not in (node.module or ""), ast.unparse(node)
            assert all(a.name != "_unit" for a in node.names), ast.unparse(node)


def test_unit_is_not_exported() -> None:
    from fsdp_compose import _runtime

    assert "Unit" not in _runtime.__all__ and not hasattr(_runtime, "Unit")
    assert {"UnitInfo", "ParamInfo", "UnitOptionsInfo", "GatherInput"} <= set(_runtime.__all__)


def test_debug_mode_from_the_environment_subscribes_one_checker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FSDP_COMPOSE_DEBUG_COLLECTIVES", "1")
    with fake_process_group(2, 0):
        model = _model()
        observers = model._fsdp_state().settings.events.observers
    checks = [o for o in observers if isinstance(o, debug.CollectiveChecks)]
    assert len(checks) == 1, observers


def _runtime_objects(model: nn.Module) -> list[object]:
    root = model._fsdp_state()  # type: ignore[operator]
    states = root.all_states
    units = [u for s in states for u in s.own_units]
    return [*states, *units, *(p for u in units for p in u.params), root.scheduler]


def _fsdp_compose_attributes(objects: list[object]) -> list[str]:
    found = []
    for obj in objects:
        names = list(getattr(obj, "__dict__", {})) + list(getattr(obj, "__slots__", ()))
        found += [f"{type(obj).__name__}.{n}" for n in names if n.startswith("_fsdp_compose")]
    return found


def _all_observers_job() -> list[str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Unused())
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no check fires on a correct step
        warnings.filterwarnings("ignore", "fsdp_compose.*got no gradient")
        with debug.collective_checks(model, timeout=60.0), trace.recording(model) as timeline:
            for _ in range(2):
                model(torch.randn(2, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
    assert any(e["name"].startswith("forward 0") for e in timeline.events())
    return _fsdp_compose_attributes(_runtime_objects(model))


def test_no_attribute_is_written_on_runtime_objects() -> None:
    """The checks, debug mode and the timeline keep their own state."""
    found = run_distributed(_all_observers_job, 2)
    assert found == [[], []], found
