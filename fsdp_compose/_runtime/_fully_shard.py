"""The annotator: ``fully_shard`` turns a module into a unit, in place. It collects
the parameters the call manages (those of the module's subtree not owned by a
nested ``fully_shard`` or ignored), replaces each by a sharded DTensor parameter,
attaches the hooks, and mixes :class:`FSDPModule` into the module's class."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, overload

import torch
import torch.nn as nn
from torch.distributed.tensor import DeviceMesh, Shard

from . import _compat, _ownership, _shared
from ._errors import FSDPValueError
from ._events import Annotation, Events, Observer
from ._fsdp_module import FSDPModule, fsdp_class_of
from ._hooks import UnitState, state_of
from ._mesh import (
    DataParallelMeshDims,
    MeshInfo,
    default_mesh,
    resolve_mesh_info,
    resolve_spmd_mesh_info,
    validate_reshard_after_forward,
)
from ._policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._sharded_param import ShardedParam
from ._state_dict import register_state_dict_hooks
from ._unit import Unit

__all__ = ["describe_modules", "fully_shard"]


@overload
def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy | Mapping[str, OffloadPolicy] = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
    observers: Iterable[Observer] = ...,
) -> FSDPModule: ...


@overload
def fully_shard(
    module: list[nn.Module],
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy | Mapping[str, OffloadPolicy] = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
    observers: Iterable[Observer] = ...,
) -> list[FSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy | Mapping[str, OffloadPolicy] = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
    observers: Iterable[Observer] = (),
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

    ``fsdp_compose.fully_shard`` is this function with fsdp_compose's checks beyond
    FSDP2's subscribed before ``observers`` ([Note: checks beyond FSDP2]), and
    accepts torch's own policy objects (``torch.distributed.fsdp``'s
    ``MixedPrecisionPolicy``, ``OffloadPolicy``, ``CPUOffloadPolicy``) in place of
    fsdp_compose's, so that an FSDP2 program runs with only its ``fully_shard``
    import changed.

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
        offload_policy (Union[OffloadPolicy, Mapping[str, OffloadPolicy]]):
            :class:`CPUOffloadPolicy` keeps sharded parameters, gradients and
            optimizer states in host memory. A mapping from parameter FQN (relative
            to ``module``) to policy offloads per parameter, as torch's draft for
            FSDP2 does: parameters it does not name are not offloaded, and a name
            that is not a parameter this call manages raises ``ValueError``
            ([Note: per-parameter offload]; :func:`fsdp_compose.cpu_offload_by_budget`
            builds one).
        ignored_params (Optional[Set[nn.Parameter]]): parameters left as they are:
            not sharded, not moved, not reduced.
        dp_mesh_dims (Optional[DataParallelMeshDims]): when given, ``mesh`` is the
            full SPMD mesh (e.g. dims ``("dp", "tp")``) and every parameter a
            DTensor on it, ``Replicate()`` on the data-parallel dims; parameters are
            sharded over the dim named ``shard`` ([Note: dp_mesh_dims]).
        observers (Iterable[Observer]): beyond FSDP2: :class:`fsdp_compose.Observer`
            objects subscribed to the new unit's events (the whole tree's once a
            root runs forward); each first sees the call (``on_annotate``) before
            anything changes, and may refuse it by raising.

    Returns:
        The same module (or list), now an :class:`FSDPModule`.
    """
    modules = _validate_modules(module)
    ignored = _validate_ignored_params(ignored_params)
    mesh = default_mesh() if mesh is None else mesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"fully_shard expects mesh to be a torch.distributed.DeviceMesh, got {type(mesh).__name__}"
        )
    if dp_mesh_dims is None:
        mesh_info = resolve_mesh_info(mesh)
        if mesh.ndim == 2 and mesh.mesh_dim_names is None:  # FSDP2: an AssertionError
            raise FSDPValueError(  # see [Note: FSDP2's exception types]
                "Please init the 2D mesh for HSDP with mesh_dim_names specified: "
                f"fully_shard got a 2-D mesh without mesh_dim_names ({mesh}); build it with "
                'mesh_dim_names=("replicate", "shard") (dim 0 replicates, dim 1 shards).'
            )
    else:  # a full SPMD mesh, see [Note: dp_mesh_dims]
        mesh_info = resolve_spmd_mesh_info(mesh, dp_mesh_dims)
        if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
            raise NotImplementedError(
                "reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims), "
                "as in FSDP2; pass True or False"
            )
    reshard = validate_reshard_after_forward(reshard_after_forward, mesh_info.shard_size)

    # [Note: atomic fully_shard] Everything that can fail (the observers' checks of the
    # call included) runs before the module changes: shards are built aside and installed
    # once every parameter and unit is valid, so a failed call leaves the module as it
    # was, and a retry (with the fix the error names) starts from a clean module.
    managed = _managed_modules(modules)
    policies = (mp_policy, offload_policy, shard_placement_fn)
    owners = _managed_params(managed, ignored)
    events = Events(observers)
    if events.on_annotate:  # copies: an observer cannot change what this call does
        view = MappingProxyType({p: tuple(o) for p, o in owners.items()})
        offload = offload_policy  # (a per-parameter mapping: a copy too)
        if isinstance(offload, Mapping):
            offload = MappingProxyType(dict(offload))
        call = Annotation(
            modules, tuple(managed), frozenset(ignored), view, mesh_info, mp_policy, offload,
            shard_placement_fn,
        )  # fmt: skip
        events.annotate(call)
    # Parameters another unit already sharded: borrowed ([Note: shared parameters]).
    borrowed = _shared.collect_borrowed(managed, ignored, mesh_info, mp_policy, offload_policy)
    units, sharded = _build_units(
        modules, owners, mesh_info, reshard, reshard_after_forward, policies, events
    )
    unit_of = {id(p): u for u in units for p in u.params}
    # Validated: from here on the module changes.
    unit_label = describe_modules(modules)
    _move_buffers(managed, mesh_info.device)
    for holder in managed:  # left plain on purpose, not forgotten
        for name, param in holder._parameters.items():
            if param is not None and param in ignored:
                _ownership.record_ignored(param, holder, name, unit_label)
    for param, sharded_param in zip(owners, sharded):
        sharded_param.register(sharded_param.sharded_param)
        sharded_param.mark_owned(unit_label)
        _ownership.record_replaced(param, unit_label)
    # (reshard_after_forward None: the root keeps its parameters)
    state = UnitState(modules, units, mp_policy, reshard_after_forward is None, events)
    state.adopt_subtree_settings()
    for unit in units:
        register_state_dict_hooks(unit, state)
    replaced = [(p, sp, unit_of[id(sp)]) for p, sp in zip(owners, sharded)]
    _shared.install(state, replaced, borrowed)
    for m in modules:
        _compat.register_fully_shard(m)
        m.__class__ = fsdp_class_of(type(m))
    return module


