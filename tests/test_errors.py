"""Bad input gets a clear, prompt exception (type and message asserted), of
the type torch's FSDP2 raises for the same input."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn as nn
from dist_utils import run_distributed
from torch.distributed import fsdp as torch_fsdp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp._fully_shard import _fsdp_common
from torch.distributed.tensor import Shard

from fsdp_compose import MixedPrecisionPolicy, fully_shard

# FSDP2 features newer than torch 2.11 (the oldest release supported): where the
# installed torch lacks them, the comparisons with torch's own fully_shard are left out.
TORCH_HAS_DP_MESH_DIMS = hasattr(torch_fsdp, "DataParallelMeshDims")
TORCH_HAS_PLACEMENT_RESULT = hasattr(_fsdp_common, "ShardPlacementResult")


def test_no_process_group() -> None:
    # the pytest process itself has no default process group
    with pytest.raises(RuntimeError, match="init_process_group"):
        fully_shard(nn.Linear(2, 2))


def test_not_a_module() -> None:
    with pytest.raises(TypeError, match="expects an nn.Module or a list"):
        fully_shard(42)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="got int in the list"):
        fully_shard([nn.Linear(2, 2), 3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="empty list"):
        fully_shard([])


def test_dp_mesh_dims_needs_a_dim() -> None:
    from fsdp_compose import DataParallelMeshDims

    with pytest.raises(ValueError, match="At least one of shard or replicate"):
        DataParallelMeshDims()


def test_policy_validation() -> None:
    with pytest.raises(ValueError, match="floating-point"):
        MixedPrecisionPolicy(param_dtype=torch.int32)
    with pytest.raises(TypeError, match="torch.dtype"):
        MixedPrecisionPolicy(reduce_dtype="bf16")  # type: ignore[arg-type]


def _expect(fn, exc_type: type, pattern: str) -> str:
    try:
        fn()
    except exc_type as exc:
        message = str(exc)
        if not re.search(pattern, message):
            return f"message mismatch for /{pattern}/: {message}"
        return "ok"
    except Exception as exc:  # noqa: BLE001
        return f"wrong exception {type(exc).__name__}: {exc}"
    return f"no exception (expected {exc_type.__name__} /{pattern}/)"


def _errors_job() -> dict[str, str]:
    world = torch.distributed.get_world_size()
    results: dict[str, str] = {}

    def twice() -> None:
        m = nn.Linear(4, 4)
        fully_shard(m)
        fully_shard(m)

    results["twice"] = _expect(twice, ValueError, "already has fully_shard applied")
    for bad in ("yes", 0.5):
        results[f"raf_{bad}"] = _expect(
            lambda: fully_shard(nn.Linear(4, 4), reshard_after_forward=bad), ValueError,
            "reshard_after_forward must be None, a bool, or an int",
        )
    for bad in (0, 3, -2, 2 * world):
        results[f"raf_int_{bad}"] = _expect(
            lambda: fully_shard(nn.Linear(4, 4), reshard_after_forward=bad), ValueError,
            rf"reshard_after_forward={bad} is invalid.*factor of the shard world size {world}",
        )
    # As in FSDP2: 1 means False (with a warning), the shard world size means True.
    with pytest.warns(UserWarning, match="as reshard_after_forward=False"):
        one = fully_shard(nn.Linear(4, 4), reshard_after_forward=1)
    whole = fully_shard(nn.Linear(4, 4), reshard_after_forward=world)
    results["raf_int_1_and_world"] = (
        "ok" if (one._fsdp_state().unit.options.reshard_after_forward, whole._fsdp_state().unit.options.reshard_after_forward)
        == (False, True) else "1 / world not normalised to False / True"
    )
    results["mesh_type"] = _expect(
        lambda: fully_shard(nn.Linear(4, 4), mesh="cpu"), TypeError, "mesh to be a torch.distributed.DeviceMesh, got str"
    )
    mesh3d = init_device_mesh("cpu", (1, 1, world))
    results["mesh_3d"] = _expect(
        lambda: fully_shard(nn.Linear(4, 4), mesh=mesh3d), ValueError, "1-D mesh .* or a 2-D mesh .* 3-D"
    )
    unnamed = init_device_mesh("cpu", (1, world))
    results["hsdp_dims"] = _expect(
        lambda: fully_shard(nn.Linear(4, 4), mesh=unnamed), ValueError, r"mesh_dim_names=\(\"replicate\", \"shard\"\)"
    )

    def mixed_devices() -> None:
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta"))
        fully_shard(m)

    results["mixed_devices"] = _expect(mixed_devices, ValueError, "parameters on different devices")
    results["container"] = _expect(
        lambda: fully_shard(nn.ModuleList([nn.Linear(2, 2)])), ValueError, "cannot annotate a ModuleList"
    )

    def top_down() -> None:
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        fully_shard(m)
        fully_shard(m[0])

    results["top_down"] = _expect(top_down, ValueError, "bottom-up")

    def tied_across_units_other_dtype() -> None:
        # Tied weights across units are shared ([Note: shared parameters]), but
        # only between calls whose settings for the parameter agree.
        m = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
        m[1].weight = m[0].weight
        fully_shard(m[0], mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        fully_shard(m)

    results["tied"] = _expect(
        tied_across_units_other_dtype, ValueError,
        r"Linear\.weight .*Embedding\.weight .*share one parameter.*param_dtype",
    )

    class Scalar(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.s = nn.Parameter(torch.tensor(1.0))

    results["scalar"] = _expect(lambda: fully_shard(Scalar()), ValueError, "0-dim .*ignored_params")
    results["uneven_dim1"] = _expect(
        lambda: fully_shard(nn.Linear(3, 4), shard_placement_fn=lambda p: Shard(1)),
        NotImplementedError, "divisible by the shard world size",
    )

    def meta_forward() -> None:
        with torch.device("meta"):
            m = nn.Linear(4, 4)
        fully_shard(m)
        m(torch.randn(2, 4))

    results["meta_forward"] = _expect(meta_forward, RuntimeError, r"meta device.*to_empty")
    results["bad_policy_type"] = _expect(
        lambda: fully_shard(nn.Linear(4, 4), mp_policy=torch.bfloat16), TypeError,
        "mp_policy must be a MixedPrecisionPolicy",
    )
    return results


def test_bad_input_errors() -> None:
    for results in run_distributed(_errors_job, 2):
        failures = {k: v for k, v in results.items() if v != "ok"}
        assert not failures, failures


# -- FSDP2's exception types --------------------------------------------------


def _refusal_cases(shard) -> dict:
    """name -> a function taking ``fully_shard`` and making it refuse something."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    def _mesh(shape: tuple[int, ...]):
        return init_device_mesh("cpu", shape)

    def twice(fs):
        m = nn.Linear(4, 4)
        fs(m)
        fs(m)

    def deepcopy(fs):
        import copy

        copy.deepcopy(fs(nn.Linear(4, 4)))

    def reshard_not_bool(fs):
        fs(nn.Linear(4, 4)).set_reshard_after_forward(1)

    cases = {
        "uneven_dim1": lambda fs: fs(nn.Linear(3, 4), shard_placement_fn=lambda p: Shard(1)),
        "dim_out_of_range": lambda fs: fs(nn.Linear(4, 4), shard_placement_fn=lambda p: Shard(2)),
        "not_a_shard": lambda fs: fs(nn.Linear(4, 4), shard_placement_fn=lambda p: Replicate()),
        "twice": twice,
        "deepcopy": deepcopy,
        "scalar": lambda fs: fs(_Scalar()),
        "non_contiguous": lambda fs: fs(_non_contiguous()),
        "container": lambda fs: fs(nn.ModuleList([nn.Linear(2, 2)])),
        "reshard_int": lambda fs: fs(nn.Linear(4, 4), reshard_after_forward=3),
        "reshard_not_bool": reshard_not_bool,
        "mesh_3d": lambda fs: fs(nn.Linear(4, 4), mesh=shard),
        "mesh_2d_unnamed": lambda fs: fs(nn.Linear(4, 4), mesh=_mesh((1, 2))),
    }
    if TORCH_HAS_PLACEMENT_RESULT:
        cases["result_not_a_shard"] = lambda fs: fs(
            nn.Linear(4, 4),
            shard_placement_fn=lambda p: _fsdp_common.ShardPlacementResult(
                Replicate(), _fsdp_common.FSDPMeshInfo(_mesh((2,)), shard_mesh_dim=0)
            ),
        )
    if TORCH_HAS_DP_MESH_DIMS:
        cases.update(_spmd_refusal_cases())
    return cases


