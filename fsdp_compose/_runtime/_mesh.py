"""Which ranks a unit shards over and which it replicates over: a :class:`MeshInfo`,
resolved once per :func:`fully_shard` call from the user's ``DeviceMesh`` (1-D:
FSDP over all of its ranks; 2-D: ``(replicate, shard)``, HSDP), from which
everything downstream reads groups, sizes and ranks."""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DeviceMesh

from . import _compat

# Meshes and groups made on the default process group, cached per default group (a
# re-initialised one, or each rank-thread of torch's threaded test group, has its own).
_caches: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple[object, ...], object]] = (
    weakref.WeakKeyDictionary()
)


def _cache() -> dict[tuple[object, ...], object]:
    assert dist.group.WORLD is not None
    return _caches.setdefault(dist.group.WORLD, {})


try:  # torch >= 2.13: re-export torch's class, so isinstance checks agree
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:  # pragma: no cover - older torch

    @dataclass
    class DataParallelMeshDims:  # type: ignore[no-redef]
        """Names the data-parallel dims of a full SPMD :class:`DeviceMesh` whose
        parameters are already DTensors on it (``fully_shard(dp_mesh_dims=...)``).

        Attributes:
            shard (Optional[Union[str, Tuple[str, ...]]]): mesh dim name(s) that
                FSDP shards parameters over.
            replicate (Optional[Union[str, Tuple[str, ...]]]): mesh dim name(s)
                that HSDP replicates over.
        """

        shard: str | tuple[str, ...] | None = None
        replicate: str | tuple[str, ...] | None = None

        def __post_init__(self) -> None:
            if self.shard is None and self.replicate is None:
                raise ValueError(
                    "At least one of shard or replicate must be set in DataParallelMeshDims"
                )

        @property
        def shard_names(self) -> tuple[str, ...]:
            return _names(self.shard)

        @property
        def replicate_names(self) -> tuple[str, ...]:
            return _names(self.replicate)


@dataclass(frozen=True)
class SpmdLayout:
    """Where the data-parallel dims sit in a full SPMD mesh ([Note: dp_mesh_dims])."""

    mesh: DeviceMesh
    shard_dim: int
    replicate_dim: int | None

    @property
    def dp_dims(self) -> tuple[int, ...]:
        return tuple(d for d in (self.replicate_dim, self.shard_dim) if d is not None)


@dataclass(frozen=True, eq=False)
class MeshInfo:
    """The data-parallel layout of one unit."""

    mesh: DeviceMesh
    device: torch.device
    shard_group: dist.ProcessGroup
    shard_size: int
    shard_rank: int
    replicate_group: dist.ProcessGroup | None
    replicate_size: int
    # Set when fully_shard got a full SPMD mesh and dp_mesh_dims.
    spmd: SpmdLayout | None = field(default=None)

    @property
    def is_hsdp(self) -> bool:
        return self.replicate_group is not None

    @property
    def data_parallel_size(self) -> int:
        """Number of ranks whose gradients are averaged (shard x replicate)."""
        return self.shard_size * self.replicate_size


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over the default process group, on the backend's device type."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs an initialized default process group: call "
            "torch.distributed.init_process_group(...) (e.g. under torchrun) before "
            "fully_shard, or pass mesh=... explicitly."
        )
    backend = str(dist.get_backend()).lower()
    # "nccl" or a mixed "cpu:gloo,cuda:nccl" backend means the user trains on GPUs.
    device_type = "cuda" if "nccl" in backend and torch.cuda.is_available() else "cpu"
    cache, key = _cache(), ("mesh", device_type)
    mesh = cache.get(key)
    if mesh is None:
        # (A dry run may build the model under FakeTensorMode: the rank table stays real.)
        with _compat.outside_fake_mode():
            mesh = cache[key] = init_device_mesh(device_type, (dist.get_world_size(),))
    assert isinstance(mesh, DeviceMesh)
    return mesh


def device_of_mesh(mesh: DeviceMesh) -> torch.device:
    handle: Any = getattr(torch, mesh.device_type, None)
    if mesh.device_type == "cpu" or not hasattr(handle, "current_device"):
        return torch.device(mesh.device_type)
    return torch.device(mesh.device_type, handle.current_device())


# [Note: dp_mesh_dims]
# With ``dp_mesh_dims``, ``mesh`` is the full SPMD mesh (e.g. ("dp", "tp")) and every
# parameter a DTensor on it, ``Replicate()`` on the data-parallel dims. The unit
# communicates over the data-parallel sub-mesh (``mesh[shard]``, or (replicate, shard):
# HSDP) as for 2-D TP ([Note: tensor-parallel parameters]); its sharded parameters are
# DTensors on the full mesh, the other dim keeping its placement. Supported: one shard
# dim, at most one replicate dim and at most one other (model-parallel) dim.


