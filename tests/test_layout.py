"""Sharding layouts at 8 and 64 ranks, on torch's ``fake`` process-group backend.

One process plays one rank of a large world at a time (the fake backend's
collectives return without communicating), so the per-rank layout is checked
at world sizes no real test reaches, in milliseconds. Every expectation is
closed-form:

* the local shard of a ``Shard(0)`` parameter is ``torch.chunk(full, S)[s]`` for
  shard index ``s`` of ``S`` shards, and empty (``(0, *rest)``) for the ranks past
  the last chunk, the layout torch's FSDP2 and DTensor use
  (``compute_local_shape_and_global_offset`` is checked too);
* every shard is padded to ``ceil(dim0 / S)`` rows, so a unit's all-gather sends
  ``sum(ceil(dim0 / S) * rest)`` elements per rank and receives ``S`` times that,
  and its reduce-scatter is the mirror image;
* with HSDP (a ``(replicate, shard)`` mesh) the same holds on the shard dim, with
  the placements ``(Replicate(), Shard(0))`` and one all-reduce per unit over the
  replicas.

Values are real: fully_shard slices the local shards without communicating, so
they are compared exactly with the chunks of the unsharded parameter.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
from gpt import GPT, GPTConfig
from helpers import collective_log, fake_process_group
from models import TINY_GPT, OddShapes, Stack
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fsdp_compose import fully_shard

TINY = {**TINY_GPT, "n_layer": 2}


def _gpt() -> tuple[nn.Module, list[nn.Module], Callable[[nn.Module], torch.Tensor]]:
    model = GPT(GPTConfig(**TINY))
    idx = torch.zeros(1, 4, dtype=torch.long)
    return model, [*model.blocks, model], lambda m: m(idx).sum()


def _stack() -> tuple[nn.Module, list[nn.Module], Callable[[nn.Module], torch.Tensor]]:
    model = Stack(3)
    x = torch.ones(2, 13)
    return model, [*model.layers, model], lambda m: m(x).sum()


def _odd() -> tuple[nn.Module, list[nn.Module], Callable[[nn.Module], torch.Tensor]]:
    model = OddShapes()
    x = torch.ones(2, 13)
    return model, [model.a, model], lambda m: m(x).sum()


MODELS = {"gpt": _gpt, "stack": _stack, "odd_shapes": _odd}


def _ranks_to_check(world: int) -> list[int]:
    """Every rank at 8; at 64 the first, last and those around the chunk
    boundaries of the test models (where shards turn short, then empty)."""
    if world <= 8:
        return list(range(world))
    return sorted({0, 1, 6, 7, 12, 13, 31, 32, 33, 48, 49, world - 2, world - 1})


def _expected_local(full: torch.Tensor, shards: int, index: int) -> torch.Tensor:
    chunks = torch.chunk(full, shards, dim=0)
    if index < len(chunks):
        return chunks[index]
    return full.new_empty((0, *full.shape[1:]))


def _layout_at(model_name: str, world: int, rank: int, replicas: int) -> dict:
    """Shards the model as ``rank`` of ``world``, runs one forward and backward,
    and checks every parameter's layout and the unit collectives' sizes."""
    shards = world // replicas
    index = rank % shards  # this rank's position on the shard dim (mesh is row-major)
    torch.manual_seed(0)
    model, units, run = MODELS[model_name]()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    unit_names = [n for n, m in model.named_modules() if any(m is u for u in units)]
    with fake_process_group(world, rank):
        mesh = None
        if replicas > 1:
            mesh = init_device_mesh(
                "cpu", (replicas, shards), mesh_dim_names=("replicate", "shard")
            )
        for unit in units:
            fully_shard(unit, mesh=mesh)
        placements = (Replicate(), Shard(0)) if replicas > 1 else (Shard(0),)
        resolved_mesh = model._fsdp_state().unit.mesh_info.mesh  # every unit's
        empty = 0
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor), name
            assert p.placements == placements, (name, p.placements)
            assert p.shape == full[name].shape, (name, p.shape, full[name].shape)
            local, expected = p.to_local(), _expected_local(full[name], shards, index)
            assert local.shape == expected.shape, (name, rank, local.shape, expected.shape)
            assert torch.equal(local, expected), (name, rank, (local - expected).abs().max().item())
            # DTensor's own layout rule, on the mesh fully_shard resolved (not
            # p.device_mesh: torch 2.13 may hand back an equal mesh object from an
            # earlier process group of this process, whose rank is another one)
            shape, offset = compute_local_shape_and_global_offset(
                p.shape, resolved_mesh, p.placements
            )
            assert tuple(shape) == tuple(local.shape), (name, rank, shape, local.shape)
            if local.numel():
                rows = -(-full[name].shape[0] // shards)
                assert offset[0] == index * rows, (name, rank, offset)
            empty += local.numel() == 0

        # per unit: the padded row the all-gather sends and the reduce-scatter returns
        rows_per_unit = []
        for unit in units:
            fsdp_unit = unit._fsdp_state().unit
            row = 0
            for sp in fsdp_unit.params:
                rows = sp.orig_size[0]
                rest = math.prod(sp.orig_size[1:])
                assert sp.chunk_numel == -(-rows // shards) * rest, (
                    sp.fqn,
                    sp.chunk_numel,
                    rows,
                    rest,
                )
                row += sp.chunk_numel
            rows_per_unit.append(row)
        with collective_log(model) as log:
            run(model).backward()
        issued = [(i.kind, i.group_size, i.input_numel, i.output_numel) for i in log.issued]
    expected_ag = sorted(("all_gather", shards, r, shards * r) for r in rows_per_unit)
    expected_rs = sorted(("reduce_scatter", shards, shards * r, r) for r in rows_per_unit)
    return {
        # one size per unit (a unit is all-gathered once or twice per step)
        "all_gathers": sorted({c for c in issued if c[0] == "all_gather"}),
        "expected_all_gathers": sorted(set(expected_ag)),
        "reduce_scatters": sorted(c for c in issued if c[0] == "reduce_scatter"),
        "expected_reduce_scatters": expected_rs,
        "all_reduces": sorted(c for c in issued if c[0] == "all_reduce"),
        "expected_all_reduces": sorted(("all_reduce", replicas, r, r) for r in rows_per_unit)
        if replicas > 1
        else [],
        "empty_shards": empty,
        "unit_names": unit_names,
    }


# OddShapes returns a view (squeeze), which FSDP2 and fsdp_compose warn about.
@pytest.mark.filterwarnings("ignore:fully_shard module .* returned a view tensor")
@pytest.mark.parametrize("world, replicas", [(8, 1), (8, 2), (64, 1), (64, 4)])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_layout_on_fake_backend(model_name: str, world: int, replicas: int) -> None:
    for rank in _ranks_to_check(world):
        r = _layout_at(model_name, world, rank, replicas)
        for kind in ("all_gathers", "reduce_scatters", "all_reduces"):
            assert r[kind] == r[f"expected_{kind}"], (rank, kind, r[kind], r[f"expected_{kind}"])


def test_trailing_ranks_hold_empty_shards() -> None:
    """At 64 ranks most tiny-GPT parameters have fewer than 64 chunks: the ranks past
    a parameter's last chunk hold an empty shard of it (a (97, 32) embedding fills 49
    two-row chunks, the last one row; a (128, 32) weight fills all 64)."""
    world = 64
    rows = [p.shape[0] for p in GPT(GPTConfig(**TINY)).parameters()]

    def expected_empty(rank: int) -> int:
        return sum(rank * -(-n // world) >= n for n in rows)

    for rank in (0, 31, 32, 48, 49, 63):
        got = _layout_at("gpt", world, rank, 1)["empty_shards"]
        assert got == expected_empty(rank), (rank, got, expected_empty(rank))
    assert expected_empty(0) == 0 and 0 < expected_empty(48) < expected_empty(49) < len(rows)


def test_shard_placement_fn_dim1_layout() -> None:
    """``Shard(1)`` for the 2-D weights (dim 1 divisible by the world size): the
    local shard is the dim-1 chunk, the padded slot the exact chunk."""
    world = 8
    for rank in range(world):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 5), nn.Linear(5, 3))
        ref = copy.deepcopy(model)
        with fake_process_group(world, rank):
            fully_shard(
                model,
                shard_placement_fn=lambda p: (
                    Shard(1) if p.dim() == 2 and p.shape[1] % world == 0 else None
                ),
            )
            w = model[0].weight
            assert w.placements == (Shard(1),), w.placements
            expected = torch.chunk(ref[0].weight.detach(), world, dim=1)[rank]
            assert torch.equal(w.to_local(), expected), (rank, w.to_local().shape, expected.shape)
            b = model[1].weight  # dim 1 = 5: not divisible, falls back to Shard(0)
            assert b.placements == (Shard(0),), b.placements
            sp = next(s for s in model._fsdp_state().unit.params if s.orig_size == (5, 16))
            assert (sp.shard_dim, sp.chunk_numel) == (1, 5 * 2), (sp.shard_dim, sp.chunk_numel)
