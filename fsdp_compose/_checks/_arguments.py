"""Checks of a ``fully_shard`` call's arguments beyond FSDP2's (its ``on_annotate``).

torch's FSDP2 accepts what these refuse and fails later, or trains silently wrong:
policies of the wrong type, a module torch's FSDP2 already sharded, a mesh on the
meta device or whose dim names suggest another layout, a parameter an earlier unit
sharded (a parent annotated first, or a module shared by siblings), sharding that
would untie a tied weight or buffer, and parameters on several devices.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Mapping

import torch
import torch.nn as nn

from .._runtime import (
    Annotation,
    MeshInfo,
    MixedPrecisionPolicy,
    OffloadPolicy,
    describe_modules,
    ignored_by,
    is_borrowed,
    owner_of,
    replaced_by,
)

__all__ = ["check_annotation"]

# Per module, weakly: the targets of the call that sharded its parameters (names a sibling).
_claimed: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref[nn.Module], ...]] = (
    weakref.WeakKeyDictionary()
)

# Dim names of other parallelisms: a 2-D mesh with one is likely a whole dp x tp mesh
# passed where its data-parallel sub-mesh was meant (it would silently train as HSDP).
_NON_DATA_PARALLEL_DIMS = ("tp", "tensor", "cp", "context", "ep", "expert", "pp", "pipe", "model")


def check_annotation(call: Annotation) -> None:
    """Refuses a ``fully_shard`` call beyond FSDP2's checks, before anything changes."""
    _check_policies(call.mp_policy, call.offload_policy, call.shard_placement_fn)
    _check_modules(call.modules)
    _check_mesh(call.mesh_info)
    _check_siblings(call.modules, call.managed, call.ignored)
    _check_untied(call.modules, call.managed, call.ignored)
    _check_devices(call.owners)


def _check_policies(mp_policy: object, offload_policy: object, shard_placement_fn: object) -> None:
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if isinstance(offload_policy, Mapping):  # per parameter: [Note: per-parameter offload]
        for fqn, policy in offload_policy.items():
            if not isinstance(fqn, str) or not isinstance(policy, OffloadPolicy):
                raise TypeError(
                    "offload_policy as a mapping takes parameter FQNs (str) to OffloadPolicy "
                    f"values (e.g. {{'w1.weight': CPUOffloadPolicy()}}), got {fqn!r}: "
                    f"{type(policy).__name__}"
                )
    elif not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"offload_policy must be an OffloadPolicy (e.g. CPUOffloadPolicy()) or a mapping "
            f"from parameter FQN to OffloadPolicy, got {type(offload_policy).__name__}"
        )
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError("shard_placement_fn must be callable (param -> Shard | None)")


def _check_modules(modules: tuple[nn.Module, ...]) -> None:
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    for m in modules:
        # (torch's fully_shard.state() is not asked: it adds a key to the module's __dict__.)
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
    if mesh.ndim != 2 or mesh_info.spmd is not None or names is None:
        return
    # FSDP2 accepts any names (dim 0 replicates): warn where they suggest another intent.
    first, second = (n.lower() for n in names)
    if ("shard" in first and "shard" not in second) or ("rep" in second and "rep" not in first):
        warnings.warn(
            "fully_shard treats a 2-D mesh as HSDP (replicate, shard), but mesh_dim_names="
            f"{names} suggests the reverse. Build it as init_device_mesh(device, (num_replicas, "
            'shard_size), mesh_dim_names=("replicate", "shard")) if that was the intent.',
            stacklevel=7,  # the user's fully_shard call
        )
    other = [n for n in names if n.lower() in _NON_DATA_PARALLEL_DIMS]
    if other:
        warnings.warn(
            f"fully_shard treats a 2-D mesh as HSDP (replicate, shard), but {other} of "
            f"mesh_dim_names={names} is not a data-parallel dim. To shard over the "
            'data-parallel dim only, pass its sub-mesh (e.g. mesh["dp"]).',
            stacklevel=7,  # the user's fully_shard call
        )


def _check_siblings(
    targets: tuple[nn.Module, ...],
    managed: tuple[nn.Module, ...],
    ignored: frozenset[nn.Parameter],
) -> None:
    """Refuses a managed parameter an earlier unit sharded: a unit of its module's
    parent (not bottom-up) or of a sibling; records the modules this call shards."""
    for module in managed:
        sharded = [
            (name, p)
            for name, p in module._parameters.items()
            if p is not None
            and p not in ignored
            and owner_of(p) is not None
            and not is_borrowed(p, module, name)
        ]
        if not sharded:
            _claimed[module] = tuple(weakref.ref(t) for t in targets)
            continue
        name, p = sharded[0]
        by = f"fully_shard({owner_of(p)})"
        where = f"parameter {name!r} of {type(module).__name__} is already sharded by {by}"
        earlier = [m for m in (r() for r in _claimed.get(module, ())) if m is not None]
        if not earlier or any(t is e or t in e.modules() for e in earlier for t in targets):
            raise ValueError(  # a target sits inside the earlier unit: a parent annotated first
                f"{where}: fully_shard must be applied bottom-up, i.e. to submodules (e.g. each "
                "block) before their parents."
            )
        raise ValueError(
            f"{where}, a sibling of {describe_modules(targets)}: a module shared by two "
            "fully_shard units is not supported. Annotate the shared module on its own first "
            "(fully_shard(shared_module)), or group the modules that share it in one unit "
            "(fully_shard([module_a, module_b]))."
        )


def _alias_key(t: torch.Tensor) -> int:
    """A plain tensor's storage address, else (meta, empty, subclass) its identity."""
    plain = type(t.data) is torch.Tensor and not t.is_meta
    return (plain and t.untyped_storage().data_ptr()) or id(t)


def _check_untied(
    targets: tuple[nn.Module, ...],
    managed: tuple[nn.Module, ...],
    ignored: frozenset[nn.Parameter],
) -> None:
    """Refuses what sharding would silently untie: a parameter an earlier call ignored
    found again (a tied weight), or a buffer that is (or shares storage with) one."""
    params: dict[int, str] = {}
    for m in managed:
        for name, p in m._parameters.items():
            if p is None or p in ignored or owner_of(p) is not None:
                continue
            if ignored_by(p) is not None:
                earlier = f"fully_shard({ignored_by(p)})"
                raise ValueError(
                    f"parameter {name!r} of {type(m).__name__} is in the ignored_params of "
                    f"{earlier}, and fully_shard({describe_modules(targets)}) finds it again "
                    "(tied): sharding would untie it. Pass it in ignored_params here too (you "
                    f"reduce it), or remove it from the ignored_params of {earlier} (then shared)."
                )
            params[_alias_key(p)] = f"parameter {name!r} of {type(m).__name__}"
    for m in managed:
        for name, b in m._buffers.items():
            alias = None if b is None else params.get(_alias_key(b))
            if b is not None and replaced_by(b) is not None:
                alias = f"a parameter fully_shard({replaced_by(b)}) sharded"
            if alias is not None:
                raise ValueError(
                    f"buffer {name!r} of {type(m).__name__} is (or shares storage with) {alias}: "
                    "sharding replaces that parameter, so the buffer would keep the old tensor "
                    "(silently untied). Derive it from the parameter in forward (e.g. a property "
                    "returning self.weight), or pass the parameter in ignored_params."
                )


def _check_devices(owners: Mapping[nn.Parameter, tuple[tuple[nn.Module, str], ...]]) -> None:
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
