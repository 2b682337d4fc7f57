"""Checks of ``fully_shard``'s arguments and of a unit's use, beyond FSDP2's.

torch's FSDP2 accepts these calls and fails later (or trains silently wrong);
fsdp_compose refuses them before anything is modified (see [Note: atomic
fully_shard] in ``_fully_shard.py``):

* a policy that is not a ``MixedPrecisionPolicy``/``OffloadPolicy``, or a
  ``shard_placement_fn`` that is not callable;
* an ``nn.ModuleList``/``nn.ModuleDict`` container (no forward: no hook would run),
  or a module already sharded by torch's own ``fully_shard``;
* a mesh on the meta device, or a named 2-D mesh that is not laid out
  ``(replicate, shard)`` (e.g. a whole ``dp x tp`` mesh passed as an HSDP mesh);
* a submodule under two sibling units (a module shared by two units);
* what sharding would silently untie: a parameter an earlier call left
  unsharded (its ``ignored_params``) found again here (a tied weight), and a
  buffer that is, or shares storage with, a parameter;
* parameters on different devices (e.g. a module partly on the meta device).

At the root's lazy init, ranks that built different models are refused on every
rank (:func:`check_same_structure`, through the job's store: no collective). At
run time, :class:`UseChecks` (an observer every root subscribes) refuses a unit
whose parameters are on the meta or another device at its first use, warns about
parameters modified in place while unsharded (the change would be lost), and
refuses a backward through parameters modified after its forward.
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
from ._unit import Unit

__all__ = ["USE_CHECKS", "UseChecks", "check_call", "check_same_structure"]

# The targets of the fully_shard call that sharded each module's parameters
# (recorded while they were not sharded yet), weakly: names the sibling unit.
_claimed: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref[nn.Module], ...]] = (
    weakref.WeakKeyDictionary()
)

# Mesh dim names that denote a parallelism other than data parallel: a 2-D mesh
# carrying one of them is almost certainly a whole dp x tp (etc.) mesh passed where
# its data-parallel sub-mesh was meant, which would silently train as HSDP.
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
                f"fully_shard cannot annotate a {type(m).__name__} container: it has no forward, "
                "so no hook would ever run. Annotate its elements (e.g. each block) instead."
            )
        # fsdp_compose's units are instances of torch's FSDPModule too, but they were
        # refused before (already annotated); torch's fully_shard.state() is not asked,
        # as it adds a key to the module's __dict__.
        if isinstance(m, TorchFSDPModule):
            raise ValueError(
                f"{type(m).__name__} was already sharded by torch.distributed.fsdp.fully_shard; "
                "use one FSDP implementation per model."
            )


def _check_mesh(mesh_info: MeshInfo) -> None:
    mesh = mesh_info.mesh
    if mesh_info.device.type == "meta":
        raise ValueError(
            f"fully_shard got a mesh on the meta device ({mesh}): the sharded parameters would "
            "move to meta and lose their values. Build the mesh on the device training runs "
            "on, e.g. init_device_mesh('cpu', ...) or init_device_mesh('cuda', ...); to defer "
            "initialization, build the *model* under torch.device('meta') instead."
        )
    names = mesh.mesh_dim_names
    if mesh.ndim != 2 or mesh_info.spmd is not None:
        return
    if names is None:  # FSDP2 refuses it (AssertionError): see [Note: FSDP2's exception types]
        raise FSDPValueError(
            "Please init the 2D mesh for HSDP with mesh_dim_names specified: "
            f"fully_shard got a 2-D mesh without mesh_dim_names ({mesh}); as in FSDP2, a 2-D "
            "(HSDP) mesh needs named dims, dim 0 replicating and dim 1 sharding: "
            "init_device_mesh(device, (num_replicas, shard_size), "
            'mesh_dim_names=("replicate", "shard")).'
        )
    # FSDP2 accepts any names (dim 0 replicates, dim 1 shards): warn where they say
    # otherwise, since the likely intent was a different mesh.
    first, second = (n.lower() for n in names)
    if ("shard" in first and "shard" not in second) or ("rep" in second and "rep" not in first):
        warnings.warn(
            "fully_shard treats a 2-D mesh as HSDP ordered (replicate, shard): dim 0 "
            f"replicates and dim 1 shards, but mesh_dim_names={names} suggests the reverse. "
            "Build the mesh as init_device_mesh(device, (num_replicas, shard_size), "
            'mesh_dim_names=("replicate", "shard")) if that was the intent.',
            stacklevel=4,
        )
    other = [n for n in names if n.lower() in _NON_DATA_PARALLEL_DIMS]
    if other:
        warnings.warn(
            f"fully_shard got a 2-D mesh with mesh_dim_names={names}: a 2-D mesh means HSDP "
            f"(replicate, shard), but {other} does not look like a data-parallel dim. To "
            'shard over the data-parallel dim only, pass its sub-mesh (e.g. mesh["dp"]).',
            stacklevel=4,
        )


def _check_ignored(ignored: set[nn.Parameter]) -> None:
    # As in FSDP2, parameters outside the module are simply not this call's: one
    # set for the whole model may be passed to every call.
    for p in ignored:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"ignored_params must contain parameters, got {type(p).__name__}")


IsBorrowed = Callable[[nn.Parameter, nn.Module, str], bool]


def _check_siblings(
    targets: tuple[nn.Module, ...],
    managed: list[nn.Module],
    ignored: set[nn.Parameter],
    is_borrowed: IsBorrowed,
) -> None:
    """Raises if a managed module belongs to an earlier unit that is not an
    ancestor of ``targets``: the calls were bottom-up, but the same submodule
    hangs under two sibling units. Records the modules this call will shard."""
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
        earlier = [m for m in (r() for r in _claimed.get(module, ())) if m is not None]
        if not earlier or any(t is e or t in e.modules() for e in earlier for t in targets):
            continue  # a target sits inside the earlier unit: a parent annotated first
        name, p = sharded[0]
        raise ValueError(
            f"parameter {name!r} of {type(module).__name__} is already sharded by "
            f"fully_shard({getattr(p, SHARDED_BY)}), a sibling of {describe(targets)}: the "
            f"same {type(module).__name__} module is a submodule of both units (a module shared "
            "by two fully_shard units is not supported). Annotate the shared module on its own "
            "first, e.g. fully_shard(shared_module), or put the modules that share it in one "
            "unit, e.g. fully_shard([module_a, module_b])."
        )


def _alias_key(t: torch.Tensor) -> int:
    """A plain tensor's storage address, else (meta, empty, subclass) its identity."""
    plain = type(t.data) is torch.Tensor and not t.is_meta
    return (plain and t.untyped_storage().data_ptr()) or id(t)