def _build_units(
    modules: tuple[nn.Module, ...],
    owners: dict[nn.Parameter, list[tuple[nn.Module, str]]],
    mesh_info: MeshInfo,
    reshard: bool | int,
    reshard_after_forward: bool | int | None,
    policies: tuple[MixedPrecisionPolicy, OffloadPolicy | Mapping[str, OffloadPolicy], Any],
    events: Events,
) -> tuple[list[Unit], list[ShardedParam]]:
    """The call's sharded parameters (in ``owners``' order) and its units, reporting
    to ``events``: one per data-parallel mesh, see [Note: per-parameter meshes].
    Nothing is installed."""
    mp_policy, offload_policy, shard_placement_fn = policies
    device = mesh_info.device
    offloads = _offload_policies(offload_policy, modules, owners)
    sharded: list[ShardedParam] = []
    groups: dict[MeshInfo, list[ShardedParam]] = {mesh_info: []}
    meshes = {
        None: mesh_info,
        (id(mesh_info.shard_group), id(mesh_info.replicate_group)): mesh_info,
    }
    for param, param_owners in owners.items():
        shard_dim, param_mesh_info = _placement(shard_placement_fn, param, param_owners, meshes)
        offload = isinstance(offloads[param], CPUOffloadPolicy) and device.type != "cpu"
        host = torch.device("cpu") if offload else None
        pin = offload and getattr(offloads[param], "pin_memory", False)
        sharded_param = ShardedParam(
            param, param_owners, param_mesh_info, shard_dim, device, host, pin
        )
        sharded_param.param_dtype = mp_policy._resolve_for_param(param).param_dtype
        sharded.append(sharded_param)
        groups.setdefault(param_mesh_info, []).append(sharded_param)
    units = [
        Unit(
            group,
            modules,
            info,
            reshard
            if info is mesh_info
            else validate_reshard_after_forward(reshard_after_forward, info.shard_size),
            mp_policy,
            events,
        )
        for info, group in groups.items()
        if group
    ]
    return units, sharded


