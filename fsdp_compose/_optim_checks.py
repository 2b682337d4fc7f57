"""Warnings for an optimizer used with fsdp_compose in a way that trains silently
wrong under FSDP2: :func:`fsdp_compose.debug.check_optimizer`.

[Note: optimizer checks are opt-in warnings]
torch's FSDP2 runs each of these programs without a word, and some variants of
them are valid (plain parameters whose gradients the user all-reduces, modules
under ``replicate()``), so fsdp_compose never refuses them and checks nothing by
default: a user who wants the checks registers them on one optimizer, and they
only warn. They run in a step pre-hook of that optimizer (no process-wide hook),
once per step, on the parameters the optimizer holds at that moment, and each
kind of warning is given once per optimizer.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from ._runtime import FSDPModule, is_ignored, owner_of, replaced_by, unit_infos

__all__ = ["check_optimizer"]


def check_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> RemovableHandle:
    """Warns, at each ``optimizer.step()``, about uses of ``optimizer`` that train
    silently wrong with fsdp_compose and with torch's FSDP2:

    * it was built before ``fully_shard`` (it holds the replaced, unsharded
      parameters: they get no gradient and the model is never updated);
    * it holds parameters that are not the model's (e.g. built between a forward
      and its backward, while the unsharded parameters were registered);
    * the model's root module is not annotated, so plain parameters next to the
      sharded ones get no gradient reduction (fine if you reduce them yourself);
    * gradient synchronization is still off (``set_requires_gradient_sync(False)``)
      for some units, so their sharded gradients were not updated.

    Never raises; each kind of warning is given once.

    Args:
        optimizer (torch.optim.Optimizer): the optimizer to check.
        model (nn.Module): the model it trains (its root module).

    Returns:
        A handle whose ``remove()`` unregisters the checks.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"check_optimizer expects a torch optimizer, got {type(optimizer).__name__}"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"check_optimizer expects the model, got {type(model).__name__}")
    warned: set[str] = set()

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for kind, message in _findings(opt, model):
            if kind not in warned:
                warned.add(kind)
                warnings.warn(message, UserWarning, stacklevel=2)

    return optimizer.register_step_pre_hook(hook)


def _findings(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[tuple[str, str]]:
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if not any(owner_of(p) is not None or replaced_by(p) is not None for p in held):
        return []  # not an optimizer of fsdp_compose parameters
    found = []
    replaced = [p for p in held if replaced_by(p) is not None]
    if replaced:
        found.append(
            (
                "replaced",
                f"the optimizer holds {len(replaced)} parameter(s) that fully_shard("
                f"{replaced_by(replaced[0])}) replaced by sharded ones: they get no "
                "gradient and are never trained. Build the optimizer after fully_shard, "
                "from model.parameters().",
            )
        )
    own = {id(p) for p in model.parameters()}
    foreign = [p for p in held if id(p) not in own and replaced_by(p) is None]
    if foreign:
        found.append(
            (
                "foreign",
                f"the optimizer holds {len(foreign)} parameter(s) that are not the model's "
                f"(shape {tuple(foreign[0].shape)}), e.g. taken from model.parameters() "
                "between a forward and its backward, while the unsharded parameters were "
                "registered. Build the optimizer right after fully_shard.",
            )
        )
    if not isinstance(model, FSDPModule):
        plain = [p for p in held if id(p) in own and owner_of(p) is None and not is_ignored(p)]
        if plain and any(p.grad is not None for p in plain):
            found.append(
                (
                    "root",
                    f"{type(model).__name__} (the root) is not annotated with fully_shard: "
                    f"{len(plain)} plain parameter(s) next to the sharded ones get no "
                    "gradient reduction across ranks. Call fully_shard(model) last, or "
                    "ignore this if you reduce them yourself (replicate(), all_reduce).",
                )
            )
    unsynced = _units_without_sync(model)
    if unsynced:
        found.append(
            (
                "sync",
                f"optimizer.step() while gradient synchronization is off for {unsynced[0]} "
                f"({len(unsynced)} unit(s)): their sharded gradients were not updated by the "
                "last backward. Call model.set_requires_gradient_sync(True) before the last "
                "backward of the step.",
            )
        )
    return found


def _units_without_sync(model: nn.Module) -> list[str]:
    names = []
    for info in unit_infos(model):
        if not info.options.requires_gradient_sync:
            names.append(info.name)
    return names
