"""Checks of ``fully_shard``'s arguments and of a unit's use, beyond FSDP2's.

torch's FSDP2 accepts what these refuse and fails later (or trains silently wrong).
:func:`check_call` runs before a call modifies anything ([Note: atomic fully_shard]
in ``_fully_shard.py``); :func:`check_same_structure` refuses, on every rank, ranks
that built different models (at the root's lazy init); :class:`UseChecks` checks
each unit's use at run time (its parameters' device, in-place changes while
unsharded or between forward and backward).
"""

from __future__ import annotations

import ast
import hashlib
import warnings
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _compat
from ._errors import FSDPValueError
from ._events import Observer, UnitEvent
from ._mesh import MeshInfo
from ._policies import MixedPrecisionPolicy, OffloadPolicy
from ._sharded_param import IGNORED_BY, REPLACED_BY, SHARDED_BY
from ._shared import is_borrowed
from ._unit import Unit

__all__ = ["USE_CHECKS", "UseChecks", "check_call", "check_same_structure"]

# Per module, weakly: the targets of the call that sharded its parameters (names a sibling).
_claimed: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref[nn.Module], ...]] = (
    weakref.WeakKeyDictionary()
)

# Dim names of other parallelisms: a 2-D mesh with one is likely a whole dp x tp mesh
# passed where its data-parallel sub-mesh was meant (it would silently train as HSDP).
_NON_DATA_PARALLEL_DIMS = ("tp", "tensor", "cp", "context", "ep", "expert", "pp", "pipe", "model")


def describe(modules: tuple[nn.Module, ...]) -> str:
    """The class names of a ``fully_shard`` call's modules (its unit's label)."""
    return ", ".join(type(m).__name__ for m in modules)


def _check_modules(modules: tuple[nn.Module, ...]) -> None:
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    for m in modules:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(
                "fully_shard does not support containers that do not implement forward: "
                f"fully_shard cannot annotate a {type(m).__name__} container (no hook would "
                "run). Annotate its elements (e.g. each block) instead."
            )
        # (Our units, torch FSDPModules too, were refused as annotated; torch's
        # fully_shard.state() is not asked: it adds a key to the module's __dict__.)
        if isinstance(m, TorchFSDPModule):
            raise ValueError(
                f"{type(m).__name__} was already sharded by torch.distributed.fsdp.fully_shard; "
                "use one FSDP implementation per model."
            )


def _check_mesh(mesh_info: MeshInfo) -> None:
    mesh = mesh_info.mesh
    if mesh_info.device.type == "meta":
        raise ValueError(
            f"fully_shard got a mesh on the meta device ({mesh}): parameters would lose their "
            "values. Build the mesh on the training device (to defer init, the *model* on meta)."
        )
    names = mesh.mesh_dim_names
    if mesh.ndim != 2 or mesh_info.spmd is not None:
        return
    if names is None:  # FSDP2 refuses it (AssertionError): see [Note: FSDP2's exception types]
        raise FSDPValueError(
            "Please init the 2D mesh for HSDP with mesh_dim_names specified: "
            f"fully_shard got a 2-D mesh without mesh_dim_names ({mesh}); build it with "
            'mesh_dim_names=("replicate", "shard") (dim 0 replicates, dim 1 shards).'
        )
    # FSDP2 accepts any names (dim 0 replicates): warn where they suggest another intent.
    first, second = (n.lower() for n in names)
    if ("shard" in first and "shard" not in second) or ("rep" in second and "rep" not in first):
        warnings.warn(
            "fully_shard treats a 2-D mesh as HSDP (replicate, shard), but mesh_dim_names="
            f"{names} suggests the reverse. Build it as init_device_mesh(device, (num_replicas, "
            'shard_size), mesh_dim_names=("replicate", "shard")) if that was the intent.',
            stacklevel=4,
        )
    other = [n for n in names if n.lower() in _NON_DATA_PARALLEL_DIMS]
    if other:
        warnings.warn(
            f"fully_shard treats a 2-D mesh as HSDP (replicate, shard), but {other} of "
            f"mesh_dim_names={names} is not a data-parallel dim. To shard over the "
            'data-parallel dim only, pass its sub-mesh (e.g. mesh["dp"]).',
            stacklevel=4,
        )


