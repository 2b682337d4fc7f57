"""The public ``fully_shard``: the runtime's annotator with fsdp_compose's checks.

It is FSDP2's ``fully_shard`` (``fsdp_compose._runtime``) with fsdp_compose's checks
passed to every call as observers (:func:`fsdp_compose._checks.observers`, see
[Note: checks beyond FSDP2]), and torch's own policy objects accepted in place of
fsdp_compose's, so that an FSDP2 program runs with only its ``fully_shard`` import
changed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any, overload

import torch
import torch.nn as nn
from torch.distributed import fsdp as torch_fsdp
from torch.distributed.tensor import DeviceMesh, Shard

from . import _checks, _runtime
from ._runtime import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
)

__all__ = ["fully_shard"]


@overload
def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
) -> FSDPModule: ...


@overload
def fully_shard(
    module: list[nn.Module],
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
) -> list[FSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> Any:
    """Shards ``module``'s parameters across the data-parallel ranks of ``mesh``.

    Each call makes one *unit* of the parameters of ``module``'s subtree that no
    earlier call on a submodule manages, so call it bottom-up (blocks first, then
    the root). In place, each becomes an ``nn.Parameter`` wrapping a
    :class:`DTensor` sharded on dim 0 (``(Replicate(), Shard(0))`` on a 2-D HSDP
    mesh), so names, ``state_dict()`` keys and the module tree are unchanged, and
    the module's class becomes a subclass of :class:`FSDPModule` and of its
    original class. Build the optimizer after sharding.

    A unit all-gathers its parameters with one collective before its forward,
    frees them after forward if ``reshard_after_forward``, gathers them again for
    backward, and reduce-scatters its gradients (averaged over the data-parallel
    ranks) with one collective once its backward is done. The root waits for
    every reduction before ``backward()`` returns.

    Args:
        module (Union[nn.Module, List[nn.Module]]): the module to shard, or several
            modules to group as one unit (communicated together).
        mesh (Optional[DeviceMesh]): a 1-D mesh shards over all of its ranks; a 2-D
            mesh ``(replicate, shard)`` shards over dim 1 and replicates over dim 0
            (HSDP). Its device type is the device parameters live on. Defaults to a
            1-D mesh over the default process group on its backend's device.
        reshard_after_forward (Optional[Union[bool, int]]): ``True`` frees the
            unsharded parameters after forward; ``False`` keeps them until after
            backward; an ``int`` N dividing the shard world size keeps 1/N of them,
            so backward gathers within groups of N ranks (1 means ``False``, with a
            warning); ``None`` means ``True`` except for the root.
        shard_placement_fn (Optional[Callable[[nn.Parameter], Optional[Shard]]]):
            chooses the sharded dim per parameter (``None`` means ``Shard(0)``); a
            dim other than 0 must divide evenly. A ``ShardPlacementResult(placement,
            mesh_info)`` shards the parameter over ``mesh_info.mesh`` instead
            ([Note: per-parameter meshes]).
        mp_policy (MixedPrecisionPolicy): mixed precision for this unit.
        offload_policy (OffloadPolicy): :class:`CPUOffloadPolicy` keeps sharded
            parameters, gradients and optimizer states in host memory.
        ignored_params (Optional[Set[nn.Parameter]]): parameters left as they are:
            not sharded, not moved, not reduced.
        dp_mesh_dims (Optional[DataParallelMeshDims]): when given, ``mesh`` is the
            full SPMD mesh (e.g. dims ``("dp", "tp")``) and every parameter a
            DTensor on it, ``Replicate()`` on the data-parallel dims; parameters are
            sharded over the dim named ``shard`` ([Note: dp_mesh_dims]).

    Returns:
        The same module (or list), now an :class:`FSDPModule`.
    """
    mp_policy, offload_policy = _adopt_torch_policies(mp_policy, offload_policy)  # type: ignore[assignment]
    return _runtime.fully_shard(
        module,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=ignored_params,
        dp_mesh_dims=dp_mesh_dims,
        observers=_checks.observers(),
    )


def _adopt_torch_policies(mp_policy: object, offload_policy: object) -> tuple[object, object]:
    """fsdp_compose's equivalents of ``torch.distributed.fsdp`` policies (so an FSDP2
    program runs with only ``fully_shard``'s import changed); others are returned as is."""
    if isinstance(mp_policy, torch_fsdp.MixedPrecisionPolicy):
        values = {f.name: getattr(mp_policy, f.name) for f in fields(mp_policy)}
        unknown = sorted(set(values) - {f.name for f in fields(MixedPrecisionPolicy)})
        if unknown:
            raise NotImplementedError(
                f"torch {torch.__version__}'s MixedPrecisionPolicy has fields {unknown} that "
                "this fsdp_compose does not know; use fsdp_compose.MixedPrecisionPolicy"
            )
        mp_policy = MixedPrecisionPolicy(**values)
    if isinstance(offload_policy, torch_fsdp.CPUOffloadPolicy):
        offload_policy = CPUOffloadPolicy(pin_memory=offload_policy.pin_memory)
    elif type(offload_policy) is torch_fsdp.OffloadPolicy:
        offload_policy = OffloadPolicy()
    return mp_policy, offload_policy
