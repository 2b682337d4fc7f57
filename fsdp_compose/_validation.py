"""Checks of ``fully_shard``'s arguments beyond FSDP2's, each naming the fix.

torch's FSDP2 accepts these calls and fails later (or trains silently wrong);
fsdp_compose refuses them before anything is modified (see [Note: atomic
fully_shard] in ``_fully_shard.py``):

* a policy that is not a ``MixedPrecisionPolicy``/``OffloadPolicy``, or a
  ``shard_placement_fn`` that is not callable;
* an ``nn.ModuleList``/``nn.ModuleDict`` container (no forward: no hook would run),
  or a module already sharded by torch's own ``fully_shard``;
* a mesh on the meta device, or a named 2-D mesh that is not laid out
  ``(replicate, shard)`` (e.g. a whole ``dp x tp`` mesh passed as an HSDP mesh);
* ``ignored_params`` that are not parameters of the module;
* a submodule under two sibling units (a module shared by two units);
* parameters on different devices (e.g. a module partly on the meta device).

and, at run time, a custom comm's ``allocate`` returning a buffer other than the
one asked for, a unit whose parameters are on the meta or another device at
its first use, parameters modified in place while unsharded (the change would be
lost), and a backward through parameters modified after its forward.

This module is an extension: it registers with
``fsdp_compose._fully_shard.shard_checks``, ``fsdp_compose._unit.unit_checks`` and
``fsdp_compose._collectives.check_custom_buffer``.
"""

from __future__ import annotations

import warnings
import weakref

import torch
import torch.nn as nn

from . import _collectives, _fully_shard, _hooks, _unit
from ._mesh import MeshInfo
from ._policies import MixedPrecisionPolicy, OffloadPolicy
from ._sharded_param import SHARDED_BY
from ._unit import Unit

__all__: list[str] = []

# The targets of the fully_shard call that sharded each module's parameters
# (recorded while they were not sharded yet), weakly: names the sibling unit.
_claimed: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref[nn.Module], ...]] = (
    weakref.WeakKeyDictionary()
)

# Mesh dim names that denote a parallelism other than data parallel: a 2-D mesh
# carrying one of them is almost certainly a whole dp x tp (etc.) mesh passed where
# its data-parallel sub-mesh was meant, which would silently train as HSDP.
_NON_DATA_PARALLEL_DIMS = ("tp", "tensor", "cp", "context", "ep", "expert", "pp", "pipe", "model")


def _describe(modules: tuple[nn.Module, ...]) -> str:
    return ", ".join(type(m).__name__ for m in modules)


def _check_modules(modules: tuple[nn.Module, ...]) -> None:
    try:
        from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    except ImportError:  # pragma: no cover
        TorchFSDPModule = ()  # type: ignore[assignment,misc]
    for m in modules:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(
                f"fully_shard cannot annotate a {type(m).__name__} container: it has no forward, "
                "so no hook would ever run. Annotate its elements (e.g. each block) instead."
            )
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
    if mesh.ndim != 2 or names is None or mesh_info.spmd is not None:
        return
    first, second = (n.lower() for n in names)
    if ("shard" in first and "shard" not in second) or ("rep" in second and "rep" not in first):
        raise ValueError(
            "fully_shard expects an HSDP mesh ordered (replicate, shard): dim 0 replicates "
            f"and dim 1 shards, but got mesh_dim_names={names}. Build the mesh as "
            "init_device_mesh(device, (num_replicas, shard_size), "
            'mesh_dim_names=("replicate", "shard")).'
        )
    other = [n for n in names if n.lower() in _NON_DATA_PARALLEL_DIMS]
    if other:
        raise ValueError(
            f"fully_shard got a 2-D mesh with mesh_dim_names={names}, but a 2-D mesh means "
            f"HSDP (replicate, shard) and {other} is not a data-parallel dim. Pass the "
            f'data-parallel sub-mesh instead (e.g. mesh["dp"]), or name the dims of an HSDP '
            'mesh ("replicate", "shard").'
        )


def _check_ignored(ignored: set[nn.Parameter], modules: tuple[nn.Module, ...]) -> None:
    for p in ignored:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"ignored_params must contain parameters, got {type(p).__name__}")
    if not ignored:
        return
    # Originals of parameters that a nested unit already replaced count as the module's.
    known = {p for m in modules for p in m.parameters()}
    for p in ignored:
        if p not in known and getattr(p, _fully_shard.REPLACED_BY, None) is None:
            raise ValueError(
                f"ignored_params contains a parameter of shape {tuple(p.shape)} ({p.dtype}) that "
                f"is not a parameter of {_describe(modules)} or its submodules, so ignoring it "
                "would have no effect. Pass only the parameters of the module being sharded, "
                "e.g. ignored_params={module.some_layer.weight}."
            )


