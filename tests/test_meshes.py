"""Meshes fully_shard builds: the data-parallel mesh of a full SPMD mesh is shared by
the units of one layout, and released with the model."""

from __future__ import annotations

import gc
import weakref

import torch.nn as nn
from helpers import fake_process_group
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

from fsdp_compose import DataParallelMeshDims, fully_shard


def _spmd_linear(mesh: DeviceMesh) -> nn.Linear:
    """A linear layer whose parameters are replicated DTensors on all of ``mesh``."""
    m = nn.Linear(4, 4)
    for name, p in list(m.named_parameters()):
        placements = [Replicate()] * mesh.ndim
        setattr(m, name, nn.Parameter(distribute_tensor(p.detach(), mesh, placements)))
    return m


def test_dp_mesh_shared_by_units_and_released_with_the_model() -> None:
    # HSDP over (r, s) of an (r, s, tp) mesh: fully_shard concatenates the r and s
    # sub-meshes into one data-parallel mesh.
    from fsdp_compose._runtime import _compat

    dims = DataParallelMeshDims(shard="s", replicate="r")
    with fake_process_group(8, 3):
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("r", "s", "tp"))
        units = [fully_shard(_spmd_linear(mesh), mesh=mesh, dp_mesh_dims=dims) for _ in range(2)]
        built = list(_compat._spmd_meshes.values())
        assert len(built) == 1, built  # one mesh for both units, though each sliced anew
        dp_mesh = weakref.ref(built[0])
        del units, built, mesh
        gc.collect()
        assert dp_mesh() is None, "the mesh cache keeps a dropped model's mesh alive"
        assert len(_compat._spmd_meshes) == 0
