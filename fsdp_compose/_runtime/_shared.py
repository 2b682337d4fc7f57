"""Parameters shared across units: tied embeddings, weights reused by several blocks.

[Note: shared parameters]
A parameter registered under modules that belong to different ``fully_shard``
units (an LM head tied to the embedding, each annotated on its own; one weight
used by two blocks in different units) is sharded **once**, by the first
``fully_shard`` call that manages it: that call's unit is the parameter's
*owner*. Every later call that finds the parameter under one of its modules
becomes a *borrower* of the owner unit: it manages no copy of the parameter, it
registers the owner's parameter object under its module (so the tie is kept:
``head.weight is tok_emb.weight``, sharded or unsharded, and
``named_parameters()`` lists it once), and its hooks tell the scheduler when it
uses the owner unit.

The owner unit's settings govern the parameter: its mesh, mixed precision and
offload policy must equal the borrower's (checked at ``fully_shard`` time, naming
both modules), and its ``reshard_after_forward``, ``reshard_after_backward`` and
``requires_gradient_sync`` apply. Borrowing is per unit: a borrower that uses the
parameter gathers the owner's whole unit, so give a shared parameter its own
small unit (e.g. annotate the embedding) when the owner holds much else.

:class:`SharedUses` counts every use, the owner's own and the borrowers' (the
scheduler asks it; the borrowers' hooks report through the scheduler):

* forward: the owner unit stays unsharded from its first use until its last use
  of the pass (known from the number of uses in the previous forward with
  gradients; the end of the forward in the first), then its
  ``reshard_after_forward`` applies. So it is gathered once per
  forward, like the manual workaround ``fully_shard([model.tok_emb,
  model.lm_head])``, and freed earlier when its last user runs before the end.
* backward: every borrower gathers the owner unit for its backward (whatever the
  owner's ``set_unshard_in_backward``), and the unit stays unsharded until the
  backward of every use recorded in forward is done (a use whose inputs need no
  gradient is done at the end of backward). Only then are its gradients, which
  autograd has summed over all uses on the one unsharded parameter, reduced: once
  per backward, after the parameter's last use.

If a use's backward ends before the count expects (graphs of earlier forwards
kept alive across backwards), the gradients that arrive later are reduced again
at the end of backward and added to the sharded gradient: a second collective,
never a lost or double-counted gradient.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

from torch import nn

from ._mesh import MeshInfo
from ._policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._sharded_param import ShardedParam
from ._state_dict import register_state_dict_hooks
from ._unit import Unit

if TYPE_CHECKING:
    from ._hooks import UnitState

__all__ = ["SharedLink", "SharedUses", "collect_borrowed", "link_shared", "shared_link"]

# On an original parameter that fully_shard replaced, and on the sharded DTensor
# parameter that replaced it: where a later fully_shard call finds its owner.
_SHARED_AS = "_fsdp_compose_shared_as"


class SharedLink(NamedTuple):
    """A sharded parameter with the unit and state that own it."""

    param: ShardedParam
    unit: Unit
    state: UnitState


def link_shared(original: nn.Parameter, param: ShardedParam, unit: Unit, state: UnitState) -> None:
    """Records ``param``'s owner on the parameter it replaced and on its sharded
    DTensor, so that a later ``fully_shard`` call sharing it can borrow it."""
    link = SharedLink(param, unit, state)
    setattr(original, _SHARED_AS, link)
    setattr(param.sharded_param, _SHARED_AS, link)


def shared_link(param: nn.Parameter, module: nn.Module, name: str) -> SharedLink | None:
    """The owner of ``param`` if ``module.<name>`` shares a parameter that another
    unit already sharded, else None.

    A sharded parameter found under one of its own owners is not shared: that is
    a ``fully_shard`` applied top-down, which the caller reports.
    """
    link: SharedLink | None = getattr(param, _SHARED_AS, None)
    if link is None or any(m is module and n == name for m, n in link.param.owners):
        return None
    return link


def _where(module: nn.Module, name: str) -> str:
    return f"{type(module).__name__}.{name}"


def collect_borrowed(
    modules: Iterable[nn.Module],
    ignored: set[nn.Parameter],
    mesh_info: MeshInfo,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
) -> dict[SharedLink, list[tuple[nn.Module, str]]]:
    """The parameters of ``modules`` that other units already own, with the
    ``(module, attribute)`` pairs that register them here; raises (before anything
    is modified) if this call cannot share one of them.

    Args:
        modules: the modules whose parameters this ``fully_shard`` call manages.
        ignored: the call's ``ignored_params``.
        mesh_info: the call's data-parallel layout.
        mp_policy: the call's mixed precision policy.
        offload_policy: the call's offload policy.
    """
    borrowed: dict[SharedLink, list[tuple[nn.Module, str]]] = {}
    for module in modules:
        for name, p in module._parameters.items():
            if p is None:
                continue
            link = shared_link(p, module, name)
            if link is None:
                continue
            owner = link.param.owners[0]
            both = (
                f"{_where(module, name)} (this fully_shard call) and {_where(*owner)} "
                f"(fully_shard({link.param.unit_label}))"
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
    owner: Unit, mesh_info: MeshInfo, mp_policy: MixedPrecisionPolicy, offload_policy: OffloadPolicy
) -> str | None:
    if owner.mesh_info.mesh != mesh_info.mesh:
        return f"mesh ({owner.mesh_info.mesh} vs {mesh_info.mesh})"
    for field in ("param_dtype", "reduce_dtype"):
        mine, theirs = getattr(mp_policy, field), getattr(owner.mp_policy, field)
        if mine != theirs:
            return f"MixedPrecisionPolicy.{field} ({mine} here vs {theirs})"
    offload = isinstance(offload_policy, CPUOffloadPolicy) and mesh_info.device.type != "cpu"
    if offload != owner.offload:
        return f"offload_policy ({type(offload_policy).__name__} here, {'' if owner.offload else 'no '}offload there)"
    return None


def borrow(state: UnitState, borrowed: dict[SharedLink, list[tuple[nn.Module, str]]]) -> None:
    """Makes ``state`` a borrower of each owner unit in ``borrowed``: the owner's
    parameter is registered under the borrowing modules (the tie is kept)."""
    for link, pairs in borrowed.items():
        sp = link.param
        sp.owners.extend(pairs)
        sp.register(sp.registered())  # type: ignore[arg-type]
        if link.unit not in state.borrowed:
            state.borrowed.append(link.unit)


class SharedUses:
    """Counts the uses of units that other units borrow (see [Note: shared
    parameters]), so that one root's scheduler frees and reduces them after their
    last use; the core's :class:`~fsdp_compose._scheduler.SharedUseCounter`.

    Units nobody borrows are not counted: every method answers "now" for them.
    """

    def __init__(self) -> None:
        self.borrowers: dict[Unit, list[str]] = {}  # owner unit -> borrowing modules
        self._open: dict[Unit, int] = {}  # forward uses begun and not ended
        self._done: dict[Unit, int] = {}  # forward uses ended in this pass
        self._expected: dict[Unit, int] = {}  # forward uses of the last pass with grad
        self._backward_pending: dict[Unit, int] = {}  # uses whose backward is not done

    def __contains__(self, unit: object) -> bool:
        return unit in self.borrowers

    # -- what the scheduler asks -------------------------------------------

    def forward_use_begin(self, unit: Unit) -> None:
        if unit in self.borrowers:
            self._open[unit] = self._open.get(unit, 0) + 1

    def forward_use_end(self, unit: Unit, *, needs_backward: bool) -> bool:
        """Ends a forward use; returns whether ``unit`` may be resharded now (no
        further use of it is expected in this forward)."""
        if unit not in self.borrowers:
            return True
        self._open[unit] = self._open.get(unit, 1) - 1
        self._done[unit] = self._done.get(unit, 0) + 1
        if needs_backward:
            self._backward_pending[unit] = self._backward_pending.get(unit, 0) + 1
        # A pass may repeat the pattern of uses (generate registered as one forward
        # calls forward once per token): every ``expected``-th use is a last one.
        expected = self._expected.get(unit)
        return self._open[unit] == 0 and expected is not None and self._done[unit] % expected == 0

    def end_forward_pass(self, *, record: bool) -> list[Unit]:
        """The shared units this forward used (their resharding policy applies now);
        with ``record``, their use counts are expected from the next forward on.
        Starts the count of the next forward."""
        used = [u for u, n in self._done.items() if n and not self._open.get(u)]
        if record:
            for unit in used:
                self._expected[unit] = self._done[unit]
        self._open.clear()
        self._done.clear()
        return used

    def backward_use_end(self, unit: Unit) -> bool:
        """Ends the backward of one use; returns whether it was the last one
        expected, so that ``unit``'s gradients can be reduced now."""
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
    """Links ``state``'s newly sharded parameters for later borrowers, and
    registers the parameters it borrows under its modules."""
    for original, param, unit in replaced:
        link_shared(original, param, unit, state)
    borrow(state, borrowed)
    for link, pairs in borrowed.items():
        register_state_dict_hooks(link.unit, link.state, [(m, n, link.param) for m, n in pairs])


def count_uses(units: list[Unit], states: list[UnitState], root: nn.Module) -> SharedUses | None:
    """The use counter of the units that ``states`` borrow (None if none does); an
    owner outside this root's tree (``units``) could never be coordinated: raise."""
    borrowing = [state for state in states if state.borrowed]
    if not borrowing:
        return None
    uses = SharedUses()
    names = {id(m): name for name, m in root.named_modules()}
    for state in borrowing:
        for unit in state.borrowed:
            borrower = ", ".join(names.get(id(m)) or type(m).__name__ for m in state.modules)
            if unit not in units:
                raise RuntimeError(
                    f"fully_shard module {borrower!r} shares a parameter with unit "
                    f"{unit.name!r}, which is not under the root {type(root).__name__} that "
                    "ran forward. Modules that share a parameter must belong to one "
                    "fully_shard tree: call fully_shard on their common parent and run "
                    "forward through it."
                )
            uses.borrowers.setdefault(unit, []).append(borrower)
    return uses