def _check_untied(
    targets: tuple[nn.Module, ...], managed: list[nn.Module], ignored: set[nn.Parameter]
) -> None:
    """Refuses a tie that sharding would silently break (see the module's docstring)."""
    params: dict[int, str] = {}
    for m in managed:
        for name, p in m._parameters.items():
            if p is None or p in ignored or getattr(p, SHARDED_BY, None) is not None:
                continue
            if getattr(p, IGNORED_BY, None) is not None:
                earlier = f"fully_shard({getattr(p, IGNORED_BY)})"
                raise ValueError(
                    f"parameter {name!r} of {type(m).__name__} is in the ignored_params of "
                    f"{earlier}, which left it unsharded, and fully_shard({describe(targets)}) "
                    "finds it again (a tied weight): sharding it here would untie it. Pass it in "
                    "ignored_params here too (it stays one plain parameter, reduced by you), or "
                    f"remove it from the ignored_params of {earlier} (it is then sharded once, "
                    "by that unit, and shared with this one)."
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
                    "fully_shard replaces that parameter by a sharded DTensor, so the buffer "
                    "would keep the old full tensor (silently untied). Derive it from the "
                    "parameter in forward instead (e.g. a property returning self.weight), or "
                    "pass the parameter in ignored_params to leave it unsharded."
                )


