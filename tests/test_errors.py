"""Bad input gets a clear, prompt exception (type and message asserted)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
from dist_utils import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from fsdp_compose import MixedPrecisionPolicy, fully_shard


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
