"""Which modules become units: wrap policies and the plan they resolve to.

A *policy* names the modules to annotate (by class, by parameter count, or by a
callable); :func:`resolve_plan` turns it into a :class:`ShardingPlan`, the explicit
list of units (bottom-up, the root last) that :func:`~fsdp_compose.auto_wrap`
applies and the estimator and planner reason about. Plans are plain data: the
planner builds them, users can edit or write them by hand.

[Note: tied weights and auto-wrap]
A parameter reachable from two modules (a tied embedding and LM head) can only be
managed by one unit. A candidate module that shares a parameter with a module
outside its own subtree is therefore not made a unit of its own: its parameters
stay with the enclosing unit (for the usual tie, the root), which is the one place
a tied weight is always correct. The skipped module is reported in
``ShardingPlan.skipped`` so the choice is visible.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch import nn

__all__ = ["ShardingPlan", "UnitPlan", "WrapPolicy", "resolve_plan"]

#: A policy: module classes or class names (``None``: the model's
#: ``_no_split_modules``), a minimum parameter count, or ``fn(module, fqn) -> bool``.
WrapPolicy = Iterable[type[nn.Module] | str] | int | Callable[[nn.Module, str], bool] | None


@dataclass(frozen=True)
class UnitPlan:
    """One unit of a plan.

    Args:
        modules: fully qualified names of the modules the unit annotates
            (``""`` is the root). Several names make one unit of several
            sibling modules (``fully_shard([a, b])``).
        reshard_after_forward: as in :func:`~fsdp_compose.fully_shard`.
        checkpoint: recompute these modules' activations in backward
            (non-reentrant activation checkpointing) instead of saving them.
        offload: keep this unit's sharded parameters, gradients and optimizer
            states in host memory (``CPUOffloadPolicy()`` for its
            ``fully_shard`` call), as the planner's ``offload_by_budget`` chooses.
        accumulation: how the unit accumulates gradients while gradient sync is
            disabled: ``"unsharded"`` (FSDP2's) or ``"sharded"``
            (``FSDPModule.set_gradient_accumulation``), as the planner's
            ``grad_accum`` chooses.
    """

    modules: tuple[str, ...]
    reshard_after_forward: bool | int | None = None
    checkpoint: bool = False
    offload: bool = False
    accumulation: str = "unsharded"

    def __post_init__(self) -> None:
        if not self.modules or not all(isinstance(m, str) for m in self.modules):
            raise ValueError(
                f"UnitPlan.modules must be a non-empty tuple of module names, got {self.modules!r}"
            )
        r = self.reshard_after_forward
        if r is not None and not isinstance(r, (bool, int)):
            raise TypeError(f"reshard_after_forward must be a bool, an int or None, got {r!r}")
        if self.checkpoint and self.modules == ("",):
            raise ValueError("the root unit cannot be activation-checkpointed as a whole")
        if self.accumulation not in ("unsharded", "sharded"):
            raise ValueError(
                f'UnitPlan.accumulation must be "unsharded" or "sharded", got {self.accumulation!r}'
            )

    @property
    def name(self) -> str:
        return "+".join(m or "<root>" for m in self.modules)


@dataclass(frozen=True)
class ShardingPlan:
    """Units to annotate, bottom-up with the root last, and the prefetch depth.

    Args:
        units: the units, in the order ``fully_shard`` is applied (children before
            parents; the root, ``("",)``, last).
        prefetch_depth: how many units ahead forward and backward prefetch
            (``FSDPModule.set_prefetch_depth``); 1 is fsdp_compose's default.
        skipped: candidate modules left to their parent unit, with the reason.
    """

    units: tuple[UnitPlan, ...]
    prefetch_depth: int = 1
    skipped: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not self.units or self.units[-1].modules != ("",):
            raise ValueError("a ShardingPlan's last unit must be the root, UnitPlan(modules=('',))")
        if not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 0:
            raise ValueError(
                f"prefetch_depth must be a non-negative int, got {self.prefetch_depth!r}"
            )
        seen: set[str] = set()
        for unit in self.units:
            for m in unit.modules:
                if m in seen:
                    raise ValueError(f"module {m!r} appears in two units of the plan")
                seen.add(m)

    def validate_for(self, model: nn.Module) -> dict[str, nn.Module]:
        """Returns ``{fqn: module}`` for every module the plan names, or raises
        ``ValueError`` naming the first one ``model`` does not have."""
        modules = dict(model.named_modules())
        missing = [m for u in self.units for m in u.modules if m not in modules]
        if missing:
            raise ValueError(
                f"the plan names modules that the model does not have: {missing[:5]}; "
                "build the plan from this model (resolve_plan / plan_to_budget)"
            )
        return modules


def resolve_plan(
    model: nn.Module,
    policy: WrapPolicy = None,
    *,
    reshard_after_forward: bool | int | None = None,
    checkpoint: bool = False,
    prefetch_depth: int = 1,
) -> ShardingPlan:
    """The units a policy selects in ``model``, bottom-up with the root last.

    Args:
        model: the model (any device, including ``meta``).
        policy: module classes or class names to wrap (``None``: the model's
            Hugging Face ``_no_split_modules``), an ``int`` minimum number of
            parameters a module's not-yet-wrapped subtree must hold, or a callable
            ``fn(module, fqn) -> bool``.
        reshard_after_forward: for every non-root unit (the root keeps ``None``).
        checkpoint: activation-checkpoint every non-root unit.
        prefetch_depth: the plan's prefetch depth.

    Raises:
        ValueError: a class name the model does not contain, no
            ``_no_split_modules`` to default to, or a policy of the wrong type.
    """
    select = _selector(model, policy)
    chosen: list[str] = []
    skipped: list[tuple[str, str]] = []
    owned: set[int] = set()  # id() of parameters already in a chosen unit
    owners = _param_owners(model)
    for fqn, module in _post_order(model):
        if fqn == "":
            continue
        if not select(module, fqn, owned):
            continue
        outside = _shared_outside(module, fqn, owners)
        if outside:
            skipped.append(
                (fqn, f"shares a parameter with {outside} (tied): left to the enclosing unit")
            )
            continue
        params = [p for p in module.parameters() if id(p) not in owned]
        if not params:
            continue  # nothing left to manage (everything below is already wrapped)
        owned.update(id(p) for p in params)
        chosen.append(fqn)
    units = [UnitPlan((m,), reshard_after_forward, checkpoint) for m in chosen]
    units.append(UnitPlan(("",)))
    return ShardingPlan(tuple(units), prefetch_depth, tuple(skipped))


def _post_order(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(fqn, module) children before parents, siblings in registration order."""
    out: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            visit(f"{prefix}.{name}" if prefix else name, child)
        out.append((prefix, module))

    visit("", model)
    return out


def _param_owners(model: nn.Module) -> dict[int, set[str]]:
    """id(parameter) -> fqns of every module that registers it directly."""
    owners: dict[int, set[str]] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(fqn)
    return owners


def _shared_outside(module: nn.Module, fqn: str, owners: dict[int, set[str]]) -> str | None:
    prefix = fqn + "."
    for p in module.parameters():
        for owner in owners.get(id(p), ()):
            if owner != fqn and not owner.startswith(prefix):
                return owner or "<root>"
    return None


def _selector(model: nn.Module, policy: WrapPolicy) -> Callable[[nn.Module, str, set[int]], bool]:
    if policy is None:
        names = getattr(model, "_no_split_modules", None)
        if not names:
            raise ValueError(
                f"{type(model).__name__} has no _no_split_modules to take the wrap policy from; "
                "pass policy= (module classes, class names, a minimum parameter count or a callable)"
            )
        policy = list(names)
    if isinstance(policy, bool):
        raise TypeError(
            "policy must be module classes, class names, an int or a callable, not a bool"
        )
    if isinstance(policy, int):
        if policy <= 0:
            raise ValueError(f"a parameter-count policy must be positive, got {policy}")
        threshold = policy

        def by_size(module: nn.Module, fqn: str, owned: set[int]) -> bool:
            return sum(p.numel() for p in module.parameters() if id(p) not in owned) >= threshold

        return by_size
    if callable(policy) and not isinstance(policy, type):
        fn = policy
        return lambda module, fqn, owned: bool(fn(module, fqn))
    if isinstance(policy, (str, type)):
        policy = [policy]
    try:
        entries = list(policy)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"policy must be module classes, class names, an int or a callable, got {type(policy).__name__}"
        ) from None
    classes = {type(m) for m in model.modules()}
    class_names = {c.__name__ for c in classes}
    wanted_types: set[type] = set()
    wanted_names: set[str] = set()
    for entry in entries:
        if isinstance(entry, type) and issubclass(entry, nn.Module):
            wanted_types.add(entry)
        elif isinstance(entry, str):
            wanted_names.add(entry)
        else:
            raise TypeError(
                f"policy entries must be nn.Module subclasses or class names, got {entry!r}"
            )
    unknown = sorted(wanted_names - class_names) + sorted(
        t.__name__ for t in wanted_types if not any(issubclass(c, t) for c in classes)
    )
    if unknown:
        raise ValueError(
            f"the wrap policy names module classes that {type(model).__name__} does not contain: "
            f"{unknown}; it contains {sorted(class_names)}"
        )
    match_types = tuple(wanted_types)

    def by_class(module: nn.Module, fqn: str, owned: set[int]) -> bool:
        return type(module).__name__ in wanted_names or isinstance(module, match_types)

    return by_class