def check_devices(owners: dict[nn.Parameter, list[tuple[nn.Module, str]]]) -> None:
    """Refuses parameters on different devices (e.g. a module partly on meta)."""
    devices = {p.device for p in owners}
    if len(devices) > 1:
        where = {
            f"{owner[0][1]} ({type(owner[0][0]).__name__})": str(p.device)
            for p, owner in owners.items()
        }
        hint = (
            " Materialize the whole module (to_empty) or none of it: a module partly on the "
            "meta device would lose its real parameters when materialized later."
            if any(d.type == "meta" for d in devices)
            else " Move the module to one device first."
        )
        raise ValueError(
            f"fully_shard found parameters on different devices {sorted(map(str, devices))}: "
            f"{where}.{hint}"
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
    mesh_info: MeshInfo,
    policies: tuple[object, ...],
    is_borrowed: IsBorrowed,
) -> None:
    """Refuses a ``fully_shard`` call beyond FSDP2's checks, before anything changes
    (the devices of the parameters are checked with :func:`check_devices`)."""
    _check_policies(*policies)
    _check_modules(modules)
    _check_mesh(mesh_info)
    _check_ignored(ignored)
    _check_siblings(modules, managed, ignored, is_borrowed)
    _check_untied(modules, managed, ignored)


# On a unit (hot path: an attribute, not a weak mapping): the version of its flat
# buffer right after its last copy-out, and the versions of its shards when its
# forward ran (backward must see the parameters of the forward that built the graph).
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
            "(built there and never materialized, or moved there after fully_shard). "
            "Materialize them before the first forward, e.g. "
            "model.to_empty(device=...) and then re-initialize the parameters "
            "(reset_parameters() / your init function) or load a state dict."
        )
    wrong = [
        (p.fqn, str(p.local_shard.device))
        for p in unit.params
        if p.local_shard.device.type != (p.offload_device or unit.mesh_info.device).type
    ]
    if wrong:
        raise RuntimeError(
            f"fully_shard unit {unit.name!r} expects its sharded parameters on "
            f"{unit.mesh_info.device} (the mesh's device"
            f"{', or the CPU when offloaded' if unit.offload else ''}) but found {wrong}. "
            "Do not move a sharded module to another device after fully_shard; build the "
            "mesh on the intended device instead."
        )


def _check_unchanged_while_unsharded(unit: Unit) -> None:
    flat = unit.buffer.unsharded if unit.buffer is not None else None
    if flat is not None and flat._version != getattr(unit, _GATHERED, 0):
        warnings.warn(
            f"fsdp_compose: parameters of unit {unit.name!r} were modified in place while "
            "unsharded (e.g. under torch.no_grad() during forward); resharding discards the "
            "change. Modify parameters outside forward/backward, where they are the sharded "
            "DTensors that the optimizer updates.",
            stacklevel=6,
        )


def _check_unchanged_since_forward(unit: Unit) -> None:
    versions = getattr(unit, _FORWARD, None)
    if versions is not None and any(p.data_version() != v for p, v in zip(unit.params, versions)):
        raise RuntimeError(
            f"fsdp_compose: backward reached unit {unit.name!r}, but its parameters were "
            "modified (e.g. by optimizer.step()) after the forward that built this autograd "
            "graph, so backward would combine new parameters with old activations. Run a new "
            "forward before each backward, and step the optimizer after all backwards."
        )


# ---------------------------------------------------------------------------
# the same model on every rank
# ---------------------------------------------------------------------------

