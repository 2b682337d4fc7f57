"""Parameters shared across units: tied embeddings, weights reused by several blocks.

[Note: shared parameters]
A parameter under modules of different ``fully_shard`` units (an LM head tied to
the embedding) is sharded **once**, by the first call that manages it: its unit is
the *owner*. A later call that finds it becomes a *borrower* of the owner unit: it
registers the owner's parameter under its module (the tie is kept, and
``named_parameters()`` lists it once), and its hooks report its uses to the
scheduler. The owner's mesh and policies must equal the borrower's (checked at
``fully_shard``); its resharding and gradient-sync settings apply. A borrower
gathers the owner's whole unit: give a shared parameter a small unit of its own.

:class:`SharedUses` counts the owner's and the borrowers' uses. In forward, the
owner unit stays unsharded from its first use to its last of the pass (counted in
the previous forward with gradients; the first keeps it to its end), then
``reshard_after_forward`` applies: one gather per forward. In backward, every
borrower gathers it (whatever ``unshard_in_backward``), and its gradients, summed
by autograd over all uses, are reduced once, after the backward of the last use
recorded in forward. Gradients arriving after that (graphs of earlier forwards kept
alive) are reduced again at the end of backward and added: never a lost gradient.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, NamedTuple

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ._mesh import MeshInfo
from ._policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._sharded_param import ShardedParam
from ._state_dict import register_state_dict_hooks
from ._unit import Unit

if TYPE_CHECKING:
    from ._hooks import UnitState

__all__ = ["SharedLink", "SharedUses", "collect_borrowed", "shared_link"]

# Weak references to a SharedLink's parts, found from the parameter a later call meets:
# the replaced original (out of every module, so keyed weakly) or the sharded DTensor
# (keyed by id and checked: a module's parameter must stay swappable, see
# [Note: parameter records]). Nothing is set on the user's tensors, and a dropped model
# takes its entries with it.
_LinkRefs = tuple["weakref.ref[ShardedParam]", "weakref.ref[Unit]", "weakref.ref[UnitState]"]
_by_original: WeakIdKeyDictionary = WeakIdKeyDictionary()
_by_sharded: dict[int, _LinkRefs] = {}


class SharedLink(NamedTuple):
    """A sharded parameter with the unit and state that own it."""

    param: ShardedParam
    unit: Unit
    state: UnitState


def shared_link(param: nn.Parameter, module: nn.Module, name: str) -> SharedLink | None:
    """The owner of ``param`` if ``module.<name>`` shares a parameter that another
    unit already sharded, else None (also under one of its own owners: that is a
    ``fully_shard`` applied top-down, which the caller reports)."""
    refs = _by_original.get(param) or _by_sharded.get(id(param))
    parts = None if refs is None else tuple(ref() for ref in refs)
    if parts is None or any(part is None for part in parts):
        return None
    link = SharedLink(*parts)  # type: ignore[arg-type]
    if param is not link.param.sharded_param and param not in _by_original:
        return None  # a reused id
    if any(m is module and n == name for m, n in link.param.owners):
        return None
    return link


def collect_borrowed(
    modules: Iterable[nn.Module],
    ignored: set[nn.Parameter],
    mesh_info: MeshInfo,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy | Mapping[str, OffloadPolicy],
) -> dict[SharedLink, list[tuple[nn.Module, str]]]:
    """The parameters of a ``fully_shard`` call's ``modules`` that other units already
    own, with the ``(module, attribute)`` pairs that register them here; raises
    (before anything is modified) if this call cannot share one of them."""
    borrowed: dict[SharedLink, list[tuple[nn.Module, str]]] = {}
    for module in modules:
        for name, p in module._parameters.items():
            link = None if p is None else shared_link(p, module, name)
            if link is None:
                continue
            owner, owner_name = link.param.owners[0]
            both = (
                f"{type(module).__name__}.{name} (this fully_shard call) and "
                f"{type(owner).__name__}.{owner_name} (fully_shard({link.param.unit_label}))"
            )
            if p in ignored:
                raise ValueError(
                    f"{both} share one parameter, already sharded by the latter, so it cannot be "
                    "in ignored_params here: remove it from ignored_params (it is sharded once, "
                    "by its first unit), or ignore it in both calls before sharding."
                )
            problem = _incompatibility(link.unit, mesh_info, mp_policy, offload_policy)
            if problem is not None:
                raise ValueError(
                    f"{both} share one parameter, which is sharded once, with the first call's "
                    f"settings, but the calls differ in {problem}. Pass the same value to both "
                    "calls, or put both modules in one unit, e.g. fully_shard([a, b])."
                )
            if link.state.is_root is not None:
                raise ValueError(
                    f"{both} share one parameter, but the latter already ran forward: call "
                    "fully_shard on every module before the first forward."
                )
            borrowed.setdefault(link, []).append((module, name))
    return borrowed


def _incompatibility(
    owner: Unit,
    mesh_info: MeshInfo,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy | Mapping[str, OffloadPolicy],
) -> str | None:
    if owner.mesh_info.mesh != mesh_info.mesh:
        return f"mesh ({owner.mesh_info.mesh} vs {mesh_info.mesh})"
    for field in ("param_dtype", "reduce_dtype"):
        mine, theirs = getattr(mp_policy, field), getattr(owner.mp_policy, field)
        if mine != theirs:
            return f"MixedPrecisionPolicy.{field} ({mine} here vs {theirs})"
    offload = isinstance(offload_policy, CPUOffloadPolicy) and mesh_info.device.type != "cpu"
    # (a per-parameter mapping cannot name a borrowed parameter: it keeps its owner's place)
    if not isinstance(offload_policy, Mapping) and offload != owner.offload:
        there = "offload" if owner.offload else "no offload"
        return f"offload_policy ({type(offload_policy).__name__} here, {there} there)"
    return None


class SharedUses:
    """Counts the uses of borrowed units ([Note: shared parameters]), so that one
    root's scheduler frees and reduces them after their last use. For units nobody
    borrows, every method answers "now"."""

    def __init__(self) -> None:
        self.borrowers: set[Unit] = set()  # the owner units that others borrow
        self._open: dict[Unit, int] = {}  # forward uses begun and not ended
        self._done: dict[Unit, int] = {}  # forward uses ended in this pass
        self._expected: dict[Unit, int] = {}  # forward uses of the last pass with grad
        self._backward_pending: dict[Unit, int] = {}  # uses whose backward is not done

    def __contains__(self, unit: object) -> bool:
        return unit in self.borrowers

    def forward_use_begin(self, unit: Unit) -> None:
        if unit in self.borrowers:
            self._open[unit] = self._open.get(unit, 0) + 1

    def forward_use_end(self, unit: Unit, *, needs_backward: bool) -> bool:
        """Ends a forward use; returns whether ``unit`` may be resharded (no more uses now)."""
        if unit not in self.borrowers:
            return True
        self._open[unit] = self._open.get(unit, 1) - 1
        self._done[unit] = self._done.get(unit, 0) + 1
        if needs_backward:
            self._backward_pending[unit] = self._backward_pending.get(unit, 0) + 1
        # A pass may repeat its pattern of uses (a registered generate() runs forward
        # per token): every ``expected``-th use is a last one.
        expected = self._expected.get(unit)
        return self._open[unit] == 0 and expected is not None and self._done[unit] % expected == 0

    def end_forward_pass(self, *, record: bool) -> list[Unit]:
        """The shared units this forward used (to reshard now); with ``record``, their
        use counts are expected from the next forward on, whose count starts."""
        used = [u for u, n in self._done.items() if n and not self._open.get(u)]
        if record:
            for unit in used:
                self._expected[unit] = self._done[unit]
        self._open.clear()
        self._done.clear()
        return used

    def backward_use_end(self, unit: Unit) -> bool:
        """Ends one use's backward; returns whether it was the last expected (reduce now)."""
        if unit not in self.borrowers:
            return True
        pending = self._backward_pending.get(unit, 0) - 1
        self._backward_pending[unit] = max(pending, 0)
        return pending <= 0

    def end_backward_pass(self) -> None:
        self._backward_pending.clear()

    def reset(self) -> None:
        self._open.clear()
        self._done.clear()
        self._backward_pending.clear()


