"""State-dict hooks of a unit, and loading full (unsharded) state dicts.

``state_dict()`` and ``load_state_dict()`` see the sharded DTensor parameters, as
in FSDP2; ``state_dict()`` reads them without resharding (safe from another thread
while a forward runs, which FSDP2's resharding pre-hook is not). Beyond FSDP2 (which loads only sharded DTensors; a full state dict goes
through ``torch.distributed.checkpoint.state_dict.set_model_state_dict``),
``load_state_dict`` also takes a full plain tensor of a parameter's global shape,
and with tensor parallel a DTensor laid out by TP alone (a state dict saved before
``fully_shard``): each rank cuts its own shard locally, without communication.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import _compat
from ._sharded_param import ShardedParam, _shard_dim_of
from ._unit import Unit

if TYPE_CHECKING:
    from ._hooks import UnitState

__all__ = ["register_state_dict_hooks", "shard_of", "sharded_from_state"]


def shard_of(p: ShardedParam, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a full tensor of ``p``'s (global) shape, computed
    locally (no communication)."""
    if p.tp_spec is not None:
        full = _tp_local_of(p, full)
    return _dp_shard_of(p, full)


def _dp_shard_of(p: ShardedParam, unsharded: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a tensor of ``p``'s (TP-local) unsharded shape."""
    rows = p.orig_size[p.shard_dim]
    start = min(p.mesh_info.shard_rank * p.chunk_rows, rows)
    return unsharded.narrow(p.shard_dim, start, p.local_shape[p.shard_dim])


def _tp_local_of(p: ShardedParam, full: torch.Tensor) -> torch.Tensor:
    """This rank's TP-local part of a full tensor: ``torch.chunk`` semantics,
    like DTensor's ``Shard``; the whole tensor for ``Replicate``."""
    assert p.tp_spec is not None
    if p.tp_placement is None or p.tp_dim is None:
        return full
    dim = _shard_dim_of(p.tp_placement, full.dim())
    if dim is None:
        return full
    mesh = p.tp_spec.mesh
    size, rank = full.size(dim), mesh.get_local_rank(p.tp_dim)
    chunk = math.ceil(size / mesh.size(p.tp_dim))
    start = min(rank * chunk, size)
    return full.narrow(dim, start, min(chunk, size - start))


def sharded_from_state(
    p: ShardedParam, value: torch.Tensor, *, own: bool = False
) -> DTensor | None:
    """A state-dict value as ``p``'s sharded DTensor (the conversion
    ``load_state_dict`` applies), or None to leave the value as it is.

    Converts a full plain tensor of the parameter's global shape and, with
    tensor parallel, a DTensor laid out by TP alone; both without communication.
    The shard lands on the parameter's storage device (also when the module is
    still on the meta device). With ``own`` (``assign=True``: the result becomes
    the parameter) it is a copy that owns its memory, not a view that would keep
    the caller's whole tensor alive.
    """
    if value.shape != p.global_size:
        return None
    if not isinstance(value, DTensor):
        local = shard_of(p, value)
    elif (
        p.tp_spec is not None
        and value.device_mesh == p.tp_spec.mesh
        and tuple(value.placements) == tuple(p.tp_spec.placements)
    ):
        local = _dp_shard_of(p, _compat.local_tensor(value))
    else:
        return None
    device = p.offload_device or p.device
    if own or local.device != device:
        local = local.to(device, copy=True).contiguous()
    return p.make_sharded_grad(local)


def _convert_loaded(
    state_dict: dict[str, Any], prefix: str, params: list[tuple[str, ShardedParam]], assign: bool
) -> None:
    for name, p in params:
        key = prefix + name
        value = state_dict.get(key)
        if isinstance(value, torch.Tensor):
            sharded = sharded_from_state(p, value, own=assign)
            if sharded is not None:
                state_dict[key] = sharded


def register_state_dict_hooks(
    unit: Unit, state: UnitState, owners: list[tuple[nn.Module, str, ShardedParam]] | None = None
) -> None:
    """``state_dict()`` and ``load_state_dict()`` see the sharded parameters (full
    values loaded are cut into shards); ``owners`` limits the hooks to these
    registrations of ``unit``'s parameters (a borrower's, ``_shared``)."""
    if owners is None:
        owners = [(module, name, p) for p in unit.params for module, name in p.owners]
    owner_params: dict[nn.Module, list[tuple[str, ShardedParam]]] = {}
    for module, name, p in owners:
        owner_params.setdefault(module, []).append((name, p))

    for module, params in owner_params.items():

        def load_pre_hook(
            _module: nn.Module,
            state_dict: dict[str, Any],
            prefix: str,
            local_metadata: dict[str, Any] | None = None,
            *_: Any,
            _params: list[tuple[str, ShardedParam]] = params,
        ) -> None:
            state.reshard(unit)
            assign = bool((local_metadata or {}).get("assign_to_params_buffers", False))
            _convert_loaded(state_dict, prefix, _params, assign)

        def load_post_hook(*_: Any) -> None:
            # Parameters may have been re-assigned (assign=True).
            state.reshard(unit)
            unit.invalidate()

        module.register_state_dict_post_hook(
            lambda _m, state_dict, prefix, _meta, _p=params: _save_shards(state_dict, prefix, _p)
        )
        module.register_load_state_dict_pre_hook(load_pre_hook)
        module.register_load_state_dict_post_hook(load_post_hook)


def _save_shards(
    state_dict: dict[str, Any], prefix: str, params: list[tuple[str, ShardedParam]]
) -> None:
    """Puts the shards in ``state_dict`` without touching the unit: another thread
    (torchft's recovery) may ask while a step has the unsharded parameters registered."""
    for name, p in params:
        saved, sharded = state_dict.get(prefix + name), p.sharded_param
        if not isinstance(saved, torch.Tensor) or (  # absent, or a shard (a new one: assign=True)
            isinstance(saved, DTensor)
            and isinstance(sharded, DTensor)
            and (saved.device_mesh, saved.placements) == (sharded.device_mesh, sharded.placements)
        ):
            continue
        state_dict[prefix + name] = sharded if isinstance(saved, nn.Parameter) else sharded.detach()
