"""The step's state: one asserted ``TrainingState`` per unit and per root
([Note: step state] in ``fsdp_compose/_runtime/_unit.py``).

A wrong transition is a bug report naming the unit (or root) and both states; a
training step visits the states in FSDP2's order, manual finalization included.
Runs on torch's ``fake`` process group (collectives return at once)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest
import torch
from helpers import fake_process_group
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_compose
from fsdp_compose import fully_shard
from fsdp_compose._runtime._scheduler import Scheduler
from fsdp_compose._runtime._unit import UNIT_STEPS, TrainingState, Unit, check_step

S = TrainingState


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[TrainingState]]]:
    """Every transition of the root's step ("root") and of each unit (by name)."""
    seen: dict[str, list[TrainingState]] = {}
    root_enter, unit_enter = Scheduler._enter, Unit.enter

    def record_root(self: Scheduler, to: TrainingState) -> None:
        root_enter(self, to)
        seen.setdefault("root", []).append(to)

    def record_unit(self: Unit, to: TrainingState) -> None:
        unit_enter(self, to)
        seen.setdefault(self.name, []).append(to)

    monkeypatch.setattr(Scheduler, "_enter", record_root)
    monkeypatch.setattr(Unit, "enter", record_unit)
    with fake_process_group(4, 0):
        yield seen


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    mesh = init_device_mesh("cpu", (4,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def test_an_illegal_transition_names_the_root_and_both_states() -> None:
    scheduler = Scheduler([])
    with pytest.raises(AssertionError, match="the root went from IDLE to POST_BACKWARD"):
        scheduler.finalize_backward()  # an end of backward that never began
    with pytest.raises(AssertionError, match="unit 'block' went from FORWARD to PRE_BACKWARD"):
        check_step(UNIT_STEPS, "unit 'block'", S.FORWARD, S.PRE_BACKWARD)


def test_a_step_visits_the_states_in_order(recorded: dict[str, list[TrainingState]]) -> None:
    model = _model()
    for _ in range(2):
        model(torch.randn(2, 8)).sum().backward()
    step = [S.FORWARD, S.IDLE, S.PRE_BACKWARD, S.POST_BACKWARD, S.IDLE]
    assert recorded["root"] == 2 * step
    # Units: forward, then backward; the root's unit (no parameters of its own) is absent.
    unit_step = [S.FORWARD, S.IDLE, S.PRE_BACKWARD, S.POST_BACKWARD, S.IDLE]
    assert recorded["0"] == recorded["2"] == 2 * unit_step
    assert model._fsdp_state().scheduler.training_state is S.IDLE


def test_manual_finalization_states(recorded: dict[str, list[TrainingState]]) -> None:
    model = _model()
    model.set_manual_backward_finalization(True)
    for _ in range(2):  # gradient accumulation: backward leaves reductions to finalize
        model(torch.randn(2, 8)).sum().backward()
    handle = model.finalize_backward(async_op=True)
    with pytest.raises(RuntimeError, match="waited on before forward"):
        model(torch.randn(2, 8))
    assert handle is not None
    handle.wait()
    assert recorded["root"] == [
        *(S.FORWARD, S.IDLE, S.PRE_BACKWARD, S.POST_BACKWARD, S.AWAITING_FINALIZE),
        *(S.FORWARD, S.AWAITING_FINALIZE, S.PRE_BACKWARD, S.POST_BACKWARD, S.AWAITING_FINALIZE),
        S.REDUCTION_PENDING,
        S.IDLE,
    ]


def test_reset_returns_a_failed_step_to_idle(recorded: dict[str, list[TrainingState]]) -> None:
    model = _model()
    model(torch.randn(2, 8)).sum().backward()  # a complete step first
    fail = True

    def maybe_fail(grad: torch.Tensor) -> torch.Tensor:
        if fail:
            raise ValueError("boom")
        return grad

    # Backward fails between the two units: the root's step is left in PRE_BACKWARD.
    def hook_output(module: nn.Module, args: object, out: torch.Tensor) -> None:
        out.register_hook(maybe_fail)

    model[1].register_forward_hook(hook_output)
    with pytest.raises(ValueError, match="boom"):
        model(torch.randn(2, 8)).sum().backward()
    scheduler = model._fsdp_state().scheduler
    assert scheduler.training_state is S.PRE_BACKWARD
    with pytest.raises(RuntimeError, match="previous backward never finished"):
        model(torch.randn(2, 8))
    model.reset_iter_state()
    assert scheduler.training_state is S.IDLE
    fail = False
    model(torch.randn(2, 8)).sum().backward()  # the next step runs
    assert scheduler.training_state is S.IDLE


def test_the_public_fully_shard_documents_the_one_signature() -> None:
    """The public function shows the runtime's signature and documentation."""
    params = inspect.signature(fsdp_compose.fully_shard).parameters
    assert list(params)[:2] == ["module", "mesh"] and "observers" in params
    doc = fsdp_compose.fully_shard.__doc__ or ""
    assert "Args:" in doc and "reshard_after_forward" in doc and "torch's own policy" in doc
