"""torchtitan as a client: its models, parallelized by its own FSDP code
(``torchtitan.distributed.fsdp.apply_fsdp_to_decoder``), train for the same steps
with torch's FSDP2 and with fsdp_compose in its place, on 2 gloo ranks; the losses
and gradient norms must be bit-identical step by step. What the harness changes
for CPU, and how fsdp_compose takes FSDP2's place, is in ``titan_harness``.

On by default (when torchtitan is installed): the llama3 debug model under the
``partial_dtensor`` backend. Opt-in (``FSDP_COMPOSE_CLIENT_TESTS=1``, slower): the
llama3 model under ``full_dtensor`` and ``spmd_types`` and with
``enable_fsdp_symm_mem``, and the deepseek_v3 MoE debug
model with expert parallel 2 (experts on their own mesh through
``shard_placement_fn``'s ``ShardPlacementResult``).
"""

from __future__ import annotations

import os

import pytest
from dist_utils import DistPool, JobFailed, get_pool
from titan_harness import torchtitan_available, train

pytestmark = pytest.mark.skipif(
    not torchtitan_available(),
    reason="torchtitan is not installed (pip install torchtitan==0.3.0 spmd_types==0.2.3)",
)
_OPT_IN = pytest.mark.skipif(
    os.environ.get("FSDP_COMPOSE_CLIENT_TESTS") != "1",
    reason="slow torchtitan case: set FSDP_COMPOSE_CLIENT_TESTS=1 to run it",
)
WORLD = 2


@pytest.fixture
def pool() -> DistPool:
    # The session's ranks: the jobs leave torchtitan imported there, and nothing
    # else (the harness's patches end with each job).
    return get_pool(WORLD)


def _compare(pool: DistPool, steps: int, symm_mem: bool = False, **job) -> None:
    reference = pool.run(train, "fsdp2", steps=steps, timeout=900, **job)
    swapped = pool.run(train, "fsdp_compose", steps=steps, symm_mem=symm_mem, timeout=900, **job)
    for ref, got in zip(reference, swapped):
        assert ref["units"]["fsdp2"] > 0 and ref["units"]["fsdp_compose"] == 0
        assert got["units"]["fsdp_compose"] == ref["units"]["fsdp2"]
        assert got["units"]["fsdp2"] == 0
        assert len(got["losses"]) == steps
        assert got["losses"] == ref["losses"]  # bit-identical, step by step
        assert got["grad_norms"] == ref["grad_norms"]


def test_llama3_debug_model(pool: DistPool) -> None:
    _compare(pool, 10, model="llama3", spmd_backend="partial_dtensor", batch=1, seq_len=32)


@_OPT_IN
def test_llama3_full_dtensor(pool: DistPool) -> None:
    # dp_mesh_dims on torchtitan's dense storage mesh, parameters DTensors on it.
    _compare(pool, 10, model="llama3", spmd_backend="full_dtensor")


@_OPT_IN
def test_llama3_enable_fsdp_symm_mem(pool: DistPool) -> None:
    # torchtitan's enable_fsdp_symm_mem calls set_force_sum_reduction_for_comms and
    # set_symm_mem_for_comm on every unit: accepted, the same losses as FSDP2 without
    # it (FSDP2's symmetric memory needs CUDA, so its reference runs without).
    _compare(pool, 3, symm_mem=True, model="llama3", spmd_backend="partial_dtensor")


@_OPT_IN
def test_llama3_spmd_types(pool: DistPool) -> None:
    # Plain tensors annotated with SPMD types through dp_mesh_dims: torch's
    # fully_shard converts them only where it has the spmd_types bridge.
    try:
        pool.run(train, "fsdp2", steps=1, spmd_backend="spmd_types", timeout=900)
    except JobFailed as exc:
        if "must be DTensors on the full SPMD mesh" not in str(exc):
            raise
        pytest.skip(
            "this torch's fully_shard rejects plain (spmd_types-annotated) parameters with "
            "dp_mesh_dims; the spmd_types backend needs the bridge in torch main's fully_shard"
        )
    _compare(pool, 10, model="llama3", spmd_backend="spmd_types")


@_OPT_IN
def test_deepseek_v3_moe_expert_parallel(pool: DistPool) -> None:
    # ep=2: routed experts on the (efsdp, ep) mesh, the rest on fsdp; per-parameter
    # meshes from torch's _get_mesh_info and ShardPlacementResult.
    _compare(pool, 5, model="deepseek_v3", spmd_backend="partial_dtensor", ep=2)
