"""The public surface: names, and compatibility with torch's FSDP2 API."""

from __future__ import annotations

import inspect

import pytest
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp._fully_shard as torch_fully_shard

import fsdp_compose

PUBLIC = {
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "ShardedGradScaler",
    "trace",
    "debug",
    "PipelineStage",
    "whole_matrix",
    "safetensors_io",
    "subclass_checkpoint",
    "auto_wrap",
    "DataParallelMeshDims",
    "plan",
    "ft",
    "enable_sharded_step",
    "Observer",
    "CollectiveInfo",
    "Annotation",
    "UnitInfo",
    "ParamInfo",
    "UnitOptionsInfo",
    "GatherInput",
    "AllGather",
    "ReduceScatter",
    "DefaultAllGather",
    "DefaultReduceScatter",
    "GradientReductionHandle",
    "cpu_offload_by_budget",
}
# FSDP2 methods missing from fsdp_compose (none left)
NOT_IMPLEMENTED: set[str] = set()
# Newer than the torch releases fsdp_compose targets, or private
IGNORED: set[str] = set()
# What releases newer than the oldest supported torch added to FSDP2's public
# surface (docs/fsdp2_compatibility.md): checked whatever torch is installed, while
# the comparison with the installed torch catches the next release's additions.
NEWER_FSDP2_METHODS = {
    "2.15": {"finalize_backward", "set_manual_backward_finalization", "set_keep_unsharded_storage"},
}
NEWER_FSDP2_NAMES = {
    "2.15": {"GradientReductionHandle"},
    "2.16": {"cpu_offload_by_budget"},  # torch main's draft
}


def test_public_names() -> None:
    assert set(fsdp_compose.__all__) == PUBLIC
    for name in fsdp_compose.__all__:
        assert getattr(fsdp_compose, name) is not None
        assert getattr(fsdp_compose, name).__doc__, f"{name} needs a docstring"


def test_whole_matrix_names() -> None:
    assert set(fsdp_compose.whole_matrix.__all__) == {"map_full_matrices", "matrix_owners"}
    for name in fsdp_compose.whole_matrix.__all__:
        assert getattr(fsdp_compose.whole_matrix, name).__doc__, name


def test_fully_shard_signature_matches_fsdp2() -> None:
    ours = inspect.signature(fsdp_compose.fully_shard).parameters
    theirs = inspect.signature(torch_fsdp.fully_shard).parameters
    for name, param in theirs.items():
        assert name in ours, name
        assert ours[name].kind == param.kind, name
        if param.default is not inspect.Parameter.empty and name not in (
            "mp_policy",
            "offload_policy",
        ):
            assert ours[name].default == param.default, name


def test_public_names_cover_fsdp2() -> None:
    theirs = set(torch_fully_shard.__all__).union(*NEWER_FSDP2_NAMES.values())
    missing = theirs - set(fsdp_compose.__all__)
    assert not missing, f"FSDP2 names missing from fsdp_compose: {sorted(missing)}"


def test_fsdp_module_methods_cover_fsdp2() -> None:
    theirs = {n for n in dir(torch_fsdp.FSDPModule) if not n.startswith("_")}
    theirs |= set().union(*NEWER_FSDP2_METHODS.values())
    ours = {n for n in dir(fsdp_compose.FSDPModule) if not n.startswith("_")}
    missing = theirs - ours - NOT_IMPLEMENTED - IGNORED
    assert not missing, f"FSDP2 methods missing from fsdp_compose.FSDPModule: {sorted(missing)}"
    for name in ours:
        assert getattr(fsdp_compose.FSDPModule, name).__doc__, (
            f"FSDPModule.{name} needs a docstring"
        )


def test_fsdp_module_signatures_match_fsdp2() -> None:
    def params(fn: object) -> list[tuple[str, object, object]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]  # type: ignore[arg-type]

    for name in (n for n in dir(torch_fsdp.FSDPModule) if not n.startswith("_")):
        theirs = params(getattr(torch_fsdp.FSDPModule, name))
        assert params(getattr(fsdp_compose.FSDPModule, name)) == theirs, name


def test_data_parallel_mesh_dims_is_torchs() -> None:
    # isinstance checks written against torch's class must accept ours; on a torch
    # without it (2.11), fsdp_compose's own has the same fields and refusal
    theirs = getattr(torch_fsdp, "DataParallelMeshDims", None)
    if theirs is not None:
        assert fsdp_compose.DataParallelMeshDims is theirs
    dims = fsdp_compose.DataParallelMeshDims(shard=("a", "b"), replicate="r")
    assert (dims.shard_names, dims.replicate_names) == (("a", "b"), ("r",))
    with pytest.raises(ValueError, match="At least one of shard or replicate"):
        fsdp_compose.DataParallelMeshDims()


def test_policies_are_frozen_dataclasses() -> None:
    import dataclasses

    for cls in (
        fsdp_compose.MixedPrecisionPolicy,
        fsdp_compose.OffloadPolicy,
        fsdp_compose.CPUOffloadPolicy,
    ):
        assert dataclasses.is_dataclass(cls)
        assert cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
