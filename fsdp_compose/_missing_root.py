"""Detects a model whose root was not annotated (``fully_shard(model)`` forgotten).

[Note: plain parameters next to sharded ones]
With only the blocks annotated, training runs: every block is its own root and
reduces its gradients, but the parameters outside the blocks (embeddings, final
norm, head) stay plain tensors whose gradients come from this rank's batch only.
Nothing averages them, so each rank's optimizer moves them differently and the
ranks' models drift apart, silently. torch's FSDP2 behaves the same way.

The mistake shows at the first ``optimizer.step()``: the optimizer holds
parameters sharded by fsdp_compose over more than one data-parallel rank *and*
plain (non-``DTensor``) parameters that received a gradient. That step raises,
before any parameter is modified, naming the plain parameters and the fix.
Parameters a ``fully_shard`` call was told to leave alone (``ignored_params``)
are the user's to reduce and never count; neither do frozen ones, nor plain
parameters without a gradient. Plain parameters whose gradients are reduced by
other means belong in an optimizer of their own.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ._sharded_param import IGNORED_BY, SHARDED_BY
from ._unit import Unit

# Per optimizer: (parameter count when checked, plain parameters still to watch).
_watched: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, list[torch.Tensor]]] = (
    weakref.WeakKeyDictionary()
)


def check_no_plain_params_with_sharded(
    optimizer: torch.optim.Optimizer, units: Iterable[Unit]
) -> None:
    """Raises if ``optimizer`` would update plain parameters whose gradients no
    rank averaged next to data-parallel sharded ones (see [Note: plain
    parameters next to sharded ones]). Cheap after the first call: only the
    plain trainable parameters found then are looked at again."""
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    seen = _watched.get(optimizer)
    if seen is None or seen[0] != count:
        seen = (count, _plain_candidates(optimizer, units))
        _watched[optimizer] = seen
    plain = seen[1]
    if not plain:
        return
    with_grad = [p for p in plain if p.grad is not None]
    if with_grad:
        raise RuntimeError(_message(optimizer, with_grad, units))


def _plain_candidates(
    optimizer: torch.optim.Optimizer, units: Iterable[Unit]
) -> list[torch.Tensor]:
    """The optimizer's plain trainable parameters, if it also holds parameters
    sharded over more than one data-parallel rank (else nothing to watch)."""
    dp_size = {id(p.sharded_param): u.mesh_info.data_parallel_size for u in units for p in u.params}
    sharded_multi_rank = False
    plain: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, SHARDED_BY, None) is not None:
                sharded_multi_rank = sharded_multi_rank or dp_size.get(id(p), 1) > 1
            elif (
                not isinstance(p, DTensor)
                and p.requires_grad
                and getattr(p, IGNORED_BY, None) is None
            ):
                plain.append(p)
    return plain if sharded_multi_rank else []


def _message(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor], units: Iterable[Unit]
) -> str:
    model, names = _find_names(params, units)
    shown = ", ".join(repr(n) for n in names[:6]) + (
        f", ... ({len(names)} in all)" if len(names) > 6 else ""
    )
    owner = f"{type(model).__name__} " if model is not None else ""
    return (
        f"fsdp_compose: {type(optimizer).__name__} holds parameters sharded by fully_shard and "
        f"plain parameters whose gradients no rank averages: {shown}. Each rank would update "
        f"these with its own gradients and the ranks' models would drift apart. Was "
        f"fully_shard(model) forgotten on the root? Call it on the whole {owner}model after its "
        "blocks (bottom-up, before creating the optimizer), so that every parameter is "
        "sharded and reduced. Parameters whose gradients you reduce yourself belong in "
        "fully_shard(..., ignored_params=...) or in an optimizer of their own."
    )


def _find_names(
    params: list[torch.Tensor], units: Iterable[Unit]
) -> tuple[nn.Module | None, list[str]]:
    """Names ``params`` inside the module that holds them and an annotated
    module: the model whose root was not annotated. Only on the error path:
    modules do not know their parents, so this scans the live modules."""
    wanted = {id(p) for p in params}
    unit_modules = {id(m) for u in units for m in u.modules}
    best: nn.Module | None = None
    best_key = (0, 0)
    for obj in gc.get_objects():
        # type(), not isinstance(): the latter reads ``__class__``, which some
        # deprecated objects (torch.distributed.reduce_op) answer with a warning.
        if not issubclass(type(obj), nn.Module):
            continue
        if not any(id(m) in unit_modules for m in obj.modules()):
            continue
        mine = sum(1 for p in obj.parameters() if id(p) in wanted)
        key = (mine, sum(1 for _ in obj.parameters()))
        if mine and key > best_key:
            best, best_key = obj, key
    names: dict[int, str] = {}
    if best is not None:
        for name, p in best.named_parameters():
            if id(p) in wanted:
                names.setdefault(id(p), name)
    return best, [names.get(id(p), f"<parameter of shape {tuple(p.shape)}>") for p in params]