def _check_siblings(
    targets: tuple[nn.Module, ...], managed: list[nn.Module], ignored: set[nn.Parameter]
) -> None:
    """Refuses a managed parameter an earlier unit sharded: a unit of its module's
    parent (not bottom-up) or of a sibling; records the modules this call shards."""
    for module in managed:
        sharded = [
            (name, p)
            for name, p in module._parameters.items()
            if p is not None
            and p not in ignored
            and getattr(p, SHARDED_BY, None) is not None
            and not is_borrowed(p, module, name)
        ]
        if not sharded:
            _claimed[module] = tuple(weakref.ref(t) for t in targets)
            continue
        name, p = sharded[0]
        by = f"fully_shard({getattr(p, SHARDED_BY)})"
        where = f"parameter {name!r} of {type(module).__name__} is already sharded by {by}"
        earlier = [m for m in (r() for r in _claimed.get(module, ())) if m is not None]
        if not earlier or any(t is e or t in e.modules() for e in earlier for t in targets):
            raise ValueError(  # a target sits inside the earlier unit: a parent annotated first
                f"{where}: fully_shard must be applied bottom-up, i.e. to submodules (e.g. each "
                "block) before their parents."
            )
        raise ValueError(
            f"{where}, a sibling of {describe(targets)}: a module shared by two fully_shard "
            "units is not supported. Annotate the shared module on its own first "
            "(fully_shard(shared_module)), or group the modules that share it in one unit "
            "(fully_shard([module_a, module_b]))."
        )


def _alias_key(t: torch.Tensor) -> int:
    """A plain tensor's storage address, else (meta, empty, subclass) its identity."""
    plain = type(t.data) is torch.Tensor and not t.is_meta
    return (plain and t.untyped_storage().data_ptr()) or id(t)


def _check_untied(
    targets: tuple[nn.Module, ...], managed: list[nn.Module], ignored: set[nn.Parameter]
) -> None:
    """Refuses what sharding would silently untie: a parameter an earlier call ignored
    found again (a tied weight), or a buffer that is (or shares storage with) one."""
    params: dict[int, str] = {}
    for m in managed:
        for name, p in m._parameters.items():
            if p is None or p in ignored or getattr(p, SHARDED_BY, None) is not None:
                continue
            if getattr(p, IGNORED_BY, None) is not None:
                earlier = f"fully_shard({getattr(p, IGNORED_BY)})"
                raise ValueError(
                    f"parameter {name!r} of {type(m).__name__} is in the ignored_params of "
                    f"{earlier}, and fully_shard({describe(targets)}) finds it again (tied): "
                    "sharding would untie it. Pass it in ignored_params here too (you reduce it), "
                    f"or remove it from the ignored_params of {earlier} (then shared)."
                )
            params[_alias_key(p)] = f"parameter {name!r} of {type(m).__name__}"
    for m in managed:
        for name, b in m._buffers.items():
            alias = None if b is None else params.get(_alias_key(b))
            if b is not None and getattr(b, REPLACED_BY, None) is not None:
                alias = f"a parameter fully_shard({getattr(b, REPLACED_BY)}) sharded"
            if alias is not None:
                raise ValueError(
                    f"buffer {name!r} of {type(m).__name__} is (or shares storage with) {alias}: "
                    "sharding replaces that parameter, so the buffer would keep the old tensor "
                    "(silently untied). Derive it from the parameter in forward (e.g. a property "
                    "returning self.weight), or pass the parameter in ignored_params."
                )


def _check_devices(owners: dict[nn.Parameter, list[tuple[nn.Module, str]]]) -> None:
    """Refuses parameters on different devices (e.g. a module partly on meta)."""
    devices = {p.device for p in owners}
    if len(devices) > 1:
        where = {f"{o[0][1]} ({type(o[0][0]).__name__})": str(p.device) for p, o in owners.items()}
        fix = (
            "Materialize all of the module (to_empty) or none of it: its real parameters "
            "would be lost when the rest is materialized"
            if any(d.type == "meta" for d in devices)
            else "Move the module to one device first"
        )
        raise ValueError(
            f"fully_shard found parameters on different devices {sorted(map(str, devices))}: "
            f"{where}. {fix}."
        )


def _check_policies(mp_policy: object, offload_policy: object, shard_placement_fn: object) -> None:
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"offload_policy must be an OffloadPolicy (e.g. CPUOffloadPolicy()), got "
            f"{type(offload_policy).__name__}"
        )
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError("shard_placement_fn must be callable (param -> Shard | None)")