def resolve_spmd_mesh_info(mesh: DeviceMesh, dims: Any) -> MeshInfo:
    """Validates a full SPMD ``mesh`` with ``dp_mesh_dims`` and resolves the unit's
    data-parallel layout on it (see [Note: dp_mesh_dims])."""
    if not isinstance(dims, DataParallelMeshDims):
        raise TypeError(
            "dp_mesh_dims must be a DataParallelMeshDims (from fsdp_compose or "
            f"torch.distributed.fsdp), got {type(dims).__name__}"
        )
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            "mesh must have mesh_dim_names when dp_mesh_dims is provided, e.g. "
            'init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))'
        )
    shard, rep = _names(dims.shard), _names(dims.replicate)
    for name in shard + rep:
        if name not in names:
            raise ValueError(
                f"Mesh dim name {name!r} of dp_mesh_dims not found in mesh.mesh_dim_names {names}"
            )
    if not shard:
        raise NotImplementedError(
            "dp_mesh_dims with replicate only (DDP) is not supported by fsdp_compose; name the "
            'dim to shard over, e.g. DataParallelMeshDims(shard="dp")'
        )
    if len(shard) > 1 or len(rep) > 1 or mesh.ndim - len(shard) - len(rep) > 1:
        raise NotImplementedError(
            "fsdp_compose supports dp_mesh_dims with one shard dim, at most one replicate dim and "
            f"at most one other dim; got {dims} on a mesh with dims {names}. Flatten data-parallel "
            'dims into one first, e.g. mesh[("dp_shard", "cp")]._flatten("dp_shard_cp").'
        )
    dp_mesh = _compat.concatenate_meshes(mesh[rep[0]], mesh[shard[0]]) if rep else mesh[shard[0]]
    info = resolve_mesh_info(dp_mesh)
    layout = SpmdLayout(mesh, names.index(shard[0]), names.index(rep[0]) if rep else None)
    return replace(info, spmd=layout)


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if value is None else (value,) if isinstance(value, str) else tuple(value)


def resolve_mesh_info(mesh: DeviceMesh) -> MeshInfo:
    """Validates ``mesh`` for fully_shard and resolves its groups for this rank."""
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: a 1-D mesh (FSDP) or a "
            f"2-D mesh (replicate, shard) for HSDP, not a {mesh.ndim}-D mesh. For FSDP + tensor "
            'parallel, pass the data-parallel sub-mesh, e.g. mesh["dp"].'
        )
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"this rank ({dist.get_rank()}) is not part of the mesh {mesh}")
    hsdp = mesh.ndim == 2
    return MeshInfo(
        mesh=mesh,
        device=device_of_mesh(mesh),
        shard_group=mesh.get_group(mesh.ndim - 1),
        shard_size=mesh.size(mesh.ndim - 1),
        shard_rank=coordinate[-1],
        replicate_group=mesh.get_group(0) if hsdp else None,
        replicate_size=mesh.size(0) if hsdp else 1,
    )


def validate_reshard_after_forward(value: object, shard_size: int) -> bool | int:
    """``reshard_after_forward`` checked and normalised as in FSDP2: None -> True (the
    root's is resolved at lazy init); an int must divide the shard world size, 1 means
    ``False`` (with a warning) and the shard world size ``True``."""
    if value is None or isinstance(value, bool):
        return True if value is None else value
    if not isinstance(value, int):
        raise ValueError(
            "reshard_after_forward must be None, a bool, or an int group size, "
            f"got {value!r} ({type(value).__name__})"
        )
    if not 1 <= value <= shard_size or shard_size % value != 0:
        divisors = [d for d in range(1, shard_size + 1) if shard_size % d == 0]
        raise ValueError(
            f"reshard_after_forward={value} is invalid: an int N reshards parameters to groups "
            f"of N ranks after forward and must be a factor of the shard world size {shard_size} "
            f"(valid here: {divisors}). Use True to fully reshard or False to keep them unsharded."
        )
    if value == 1:
        warnings.warn(
            "reshard_after_forward=1 (int) reshards to groups of one rank, i.e. keeps parameters "
            "unsharded, as reshard_after_forward=False; it does not mean True.",
            stacklevel=3,
        )
        return False
    return True if value == shard_size else value


def post_forward_subgroup(info: MeshInfo, group_size: int) -> tuple[dist.ProcessGroup, int]:
    """The group of ``group_size`` consecutive shard ranks this rank reshards to after
    forward (``reshard_after_forward=int``), and this rank's index in it (created by
    the member ranks only, so also from a sub-mesh such as dp of dp x tp)."""
    shard_ranks = dist.get_process_group_ranks(info.shard_group)
    start = (info.shard_rank // group_size) * group_size
    group = _subgroup("post_forward", shard_ranks[start : start + group_size])
    return group, info.shard_rank - start


def separate_reduce_scatter_group(info: MeshInfo) -> dist.ProcessGroup:
    """A second process group over this unit's shard ranks for reduce-scatters only
    (``set_separate_reduce_scatter_group``), shared by units with the same ranks."""
    return _subgroup("reduce_scatter", dist.get_process_group_ranks(info.shard_group))


def _subgroup(purpose: str, members: list[int]) -> dist.ProcessGroup:
    """The cached group of ``members`` for ``purpose`` (only member ranks call)."""
    cache, key = _cache(), (purpose, *members)
    group = cache.get(key)
    if group is None:
        group = cache[key] = dist.new_group(members, use_local_synchronization=True)
    assert isinstance(group, dist.ProcessGroup)
    return group