def _spmd_refusal_cases() -> dict:
    """Refusals of ``dp_mesh_dims`` (a full (dp, tp) mesh of 2 x 1 ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate

    from fsdp_compose import DataParallelMeshDims

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    dims = DataParallelMeshDims(shard="dp")

    def spmd_linear() -> nn.Module:
        return _distributed(nn.Linear(4, 4), mesh, [Replicate(), Replicate()])

    return {
        "spmd_plain_param": lambda fs: fs(nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=dims),
        "spmd_unknown_dim": lambda fs: fs(
            spmd_linear(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="fsdp")
        ),
        "spmd_reshard_int": lambda fs: fs(
            spmd_linear(), mesh=mesh, dp_mesh_dims=dims, reshard_after_forward=2
        ),
        "spmd_other_mesh": lambda fs: fs(
            spmd_linear(),
            mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "cp")),
            dp_mesh_dims=dims,
        ),
        "spmd_sharded_on_dp": lambda fs: fs(
            _distributed(nn.Linear(4, 4), mesh, [Shard(0), Replicate()]),
            mesh=mesh,
            dp_mesh_dims=dims,
        ),
    }


def _distributed(m: nn.Module, mesh: Any, placements: list) -> nn.Module:
    """``m`` with each parameter a DTensor on ``mesh`` with ``placements``."""
    from torch.distributed.tensor import distribute_tensor

    for name, p in list(m.named_parameters()):
        setattr(m, name, nn.Parameter(distribute_tensor(p.detach(), mesh, placements)))
    return m


# What torch's test_fully_shard_dtensor.py looks for in FSDP2's message (assertRaisesRegex).
_FSDP2_MESSAGES = {
    "spmd_plain_param": "must be DTensors",
    "spmd_unknown_dim": "not found in mesh.mesh_dim_names",
    "spmd_reshard_int": "reshard_after_forward as int",
    "spmd_other_mesh": "same mesh",
    "spmd_sharded_on_dp": "Expected Replicate",
}


def _non_contiguous() -> nn.Linear:
    m = nn.Linear(4, 6)
    m.weight = nn.Parameter(torch.randn(4, 6).t())
    return m


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
        if name in _FSDP2_MESSAGES:
            found = [re.search(_FSDP2_MESSAGES[name], str(e)) is not None for e in caught]
            out[name] += (found == [True, True], str(ours))
    return out


def test_refusals_raise_fsdp2_exception_types() -> None:
    # Each refusal is made by torch's FSDP2 and by fsdp_compose on the same input:
    # fsdp_compose's exception must be an instance of FSDP2's type.
    for r in run_distributed(_exception_types_job, 2):
        for name, (theirs, ours, ok, *message) in r.items():
            if message:  # torch's tests match FSDP2's message: fsdp_compose's matches too
                assert message[0], f"{name}: {_FSDP2_MESSAGES[name]!r} not in {message[1]!r}"
            if (name, theirs, ours) == ("not_a_shard", "AttributeError", "ValueError"):
                # torch 2.11's FSDP2 fails reading Replicate().dim; 2.13+ raise ValueError
                assert not TORCH_HAS_PLACEMENT_RESULT
                continue
            assert ok, f"{name}: FSDP2 raises {theirs}, fsdp_compose {ours}"
