"""fsdp_compose's checks beyond FSDP2's are one observer of the runtime's events.

The runtime's ``fully_shard`` is FSDP2's, with an observer list passed in; the
public ``fsdp_compose.fully_shard`` passes ``fsdp_compose._checks.CHECKS``. These
tests build runtimes with given observer lists (no module attribute is patched).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import pytest
import torch
from helpers import fake_process_group
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp_compose
from fsdp_compose import Annotation, FSDPModule, Observer, UnitInfo
from fsdp_compose._checks import CHECKS
from fsdp_compose._runtime._fully_shard import fully_shard as runtime_fully_shard


class _Recorder(Observer):
    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.calls: list[Annotation] = []
        self.names: list[str] = []  # the class names at the call (before FSDP's)
        self.roots: list[list[str]] = []

    def on_annotate(self, call: Annotation) -> None:
        self.calls.append(call)
        self.names.append(type(call.modules[0]).__name__)
        if self.refuse:
            raise ValueError(f"refused fully_shard({type(call.modules[0]).__name__})")

    def on_root_init(self, units: Sequence[UnitInfo]) -> None:
        self.roots.append([u.name for u in units])


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))


def test_public_fully_shard_subscribes_the_checks_once_per_tree() -> None:
    with fake_process_group(4, 0):
        model = _model()
        for layer in model:
            fsdp_compose.fully_shard(layer)
        fsdp_compose.fully_shard(model)
        observers = model._fsdp_state().settings.events.observers
        assert observers.count(CHECKS) == 1, observers
        model(torch.randn(2, 8)).sum().backward()


def test_the_runtime_sees_observers_in_order_and_calls_them_per_event() -> None:
    recorder = _Recorder()
    with fake_process_group(4, 0):
        model = _model()
        for layer in model:
            runtime_fully_shard(layer, observers=[recorder])
        runtime_fully_shard(model, observers=[recorder])
        assert recorder.names == ["Linear", "Linear", "Sequential"], recorder.names
        first = recorder.calls[0]
        assert [name for owners in first.owners.values() for _, name in owners] == [
            "weight",
            "bias",
        ]
        assert first.managed == (model[0],) and first.mesh_info.shard_size == 4
        assert model._fsdp_state().settings.events.observers == [recorder]
        for _ in range(2):
            model(torch.randn(2, 8)).sum().backward()
    assert recorder.roots == [["0", "1"]], recorder.roots  # the root manages no parameters


def test_an_observer_refusing_the_call_leaves_the_module_unchanged() -> None:
    with fake_process_group(4, 0):
        model = _model()
        with pytest.raises(ValueError, match=r"refused fully_shard\(Linear\)"):
            runtime_fully_shard(model[0], observers=[_Recorder(refuse=True)])
        assert not isinstance(model[0], FSDPModule)
        assert not any(isinstance(p, DTensor) for p in model.parameters())
        runtime_fully_shard(model[0])  # a retry without the refusal succeeds
        assert isinstance(model[0].weight, DTensor)


def test_without_the_checks_the_runtime_behaves_as_fsdp2() -> None:
    """A 2-D mesh named (shard, replicate): FSDP2 accepts it silently as HSDP (dim 0
    replicates); fsdp_compose's checks warn that the names suggest the reverse."""
    with fake_process_group(4, 0):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "replicate"))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            runtime_fully_shard(_model(), mesh=mesh)
        with pytest.warns(UserWarning, match="suggests the reverse"):
            fsdp_compose.fully_shard(_model(), mesh=mesh)
        with pytest.raises(TypeError, match="mp_policy must be a MixedPrecisionPolicy"):
            fsdp_compose.fully_shard(_model(), mesh=mesh, mp_policy="bf16")  # type: ignore[arg-type]


def test_fsdp2s_own_validations_stay_in_the_runtime() -> None:
    """What FSDP2 itself refuses, the runtime refuses without any observer."""
    with fake_process_group(4, 0):
        with pytest.raises(ValueError, match="containers that do not implement forward"):
            runtime_fully_shard(nn.ModuleList([nn.Linear(2, 2)]))
        with pytest.raises(AssertionError, match="mesh_dim_names specified"):
            runtime_fully_shard(_model(), mesh=init_device_mesh("cpu", (2, 2)))
        with torch.device("meta"):
            model = _model()
        runtime_fully_shard(model, mesh=init_device_mesh("cpu", (4,)))
        with pytest.raises(RuntimeError, match="parameters on the meta device"):
            model(torch.randn(2, 8))
