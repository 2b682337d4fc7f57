"""Which part of a (DTensor) tensor this rank holds.

[Note: which part of a tensor a rank reads]
A ``DTensor``'s local tensor on this rank is a box of the global tensor: one range
of indices per dim. The box is found by applying the placements to the global
shape: ``Shard(d)`` on a mesh dim of size ``m`` at coordinate ``k`` keeps chunk
``k`` of ``ceil(n / m)`` indices of the current range on ``d`` (``torch.chunk``
semantics: trailing chunks may be short or empty); ``Replicate()`` keeps the
range. ``_StridedShard(d, split_factor=s)``, which fsdp_compose puts on the
data-parallel mesh dim when tensor parallel already shards the same dim, is a
chunk *inside* the chunk that the later ``Shard(d)`` placements select, so it is
applied after them. The computed box is checked against the local tensor's shape
before anything is read. HSDP replicas compute the same box and read the same rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard


def local_box(shape: Iterable[int], mesh: Any, placements: Iterable[Any]) -> list[tuple[int, int]]:
    """The ``[start, stop)`` range per tensor dim of this rank's local tensor of a
    DTensor with global ``shape`` (see [Note: which part of a tensor a rank reads]).

    Raises:
        NotImplementedError: for placements other than ``Shard``, ``Replicate`` and
            a ``_StridedShard`` whose split factor is the product of the later
            ``Shard`` placements' mesh sizes on the same dim.
    """
    coord = mesh.get_coordinate()
    if coord is None:  # not part of the mesh: holds nothing
        return [(0, 0) for _ in shape]
    sizes = [mesh.size(i) for i in range(mesh.ndim)]
    return box_at(shape, sizes, placements, coord)


def box_at(
    shape: Iterable[int], mesh_sizes: list[int], placements: Iterable[Any], coord: Iterable[int]
) -> list[tuple[int, int]]:
    """:func:`local_box` of the rank at mesh coordinate ``coord`` of a mesh of
    ``mesh_sizes``."""
    box = [(0, int(n)) for n in shape]
    placements = list(placements)
    coord = list(coord)
    strided: list[int] = []
    for i, placement in enumerate(placements):
        if _is_strided(placement):
            strided.append(i)
        elif type(placement) is Shard:
            box = _take_chunk(box, placement.dim % len(box), mesh_sizes[i], coord[i])
        elif not isinstance(placement, Replicate):
            raise NotImplementedError(
                f"placement {placement} (only Shard and Replicate are supported)"
            )
    for i in strided:
        placement = placements[i]
        dim = placement.dim % len(box)
        # _StridedShard is a shard inside the chunks selected by the later Shard(dim)s.
        later = math.prod(
            mesh_sizes[j]
            for j in range(i + 1, len(placements))
            if type(placements[j]) is Shard and placements[j].dim % len(box) == dim
        )
        if later != placement.split_factor:
            raise NotImplementedError(
                f"placement {placement} on mesh dim {i}: split factor {placement.split_factor} is not the "
                f"size {later} of the later Shard({dim}) mesh dims"
            )
        box = _take_chunk(box, dim, mesh_sizes[i], coord[i])
    return box


def _is_strided(placement: Any) -> bool:
    # torch's _StridedShard is private; matched by name so that no private import is needed.
    return type(placement).__name__ == "_StridedShard"


def _take_chunk(
    box: list[tuple[int, int]], dim: int, parts: int, index: int
) -> list[tuple[int, int]]:
    start, stop = box[dim]
    n = stop - start
    chunk = math.ceil(n / parts) if n else 0
    a = start + min(index * chunk, n)
    b = start + min(index * chunk + chunk, n)
    out = list(box)
    out[dim] = (a, b)
    return out


def box_of(tensor: torch.Tensor) -> list[tuple[int, int]]:
    if isinstance(tensor, DTensor):
        return local_box(tensor.shape, tensor.device_mesh, tensor.placements)
    return [(0, int(n)) for n in tensor.shape]


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