def check_call(
    modules: tuple[nn.Module, ...],
    managed: list[nn.Module],
    ignored: set[nn.Parameter],
    owners: dict[nn.Parameter, list[tuple[nn.Module, str]]],
    mesh_info: MeshInfo,
    policies: tuple[object, ...],
) -> None:
    """Refuses a ``fully_shard`` call beyond FSDP2's checks, before anything changes."""
    _check_policies(*policies)
    _check_modules(modules)
    _check_mesh(mesh_info)
    _check_siblings(modules, managed, ignored)
    _check_untied(modules, managed, ignored)
    _check_devices(owners)


# On a unit (hot path: an attribute, not a weak mapping): its flat buffer's version
# after the last copy-out, and its shards' versions when its forward ran.
_GATHERED = "_fsdp_compose_gathered_version"
_FORWARD = "_fsdp_compose_forward_versions"


class UseChecks(Observer):
    """The run-time checks of a unit's use; every tree's event list starts with
    :data:`USE_CHECKS` (it keeps no state of its own: what it records is on the unit)."""

    def on_unit(self, event: UnitEvent, unit: Unit) -> None:
        if event == "lazy_init":
            _check_placement(unit)
        elif event == "gathered" and unit.buffer is not None and unit.buffer.unsharded is not None:
            setattr(unit, _GATHERED, unit.buffer.unsharded._version)
        elif event == "resharding":
            _check_unchanged_while_unsharded(unit)
        elif event == "forward_begin":
            setattr(unit, _FORWARD, [p.data_version() for p in unit.params])
        elif event == "backward_begin":
            _check_unchanged_since_forward(unit)


USE_CHECKS = UseChecks()


def _check_placement(unit: Unit) -> None:
    on_meta = [p.fqn for p in unit.params if p.sharded_param.is_meta]
    if on_meta:
        raise RuntimeError(
            f"fully_shard unit {unit.name!r} has parameters on the meta device: {on_meta} "
            "(never materialized, or moved there after fully_shard). Before the first forward, "
            "call model.to_empty(device=...), then re-initialize them or load a state dict."
        )
    wrong = [
        (p.fqn, str(p.local_shard.device))
        for p in unit.params
        if p.local_shard.device.type != (p.offload_device or unit.mesh_info.device).type
    ]
    if wrong:
        raise RuntimeError(
            f"fully_shard unit {unit.name!r} expects its sharded parameters on the mesh's "
            f"device {unit.mesh_info.device}{' (or the CPU: offloaded)' if unit.offload else ''}"
            f", found {wrong}. Build the mesh on the intended device instead of moving the module."
        )


def _check_unchanged_while_unsharded(unit: Unit) -> None:
    flat = unit.buffer.unsharded if unit.buffer is not None else None
    if flat is not None and flat._version != getattr(unit, _GATHERED, 0):
        warnings.warn(
            f"fsdp_compose: parameters of unit {unit.name!r} were modified in place while "
            "unsharded (e.g. under torch.no_grad() in forward); resharding discards the change. "
            "Modify them outside forward/backward, where they are the sharded DTensors.",
            stacklevel=6,
        )


def _check_unchanged_since_forward(unit: Unit) -> None:
    versions = getattr(unit, _FORWARD, None)
    if versions is not None and any(p.data_version() != v for p, v in zip(unit.params, versions)):
        raise RuntimeError(
            f"fsdp_compose: backward reached unit {unit.name!r}, but its parameters were modified "
            "(e.g. by optimizer.step()) after the forward that built this graph (old activations, "
            "new parameters). Run a forward before each backward; step after all backwards."
        )


# Per (check, rank, group): _compare's exchanges so far, the same on every rank (the keys
# must match). Keyed by rank too: in a threaded process group, ranks are threads.
_exchanges: dict[tuple[str, int, tuple[int, ...]], int] = {}
_DEFAULT_TIMEOUT_S = 600.0


def _unit_description(u: Unit) -> tuple[Any, ...]:
    """What must be equal across the ranks of a unit's groups (sizes, dtypes and
    the settings that change its collectives)."""
    mp = u.mp_policy
    params = [
        (p.fqn, tuple(p.orig_size), str(p.orig_dtype), bool(p.sharded_param.requires_grad))
        for p in u.params
    ]
    settings = (
        str(mp.param_dtype),
        str(mp.reduce_dtype),
        str(u.options.reshard_after_forward),
        u.offload,
    )
    return (u.name, params, settings)