def _check_siblings(
    targets: tuple[nn.Module, ...], managed: list[nn.Module], ignored: set[nn.Parameter]
) -> None:
    """Raises if a managed module belongs to an earlier unit that is not an
    ancestor of ``targets``: the calls were bottom-up, but the same submodule
    hangs under two sibling units. Records the modules this call will shard."""
    sharing = _hooks.param_sharing
    for module in managed:
        sharded = [
            (name, p)
            for name, p in module._parameters.items()
            if p is not None
            and p not in ignored
            and getattr(p, SHARDED_BY, None) is not None
            and not (sharing and sharing.is_borrowed(p, module, name))
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
            f"fully_shard({getattr(p, SHARDED_BY)}), a sibling of {_describe(targets)}: the "
            f"same {type(module).__name__} module is a submodule of both units (a module shared "
            "by two fully_shard units is not supported). Annotate the shared module on its own "
            "first, e.g. fully_shard(shared_module), or put the modules that share it in one "
            "unit, e.g. fully_shard([module_a, module_b])."
        )


def _check_devices(managed: list[nn.Module], ignored: set[nn.Parameter]) -> None:
    owners = _fully_shard._managed_params(managed, ignored)
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


def _check_call(
    modules: tuple[nn.Module, ...],
    managed: list[nn.Module],
    ignored: set[nn.Parameter],
    mesh_info: MeshInfo,
    policies: tuple[object, ...],
) -> None:
    _check_policies(*policies)
    _check_modules(modules)
    _check_mesh(mesh_info)
    _check_ignored(ignored, modules)
    _check_siblings(modules, managed, ignored)
    _check_devices(managed, ignored)


# On a unit (hot path: an attribute, not a weak mapping): the version of its flat
# buffer right after its last copy-out, and the versions of its shards when its
# forward ran (backward must see the parameters of the forward that built the graph).
_GATHERED = "_fsdp_compose_gathered_version"
_FORWARD = "_fsdp_compose_forward_versions"


def _check_custom_buffer(
    buffer: object, numel: int, dtype: torch.dtype, device: torch.device, what: str
) -> None:
    if (
        isinstance(buffer, torch.Tensor)
        and buffer.numel() == numel
        and buffer.dtype == dtype
        and buffer.device == device
        and buffer.is_contiguous()
    ):
        return
    got = (
        f"a {'contiguous' if buffer.is_contiguous() else 'non-contiguous'} tensor of "
        f"{buffer.numel()} {buffer.dtype} elements on {buffer.device}"
        if isinstance(buffer, torch.Tensor)
        else type(buffer).__name__
    )
    raise ValueError(
        f"{what}: allocate() returned {got}, but {numel} contiguous {dtype} elements "
        f"on {device} were asked for"
    )


class _UnitChecks:
    """The run-time checks (:class:`fsdp_compose._unit.UnitChecks`)."""

    def initializing(self, unit: Unit) -> None:
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

    def gathered(self, unit: Unit) -> None:
        assert unit._unsharded is not None
        setattr(unit, _GATHERED, unit._unsharded._version)

    def resharding(self, unit: Unit) -> None:
        flat = unit._unsharded
        if flat is not None and flat._version != getattr(unit, _GATHERED, 0):
            warnings.warn(
                f"fsdp_compose: parameters of unit {unit.name!r} were modified in place while "
                "unsharded (e.g. under torch.no_grad() during forward); resharding discards the "
                "change. Modify parameters outside forward/backward, where they are the sharded "
                "DTensors that the optimizer updates.",
                stacklevel=4,
            )

    def forward(self, unit: Unit) -> None:
        setattr(unit, _FORWARD, [p.data_version() for p in unit.params])

    def backward(self, unit: Unit) -> None:
        versions = getattr(unit, _FORWARD, None)
        if versions is not None and any(
            p.data_version() != v for p, v in zip(unit.params, versions)
        ):
            raise RuntimeError(
                f"fsdp_compose: backward reached unit {unit.name!r}, but its parameters were "
                "modified (e.g. by optimizer.step()) after the forward that built this autograd "
                "graph, so backward would combine new parameters with old activations. Run a new "
                "forward before each backward, and step the optimizer after all backwards."
            )


_fully_shard.shard_checks.append(_check_call)
_unit.unit_checks = _UnitChecks()
_collectives.check_custom_buffer = _check_custom_buffer