def is_borrowed(param: nn.Parameter, module: nn.Module, name: str) -> bool:
    """Whether ``module.name`` is a parameter an earlier unit already sharded."""
    return shared_link(param, module, name) is not None


def install(
    state: UnitState,
    replaced: Iterable[tuple[nn.Parameter, ShardedParam, Unit]],
    borrowed: dict[SharedLink, list[tuple[nn.Module, str]]],
) -> None:
    """Links ``state``'s newly sharded parameters (on the original and its sharded
    DTensor) for later borrowers, and makes ``state`` a borrower of the owner units
    in ``borrowed``, registering their parameters under its modules (the tie is kept)."""
    for original, param, unit in replaced:
        key = id(param.sharded_param)

        def drop(ref: weakref.ref[ShardedParam], key: int = key) -> None:
            if _by_sharded.get(key, (None,))[0] is ref:
                del _by_sharded[key]

        refs = (weakref.ref(param, drop), weakref.ref(unit), weakref.ref(state))
        _by_original[original] = refs
        _by_sharded[key] = refs
    for link, pairs in borrowed.items():
        sp = link.param
        sp.owners.extend(pairs)
        sp.register(sp.registered())  # type: ignore[arg-type]
        if link.unit not in state.borrowed:
            state.borrowed.append(link.unit)
        register_state_dict_hooks(link.unit, link.state, [(m, n, sp) for m, n in pairs])


def count_uses(units: list[Unit], states: list[UnitState], root: nn.Module) -> SharedUses | None:
    """The use counter of the units that ``states`` borrow (None if none does); an
    owner outside this root's tree (``units``) could never be coordinated: raise."""
    uses = SharedUses()
    for state in states:
        for unit in state.borrowed:
            if unit not in units:
                names = {id(m): name for name, m in root.named_modules()}
                borrower = ", ".join(names.get(id(m)) or type(m).__name__ for m in state.modules)
                raise RuntimeError(
                    f"fully_shard module {borrower!r} shares a parameter with unit "
                    f"{unit.name!r}, which is not under the root {type(root).__name__} that "
                    "ran forward. Modules that share a parameter must belong to one "
                    "fully_shard tree: call fully_shard on their common parent and run "
                    "forward through it."
                )
            uses.borrowers.add(unit)
    return uses if uses.borrowers else None