def check_same_structure(units: list[Unit]) -> None:
    """Raises on every rank if the ranks of a data-parallel group built different
    models (which would otherwise hang or exchange mismatched data at the first
    all-gather)."""
    if not units or not dist.is_initialized():
        return
    groups: dict[tuple[int, ...], list[Unit]] = {}
    for u in units:
        for group in (u.mesh_info.shard_group, u.mesh_info.replicate_group):
            if group is None or group.size() == 1 or _compat.backend_name(group) == "fake":
                continue
            groups.setdefault(tuple(dist.get_process_group_ranks(group)), []).append(u)
    for ranks, members in groups.items():
        description = repr([_unit_description(u) for u in members])
        group = members[0].mesh_info.shard_group
        differ = _compare("structure", ranks, description, group, _first_difference)
        if differ is not None:
            raise RuntimeError(
                "fsdp_compose: the ranks of a data-parallel group built different models: "
                f"{differ}. Every rank must build the same model and call fully_shard with the "
                "same arguments."
            )


def compare_across_ranks(
    description: str, group: dist.ProcessGroup, describe: Callable[[str, str], str]
) -> None:
    """Raises on every rank of ``group`` if the ranks' ``description`` of a unit's
    all-gather inputs differ (``describe(mine, other)`` says how), before the
    collective that would hang or mix mismatched data."""
    ranks = tuple(dist.get_process_group_ranks(group))
    differ = _compare("all_gather_inputs", ranks, description, group, describe)
    if differ is not None:
        raise RuntimeError(
            "fsdp_compose: the ranks of a data-parallel group would all-gather different "
            f"tensors: {differ}. A subclass's fsdp_pre_all_gather must return the same sizes "
            "and dtypes on every rank (the padded shard's size where sharded unevenly)."
        )


def _compare(
    what: str,
    ranks: tuple[int, ...],
    description: str,
    group: dist.ProcessGroup,
    explain: Callable[[str, str], str],
) -> str | None:
    """Exchanges ``description`` among ``ranks`` through the job's store (no
    collective, so torch's tools count exactly FSDP2's). None if every rank's is
    the same, else (on every rank) which ranks differ from the first, and how."""
    store, me = _compat.default_store(), dist.get_rank()
    done = _exchanges.get((what, me, ranks), 0)
    _exchanges[(what, me, ranks)] = done + 1
    key = f"fsdp_compose/{what}/{done}/{hashlib.sha1(repr(ranks).encode()).hexdigest()[:12]}/"
    timeout = timedelta(seconds=_compat.process_group_timeout(group) or _DEFAULT_TIMEOUT_S)
    store.set(f"{key}{me}", description)
    store.wait([f"{key}{ranks[0]}"], timeout)
    reference = store.get(f"{key}{ranks[0]}").decode()
    store.add(f"{key}differ", int(reference != description))
    if store.add(f"{key}arrived", 1) == len(ranks):
        store.set(f"{key}done", "1")
    store.wait([f"{key}done"], timeout)
    if store.add(f"{key}differ", 0) == 0:
        return None
    others = {r: store.get(f"{key}{r}").decode() for r in ranks}
    differ = [r for r in ranks if others[r] != reference]
    detail = explain(reference, others[differ[0]])
    return f"ranks {differ} differ from rank {ranks[0]} ({detail}; rank {me} is this one)"


def _first_difference(mine_text: str, theirs_text: str) -> str:
    """Where two descriptions by :func:`_unit_description` (reprs of literals) differ."""
    mine, theirs = ast.literal_eval(mine_text), ast.literal_eval(theirs_text)
    if len(mine) != len(theirs):
        return f"{len(mine)} units vs {len(theirs)}"
    for (name_a, params_a, settings_a), (name_b, params_b, settings_b) in zip(mine, theirs):
        if name_a != name_b:
            return f"unit {name_a!r} vs {name_b!r}"
        if settings_a != settings_b:
            return (
                f"unit {name_a!r}: settings (param_dtype, reduce_dtype, reshard_after_forward, "
                f"offload) {settings_a} vs {settings_b}"
            )
        if len(params_a) != len(params_b):
            return f"unit {name_a!r} has {len(params_a)} parameters vs {len(params_b)}"
        for a, b in zip(params_a, params_b):
            if a != b:
                return f"parameter {a[0]!r}: shape {a[1]} {a[2]} vs {b[0]!r} shape {b[1]} {b[2]}"
    return "no difference found in the descriptions"
