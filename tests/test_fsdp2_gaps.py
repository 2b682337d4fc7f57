"""FSDP2 API gaps real clients hit (issue 21): communication-allocator settings,
FSDP2's exception types, ``dp_mesh_dims`` on a full SPMD mesh."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
from dist_utils import run_distributed

from fsdp_compose import fully_shard


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _train(model: nn.Module, steps: int = 2) -> list[float]:
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + torch.distributed.get_rank())
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _comm_allocator_job() -> dict:
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Collect(level=logging.WARNING)
    logger = logging.getLogger("fsdp_compose")
    logger.addHandler(handler)
    try:
        plain = _mlp()
        fully_shard(plain[0])
        fully_shard(plain)
        tuned = _mlp()
        fully_shard(tuned[0])
        fully_shard(tuned)
        for _ in range(2):  # a second call on the same or another module adds no note
            tuned.set_symm_mem_for_comm()
            tuned[0].set_allocate_memory_from_process_group_for_comm(True)
        tuned.set_allocate_memory_from_process_group_for_comm(False)  # the default: silent
        errors = []
        for call in (
            lambda: tuned.set_symm_mem_for_comm("NVSHMEM"),
            lambda: tuned.set_allocate_memory_from_process_group_for_comm(1),  # type: ignore[arg-type]
        ):
            try:
                call()
            except (TypeError, ValueError) as exc:
                errors.append(type(exc).__name__)
        return {
            "notes": [r.getMessage() for r in records],
            "errors": errors,
            "same": _train(plain) == _train(tuned),
        }
    finally:
        logger.removeHandler(handler)


def test_comm_allocator_settings_accepted_with_one_note() -> None:
    for r in run_distributed(_comm_allocator_job, 2):
        assert r["same"]
        assert r["errors"] == ["ValueError", "TypeError"]
        assert len(r["notes"]) == 2, r["notes"]
        assert "set_symm_mem_for_comm()" in r["notes"][0] and "gloo/CPU" in r["notes"][0]
        assert "set_allocate_memory_from_process_group_for_comm(True)" in r["notes"][1]


def _refusal_cases(shard) -> dict:
    """name -> a function taking ``fully_shard`` and making it refuse something."""
    from torch.distributed.tensor import Replicate, Shard

    def twice(fs):
        m = nn.Linear(4, 4)
        fs(m)
        fs(m)

    def deepcopy(fs):
        import copy

        copy.deepcopy(fs(nn.Linear(4, 4)))

    def reshard_not_bool(fs):
        fs(nn.Linear(4, 4)).set_reshard_after_forward(1)

    return {
        "uneven_dim1": lambda fs: fs(nn.Linear(3, 4), shard_placement_fn=lambda p: Shard(1)),
        "dim_out_of_range": lambda fs: fs(nn.Linear(4, 4), shard_placement_fn=lambda p: Shard(2)),
        "not_a_shard": lambda fs: fs(nn.Linear(4, 4), shard_placement_fn=lambda p: Replicate()),
        "twice": twice,
        "deepcopy": deepcopy,
        "scalar": lambda fs: fs(_Scalar()),
        "container": lambda fs: fs(nn.ModuleList([nn.Linear(2, 2)])),
        "reshard_int": lambda fs: fs(nn.Linear(4, 4), reshard_after_forward=3),
        "reshard_not_bool": reshard_not_bool,
        "mesh_3d": lambda fs: fs(nn.Linear(4, 4), mesh=shard),
    }


class _Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.tensor(1.0))


def _exception_types_job() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh_3d = init_device_mesh("cpu", (1, 1, 2))
    out = {}
    for name, case in _refusal_cases(mesh_3d).items():
        caught = []
        for fs in (torch_fully_shard, fully_shard):
            try:
                case(fs)
                caught.append(None)
            except Exception as exc:  # noqa: BLE001 - compared below
                caught.append(exc)
        theirs, ours = caught
        out[name] = (
            type(theirs).__name__ if theirs is not None else None,
            type(ours).__name__ if ours is not None else None,
            theirs is not None and isinstance(ours, type(theirs)),
        )
    return out


def test_refusals_raise_fsdp2_exception_types() -> None:
    # Each refusal is made by torch's FSDP2 and by fsdp_compose on the same input:
    # fsdp_compose's exception must be an instance of FSDP2's type.
    for r in run_distributed(_exception_types_job, 2):
        for name, (theirs, ours, ok) in r.items():
            assert ok, f"{name}: FSDP2 raises {theirs}, fsdp_compose {ours}"