# [Note: per-parameter offload]
# ``offload_policy`` may map parameter FQNs (relative to the module passed to
# ``fully_shard``; for a list, to the listed module holding the parameter) to policies,
# as torch's draft for FSDP2 does. The mapping is resolved here, once, to one policy
# per managed parameter, before anything is built: each sharded parameter then lives
# on the host or on the device, and the rest of the runtime already works per
# parameter (the all-gather's copy-in moves each shard to the device, the reduction
# moves each gradient shard back), so a unit may mix offloaded and resident
# parameters. A unit reports ``offload`` when any of its parameters is offloaded.
# Parameters of submodules an earlier ``fully_shard`` call manages took their policy
# from that call: a key naming one is an error, as is a key naming no parameter.


def _offload_policies(
    offload_policy: OffloadPolicy | Mapping[str, OffloadPolicy],
    modules: tuple[nn.Module, ...],
    owners: dict[nn.Parameter, list[tuple[nn.Module, str]]],
) -> dict[nn.Parameter, OffloadPolicy]:
    """Each parameter of ``owners`` with its offload policy ([Note: per-parameter offload])."""
    if not isinstance(offload_policy, Mapping):
        return dict.fromkeys(owners, offload_policy)
    named: dict[str, dict[int, nn.Parameter]] = {}  # this call's parameters by FQN (all names)
    for m in modules:
        for fqn, p in m.named_parameters(remove_duplicate=False):
            if p in owners:
                named.setdefault(fqn, {})[id(p)] = p
    resolved: dict[nn.Parameter, OffloadPolicy] = dict.fromkeys(owners, OffloadPolicy())
    for fqn, policy in offload_policy.items():
        found = list(named.get(fqn, {}).values())
        if len(found) != 1:
            what = "several listed modules' parameters" if found else "no parameter it manages"
            raise ValueError(
                f"fully_shard's offload_policy names {fqn!r}, {what}: its keys are the FQNs of "
                "this call's parameters relative to the module passed to fully_shard (those of "
                "submodules already passed to fully_shard take that call's policy), e.g. "
                f"{sorted(named)[:4]}"
            )
        resolved[found[0]] = policy
    return resolved


def describe_modules(modules: tuple[nn.Module, ...]) -> str:
    """The class names of a ``fully_shard`` call's modules (its unit's label)."""
    return ", ".join(type(m).__name__ for m in modules)


def _validate_modules(module: object) -> tuple[nn.Module, ...]:
    candidates = (module,) if isinstance(module, nn.Module) else module
    if not isinstance(candidates, (list, tuple)):
        raise TypeError(
            f"fully_shard expects an nn.Module or a list of nn.Modules, got {type(module).__name__}"
        )
    if not candidates:
        raise ValueError("fully_shard got an empty list of modules")
    for m in candidates:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects nn.Module(s), got {type(m).__name__} in the list")
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(
                "fully_shard does not support containers that do not implement forward: "
                f"fully_shard cannot annotate a {type(m).__name__} container (no hook would "
                "run). Annotate its elements (e.g. each block) instead."
            )
        if state_of(m) is not None:
            raise FSDPValueError(  # see [Note: FSDP2's exception types]
                "Each distinct composable distributed API can only be applied to a module "
                f"once. {type(m).__name__} already has fully_shard applied; change its settings "
                "with the FSDPModule.set_* methods."
            )
    modules: list[nn.Module] = list(dict.fromkeys(candidates))  # type: ignore[arg-type]
    # Drop modules nested inside other listed modules (their parent covers them).
    nested = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    return tuple(m for m in modules if id(m) not in nested)


def _validate_ignored_params(ignored: object) -> set[nn.Parameter]:
    # (As in FSDP2, parameters outside the module are not this call's: one set may serve all.)
    if ignored is None:
        return set()
    if not isinstance(ignored, Iterable) or isinstance(ignored, torch.Tensor):
        raise TypeError("ignored_params must be a set of nn.Parameters")
    params = set(ignored)
    wrong = [type(p).__name__ for p in params if not isinstance(p, torch.Tensor)]
    if wrong:
        raise TypeError(f"ignored_params must contain parameters, got {wrong[0]}")
    return params


def _managed_modules(modules: tuple[nn.Module, ...]) -> list[nn.Module]:
    """Modules whose parameters this call manages: the subtrees of ``modules``
    minus subtrees already annotated by an earlier (nested) call."""
    managed: dict[nn.Module, None] = {}  # in pre-order

    def visit(m: nn.Module) -> None:
        if _compat.replicated_by_torch(m):  # as FSDP2 ([Note: torch's composable-API registry])
            return
        managed[m] = None
        for child in m.children():
            if child not in managed and state_of(child) is None:
                visit(child)

    for m in modules:
        if m not in managed:
            visit(m)
    return list(managed)