# Per (rank, group): the checks done so far, the same count on every rank that
# builds the same roots in the same order (the store keys must match). Keyed by
# rank too: in a threaded process group, every rank is a thread of this process.
_checks_done: dict[tuple[int, tuple[int, ...]], int] = {}
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
    all-gather). Exchanged through the job's store at the root's lazy init: no
    collective is issued, so torch's tools count exactly FSDP2's."""
    if not units or not dist.is_initialized():
        return
    groups: dict[tuple[int, ...], list[Unit]] = {}
    for u in units:
        for group in (u.mesh_info.shard_group, u.mesh_info.replicate_group):
            if group is None or group.size() == 1 or _compat.backend_name(group) == "fake":
                continue
            ranks = tuple(dist.get_process_group_ranks(group))
            groups.setdefault(ranks, []).append(u)
    me = dist.get_rank()
    for ranks, members in groups.items():
        description = repr([_unit_description(u) for u in members])
        done = _checks_done.get((me, ranks), 0)
        _checks_done[(me, ranks)] = done + 1
        _compare_through_store(done, ranks, description, members[0].mesh_info.shard_group)


def _compare_through_store(
    root: int, ranks: tuple[int, ...], description: str, group: dist.ProcessGroup
) -> None:
    me = dist.get_rank()
    others = _exchange(f"structure/{root}", ranks, description, group)
    if others is None:
        return
    reference = others[ranks[0]]
    differ = [r for r in ranks if others[r] != reference]
    detail = _first_difference(eval_description(reference), eval_description(others[differ[0]]))
    raise RuntimeError(
        f"fsdp_compose: the ranks of a data-parallel group built different models: ranks "
        f"{differ} differ from rank {ranks[0]} ({detail}; rank {me} is this one). Every rank "
        "must build the same model and call fully_shard with the same arguments."
    )


def _exchange(
    what: str, ranks: tuple[int, ...], description: str, group: dist.ProcessGroup
) -> dict[int, str] | None:
    """Exchanges ``description`` among ``ranks`` through the job's store: None if
    every rank's is the same, else every rank's (the same answer on every rank)."""
    store, me = _compat.default_store(), dist.get_rank()
    key = f"fsdp_compose/{what}/{hashlib.sha1(repr(ranks).encode()).hexdigest()[:12]}/"
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
    return {r: store.get(f"{key}{r}").decode() for r in ranks}


# Per (rank, group): the exchanges of all-gather inputs so far (store keys).
_inputs_checked: dict[tuple[int, tuple[int, ...]], int] = {}


def compare_across_ranks(
    description: str, group: dist.ProcessGroup, describe: Callable[[str, str], str]
) -> None:
    """Raises on every rank of ``group`` if the ranks' ``description`` of a unit's
    all-gather inputs differ (``describe(mine, other)`` says how), before the
    collective that would hang or mix mismatched data."""
    ranks = tuple(dist.get_process_group_ranks(group))
    me = dist.get_rank()
    done = _inputs_checked.get((me, ranks), 0)
    _inputs_checked[(me, ranks)] = done + 1
    others = _exchange(f"all_gather_inputs/{done}", ranks, description, group)
    if others is None:
        return
    differ = [r for r in ranks if others[r] != others[ranks[0]]]
    raise RuntimeError(
        f"fsdp_compose: the ranks of a data-parallel group would all-gather different "
        f"tensors: ranks {differ} differ from rank {ranks[0]} "
        f"({describe(others[ranks[0]], others[differ[0]])}; rank {me} is this one). "
        "A subclass's fsdp_pre_all_gather must return the same sizes and dtypes on every "
        "rank (the padded shard's size where the parameter is sharded unevenly)."
    )


def eval_description(text: str) -> list[Any]:
    """A description written by :func:`_unit_description` (reprs of literals)."""
    return list(ast.literal_eval(text))


def _first_difference(mine: list[Any], theirs: list[Any]) -> str:
    if len(mine) != len(theirs):
        return f"{len(mine)} units vs {len(theirs)}"
    for (name_a, params_a, settings_a), (name_b, params_b, settings_b) in zip(mine, theirs):
        if name_a != name_b:
            return f"unit {name_a!r} vs {name_b!r}"
        if settings_a != settings_b:
            return f"unit {name_a!r}: settings (param_dtype, reduce_dtype, reshard_after_forward, offload) {settings_a} vs {settings_b}"
        if len(params_a) != len(params_b):
            return f"unit {name_a!r} has {len(params_a)} parameters vs {len(params_b)}"
        for a, b in zip(params_a, params_b):
            if a != b:
                return f"parameter {a[0]!r}: shape {a[1]} {a[2]} vs {b[0]!r} shape {b[1]} {b[2]}"
    return "no difference found in the descriptions"
