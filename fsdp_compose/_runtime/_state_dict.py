"""State-dict hooks of a unit, and loading full (unsharded) state dicts.

``state_dict()`` and ``load_state_dict()`` see the sharded DTensor parameters, as in
FSDP2 (see [Note: state_dict reshards]). Beyond FSDP2, ``load_state_dict`` also takes a full plain tensor of a
parameter's global shape and, with tensor parallel, a DTensor laid out by TP alone (saved
before ``fully_shard``): each rank cuts its own shard locally, without communication.
"""

from __future__ import annotations

import functools
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

__all__ = ["register_state_dict_hooks", "sharded_from_state"]

# [Note: state_dict reshards]
# As in FSDP2, ``state_dict()`` and ``load_state_dict()`` first reshard a unit whose
# parameters are gathered (``reshard_after_forward=False`` after a forward), so that
# ``model.parameters()`` shows the shards afterwards (an optimizer built then holds
# them) and the unsharded memory is freed. ``state_dict()`` does so only on the thread
# that runs the root's steps, between steps: torchft's recovery serves a state dict
# from another thread while a step runs there, and must not touch the units. Either
# way the post-hook puts the shards in the state dict (the registered parameters may
# be the unsharded ones on that other thread).

_Named = list[tuple[str, ShardedParam]]  # a module's (attribute name, parameter) pairs


def sharded_from_state(
    p: ShardedParam, value: torch.Tensor, *, own: bool = False
) -> DTensor | None:
    """A full plain tensor of ``p``'s global shape (or with TP, a DTensor laid out by
    TP alone) as ``p``'s sharded DTensor on its storage device, cut locally; None for
    other values (left as they are). With ``own`` (``assign=True``) the shard is a
    copy, not a view keeping the caller's whole tensor alive."""
    tp = p.tp_spec
    if value.shape != p.global_size:
        return None
    if isinstance(value, DTensor):
        if tp is None or value.device_mesh != tp.mesh or value.placements != tp.placements:
            return None
        value = _compat.local_tensor(value)
    elif tp is not None and p.tp_placement is not None and p.tp_dim is not None:
        dim = _shard_dim_of(p.tp_placement, value.dim())
        if dim is not None:  # TP's part first: torch.chunk semantics, like DTensor's Shard
            size, rank = value.size(dim), tp.mesh.get_local_rank(p.tp_dim)
            chunk = math.ceil(size / tp.mesh.size(p.tp_dim))
            start = min(rank * chunk, size)
            value = value.narrow(dim, start, min(chunk, size - start))
    d = p.shard_dim  # then FSDP's shard of the (TP-local) unsharded tensor
    start = min(p.mesh_info.shard_rank * p.chunk_rows, p.orig_size[d])
    local = value.narrow(d, start, p.local_shape[d])
    device = p.offload_device or p.device
    if own or local.device != device:
        local = local.to(device, copy=True).contiguous()
    return p.make_sharded_grad(local)


def register_state_dict_hooks(
    unit: Unit, state: UnitState, owners: list[tuple[nn.Module, str, ShardedParam]] | None = None
) -> None:
    """``state_dict()`` and ``load_state_dict()`` see the sharded parameters (full
    values loaded are cut into shards); ``owners`` limits the hooks to these
    registrations of ``unit``'s parameters (a borrower's, ``_shared``)."""
    if owners is None:
        owners = [(module, name, p) for p in unit.params for module, name in p.owners]
    owner_params: dict[nn.Module, _Named] = {}
    for module, name, p in owners:
        owner_params.setdefault(module, []).append((name, p))

    def load_pre_hook(
        params: _Named,
        _module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any] | None = None,
        *_: Any,
    ) -> None:
        state.reshard(unit)
        assign = bool((local_metadata or {}).get("assign_to_params_buffers", False))
        for name, p in params:
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor):
                sharded = sharded_from_state(p, value, own=assign)
                if sharded is not None:
                    state_dict[prefix + name] = sharded

    def save_pre_hook(*_: Any) -> None:
        state.reshard_if_between_steps(unit)

    def load_post_hook(*_: Any) -> None:
        state.reshard(unit)  # parameters may have been re-assigned (assign=True)
        unit.invalidate()

    for module, params in owner_params.items():
        module.register_state_dict_pre_hook(save_pre_hook)
        module.register_state_dict_post_hook(functools.partial(_save_shards, params))
        module.register_load_state_dict_pre_hook(functools.partial(load_pre_hook, params))
        module.register_load_state_dict_post_hook(load_post_hook)


def _save_shards(
    params: _Named, _module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any
) -> None:
    """Puts the shards in ``state_dict`` without touching the unit: another thread
    (torchft's recovery) may ask while a step has the unsharded parameters registered
    ([Note: state_dict reshards])."""
    for name, p in params:
        saved, sharded = state_dict.get(prefix + name), p.sharded_param
        if not isinstance(saved, torch.Tensor) or (  # absent, or a shard (a new one: assign=True)
            isinstance(saved, DTensor)
            and isinstance(sharded, DTensor)
            and (saved.device_mesh, saved.placements) == (sharded.device_mesh, sharded.placements)
        ):
            continue
        state_dict[prefix + name] = sharded if isinstance(saved, nn.Parameter) else sharded.detach()