def _managed_params(
    modules: list[nn.Module], ignored: set[nn.Parameter]
) -> dict[nn.Parameter, list[tuple[nn.Module, str]]]:
    owners: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
    for m in modules:
        for name, p in m._parameters.items():
            if p is None or p in ignored or _shared.is_borrowed(p, m, name):
                continue  # shared with an earlier unit: [Note: shared parameters]
            # (already sharded: refused by check_call; DTensors: validated by ShardedParam)
            owners.setdefault(p, []).append((m, name))
    return owners


def _move_buffers(modules: list[nn.Module], device: torch.device) -> None:
    # Buffers follow the mesh's device (CPU offload concerns parameters and gradients).
    for m in modules:
        for name, b in m._buffers.items():
            if b is not None and not b.is_meta and b.device != device:
                m._buffers[name] = b.to(device)


# [Note: per-parameter meshes]
# ``shard_placement_fn`` may return FSDP2's ``ShardPlacementResult`` (a placement and a
# torch ``FSDPMeshInfo``) to shard a parameter on its own mesh (e.g. MoE experts on an
# expert-data-parallel mesh). The call then makes one unit per mesh, all owned by its
# ``UnitState``, whose hooks gather and reduce them together: every unit's collective
# is issued before any is waited on, so that the meshes' collectives overlap.


def _param_mesh(torch_mesh_info: Any, where: str, meshes: dict[Any, MeshInfo]) -> MeshInfo:
    """The :class:`MeshInfo` of a mesh ``shard_placement_fn`` names, one per set of
    process groups in ``meshes`` (parameters on the same groups share a unit);
    ``meshes[None]`` is fully_shard's own."""
    mesh, default = getattr(torch_mesh_info, "mesh", None), meshes[None]
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"shard_placement_fn returned a ShardPlacementResult for {where} whose mesh_info has "
            f"no DeviceMesh (got {type(torch_mesh_info).__name__}); build it as FSDPMeshInfo("
            "mesh, shard_mesh_dim=0) or HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)"
        )
    shard_dim = getattr(torch_mesh_info, "shard_mesh_dim", mesh.ndim - 1)
    replicate_dim = getattr(torch_mesh_info, "replicate_mesh_dim", None)
    if shard_dim != mesh.ndim - 1 or (mesh.ndim == 2 and replicate_dim not in (0, None)):
        raise NotImplementedError(
            f"shard_placement_fn for {where}: fsdp_compose supports a 1-D mesh (shard dim 0) "
            "or a 2-D (replicate, shard) mesh per parameter, got shard_mesh_dim="
            f"{shard_dim}, replicate_mesh_dim={replicate_dim} on {mesh}"
        )
    info = resolve_mesh_info(mesh)
    if info.device != default.device:
        raise ValueError(
            f"shard_placement_fn for {where}: its mesh is on {info.device} but fully_shard's "
            f"mesh is on {default.device}; use one device type for every mesh"
        )
    if default.spmd is not None:
        raise NotImplementedError("per-parameter meshes cannot be combined with dp_mesh_dims")
    return meshes.setdefault((id(info.shard_group), id(info.replicate_group)), info)


def _placement(
    fn: Callable[[nn.Parameter], Any] | None,
    param: nn.Parameter,
    owners: list[tuple[nn.Module, str]],
    meshes: dict[Any, MeshInfo],
) -> tuple[int, MeshInfo]:
    """The shard dim and data-parallel mesh ``shard_placement_fn`` chooses for
    ``param`` (default: dim 0 on fully_shard's mesh)."""
    result = None if fn is None else fn(param)
    info, error = meshes[None], ValueError
    if result is not None and not isinstance(result, Shard) and hasattr(result, "mesh_info"):
        info = _param_mesh(result.mesh_info, repr(owners[0][1]), meshes)  # a ShardPlacementResult
        result = getattr(result, "placement", None)
        error = FSDPValueError  # FSDP2: AssertionError for a non-Shard placement in it
    if result is None:
        return 0, info
    if not isinstance(result, Shard):
        raise error(
            f"shard_placement_fn must return a Shard placement, a ShardPlacementResult or None, "
            f"got {result!r} for parameter {owners[0][1]!r}"
        )
    return result.dim, info
