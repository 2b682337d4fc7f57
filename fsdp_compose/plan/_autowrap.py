"""``auto_wrap``: annotate a whole model from a policy or a plan, in one call."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Shard

from .._fully_shard import fully_shard
from .._runtime import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from ._policy import ShardingPlan, WrapPolicy, resolve_plan

__all__ = ["auto_wrap"]

logger = logging.getLogger("fsdp_compose")


def auto_wrap(
    model: nn.Module,
    policy: WrapPolicy = None,
    *,
    plan: ShardingPlan | None = None,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    activation_checkpointing: bool = False,
) -> list[FSDPModule]:
    """Applies :func:`~fsdp_compose.fully_shard` to a whole model, bottom-up.

    Every module the policy selects becomes a unit (children before parents),
    then the root. A module whose parameters are tied to a module outside it is
    left to the enclosing unit (see ``[Note: tied weights and auto-wrap]``).

    Example::

        units = auto_wrap(model)                      # HF: the model's _no_split_modules
        units = auto_wrap(model, {Block})             # by class
        units = auto_wrap(model, 50_000_000)          # subtrees of >= 50M parameters
        units = auto_wrap(model, plan=plan_to_budget(...).plan)

    Args:
        model: the model to annotate, in place (usually built on the meta device).
        policy: which modules become units: module classes or class names
            (default: the model's Hugging Face ``_no_split_modules``), an ``int``
            minimum number of not-yet-wrapped parameters, or ``fn(module, fqn)
            -> bool``. Ignored when ``plan`` is given.
        plan: an explicit :class:`ShardingPlan` (from :func:`resolve_plan` or the
            planner); its per-unit ``reshard_after_forward``, activation
            checkpointing, offload, gradient accumulation mode and prefetch
            depth are applied.
        mesh, mp_policy, offload_policy, shard_placement_fn: passed to every
            ``fully_shard`` call (a unit the plan offloads gets
            ``CPUOffloadPolicy()`` unless ``offload_policy`` is one).
        reshard_after_forward: for the non-root units (with ``policy``).
        activation_checkpointing: checkpoint every non-root unit (with ``policy``).

    Returns:
        Every module annotated, as :class:`~fsdp_compose.FSDPModule`, in the order
        they were annotated (the root last); the modules of a multi-module unit
        appear one after the other.

    Raises:
        ValueError: a policy or plan that does not match the model (checked
            before anything is modified).

    Atomic like ``fully_shard``: the plan is first applied to a meta-device
    copy of the model (see [Note: atomic auto_wrap]), so when a unit fails,
    for example a parameter that ``shard_placement_fn`` cannot shard, the error
    is raised before any module is annotated. A ``shard_placement_fn`` must
    decide from the parameter's shape, dtype and attributes, not its identity
    (the copy's parameters are other objects). Models holding ``DTensor``
    parameters (tensor parallel) are not copied: there, a failing unit leaves
    the earlier ones annotated.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"auto_wrap expects an nn.Module, got {type(model).__name__}")
    if isinstance(model, FSDPModule):
        raise ValueError("auto_wrap: the model is already annotated with fully_shard")
    if plan is None:
        plan = resolve_plan(
            model,
            policy,
            reshard_after_forward=reshard_after_forward,
            checkpoint=activation_checkpointing,
        )
    elif not isinstance(plan, ShardingPlan):
        raise TypeError(f"plan must be a ShardingPlan, got {type(plan).__name__}")
    modules = plan.validate_for(model)
    already = [fqn for fqn, m in modules.items() if isinstance(m, FSDPModule)]
    if already:
        raise ValueError(f"auto_wrap: modules {already[:5]} are already annotated with fully_shard")
    common: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": mp_policy,
        "offload_policy": offload_policy,
        "shard_placement_fn": shard_placement_fn,
    }
    # [Note: atomic auto_wrap] fully_shard is atomic per call, but a plan makes
    # many calls: the whole plan first runs on a copy of the model whose
    # parameters and buffers are on the meta device (no data copied), so a call
    # that would fail raises before the model is changed, and the retry starts
    # from the model as it was.
    skeleton = _meta_skeleton(model)
    if skeleton is not None:
        _apply(plan, dict(skeleton.named_modules()), common)
    units = _apply(plan, modules, common)
    root = units[-1]
    if plan.prefetch_depth != 1:
        root.set_prefetch_depth(forward=plan.prefetch_depth, backward=plan.prefetch_depth)
    logger.info("auto_wrap: %d units (%s)", len(plan.units), ", ".join(u.name for u in plan.units))
    for fqn, why in plan.skipped:
        logger.info("auto_wrap: %s not wrapped: %s", fqn, why)
    return units


def _apply(
    plan: ShardingPlan, modules: dict[str, nn.Module], common: dict[str, Any]
) -> list[FSDPModule]:
    units: list[FSDPModule] = []
    for unit in plan.units:
        targets = [modules[m] for m in unit.modules]
        if unit.checkpoint:
            for target in targets:
                _checkpoint(target)
        arg: Any = targets[0] if len(targets) == 1 else targets
        kwargs = dict(common, reshard_after_forward=unit.reshard_after_forward)
        if unit.offload and type(common["offload_policy"]).__name__ != "CPUOffloadPolicy":
            kwargs["offload_policy"] = CPUOffloadPolicy()  # a unit the plan offloads
        made = fully_shard(arg, **kwargs)
        made = made if isinstance(made, list) else [made]
        if unit.accumulation == "sharded":  # this unit only: its children have their own
            made[0].set_gradient_accumulation("sharded", recurse=False)
        units.extend(made)
    return units


def _meta_skeleton(model: nn.Module) -> nn.Module | None:
    """A deep copy of ``model`` whose parameters and buffers are fresh meta tensors
    (tied ones stay tied), or ``None`` where it cannot be made faithfully."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if isinstance(p, DTensor):
            return None
        memo[id(p)] = nn.Parameter(
            torch.empty_like(p, device="meta"), requires_grad=p.requires_grad
        )
    for b in model.buffers():
        if isinstance(b, DTensor):
            return None
        memo[id(b)] = torch.empty_like(b, device="meta")
    try:
        return copy.deepcopy(model, memo)
    except Exception:  # an uncopyable model is annotated without the dry run
        logger.info("auto_wrap: the model cannot be copied; annotating without a dry run")
        return None


def _checkpoint(module: nn.Module) -> None:
    # torch's composable activation checkpointing: hooks on the module, no wrapper
    # module, so parameter names and state-dict keys stay as the user wrote them.
    # It lives in a private namespace of torch; this is the one place we use it.
    from torch.distributed._composable import checkpoint

    checkpoint(module)
