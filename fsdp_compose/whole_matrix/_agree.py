"""Checks that the ranks of a shard group agree before whole matrices move.

[Note: ranks agree on the matrices before the exchange]
The exchange (see [Note: owner compute for whole-matrix optimizers]) trusts
every rank of a shard group to hand it the same matrices in the same order: the
owner of matrix ``i`` assembles it from every rank's rows of *its* matrix ``i``.
If one rank's optimizer holds two matrices of the same shape in another order,
their rows are silently mixed; if the shapes or the set of matrices with a
gradient differ, the all-to-all splits disagree and the job fails inside the
collective (or hangs until the process group's timeout).

So before any data moves, each rank reduces what it is about to exchange to a
list of descriptors (position in ``param_groups``, its name, the label of the
unit that sharded it, shape, dtype, whether it has a gradient) and to a 64-bit
digest of that list. The runtime's ``raise_unless_same`` (see [Note: all ranks
agree or all raise]) compares the digests with one all-reduce of two integers
(``MAX`` of ``(d, -d)``) per shard group; only when they differ do the ranks
gather the full lists (``all_gather_object``) to name the first differing matrix,
and every rank raises the same error. The collectives go through the runtime,
labelled with the optimizer's operation (``muon.exchange``), so debug mode and the
timeline of the parameters' root see them. The digest of a rank's list is cached per list (a bounded
dictionary), so a step costs one small collective and no hashing. Muon's and
Adafactor's sharded steps both check (Adafactor's all-reduces of partial sums
would otherwise mix matrices the same way).

The name is the one given to the optimizer (built from
``model.named_parameters()``), else the parameter's name under its root, which
the runtime records on every sharded parameter at the root's lazy init (so two
matrices of the same shape in another order are told apart even for an
optimizer built from ``model.parameters()``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .._agree import (
    CollectiveExchange,
    CollectiveMismatchError,
    agree_or_raise,
    raise_unless_same,
)
from .._runtime import PendingCollective, ToolCollectives, fqn_of, owner_of

if TYPE_CHECKING:  # _exchange imports this module
    from ._exchange import Layouts, ShardLayout

#: One matrix as the ranks compare it: (position, name, unit label, shape, dtype, has grad).
Descriptor = tuple[str, str, str, tuple[int, ...], str, bool]


class DigestCache:
    """Digests of descriptor lists, keyed by a caller's cheap local key (e.g. the
    parameters' ids and which have gradients); at most ``limit`` entries, least
    recently used evicted first."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._entries: OrderedDict[Hashable, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def digest(self, key: Hashable, descriptors: Callable[[], list[Descriptor]]) -> int:
        """The digest of ``descriptors()`` (the list ``key`` stands for on this rank;
        called only when ``key`` is not cached)."""
        value = self._entries.get(key)
        if value is None:
            raw = hashlib.blake2b(repr(descriptors()).encode(), digest_size=8).digest()
            value = int.from_bytes(raw, "little", signed=True)
            self._entries[key] = value
            while len(self._entries) > self.limit:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        return value


def describe(descriptor: Descriptor) -> str:
    position, name, label, shape, dtype, has_grad = descriptor
    named = f" {name!r}" if name else ""
    grad = "with" if has_grad else "without"
    unit = f" of fully_shard({label})" if label else ""
    return f"{position}{named}{unit}, shape {shape}, {dtype}, {grad} a gradient"


def check_optimizer_agreement(
    optimizer: torch.optim.Optimizer,
    digests: DigestCache,
    layout: ShardLayout,
    items: Sequence[tuple[int, int, torch.Tensor, bool]],
    what: str,
    label: str,
) -> None:
    """:func:`check_agreement` for an optimizer's parameters of one shard group:
    ``items`` holds (group index, position, parameter, has a gradient) for every
    parameter of the group the sharded step handles, gradient or not; the
    collectives are labelled ``label``."""
    if layout.group is None or layout.world == 1:
        return

    def descriptors() -> list[Descriptor]:
        out: list[Descriptor] = []
        for gi, pi, p, has_grad in items:
            names = optimizer.param_groups[gi].get("param_names")
            if names is not None and pi < len(names):
                name = str(names[pi])
            else:  # the runtime's name for it (see the note above)
                name = fqn_of(p) or ""
            label = owner_of(p) or ""
            position = f"param_groups[{gi}]['params'][{pi}]"
            out.append((position, name, label, tuple(p.shape), str(p.dtype), has_grad))
        return out

    key = tuple((id(p), has_grad) for _, _, p, has_grad in items)
    comms = ToolCollectives(label, layout.group, owner=items[0][2] if items else None)
    check_agreement(comms, digests.digest(key, descriptors), descriptors, what)


def check_agreement(
    comms: ToolCollectives,
    digest: int,
    descriptors: Callable[[], list[Descriptor]],
    what: str,
) -> None:
    """Raises the same :class:`CollectiveMismatchError` (a ``RuntimeError``) on every rank of ``comms``' group unless
    every rank passed the same ``digest`` (of its ``descriptors()``), naming the
    first matrix on which the ranks differ. A collective: every rank of the group
    must call it."""
    raise_unless_same(
        digest,
        CollectiveExchange(comms),
        lambda lists: _disagreement(lists, what, comms.label),
        describe=descriptors,
        error_type=CollectiveMismatchError,
    )


def _disagreement(lists: list[list[Descriptor] | None], what: str, label: str) -> str:
    """The message naming the first matrix on which the ranks' ``lists`` differ."""
    gathered = [lst or [] for lst in lists]
    length = max(len(lst) for lst in gathered)
    k = 0
    for k in range(length):
        seen = [lst[k] if k < len(lst) else None for lst in gathered]
        if any(s != seen[0] for s in seen):
            detail = "; ".join(
                f"rank {r} has {describe(s) if s is not None else 'nothing'}"
                for r, s in enumerate(seen)
            )
            break
    else:  # equal lists with different digests: a hash collision cannot give this
        detail = "the lists are equal but their digests differ"
    return (
        f"fsdp_compose: the ranks of a shard group disagree on the matrices {what} "
        f"updates, at matrix {k} (ranks within the shard group): {detail}. Their "
        f"{label} collectives would not match, so none was issued. Every rank "
        "must build the optimizer from the same parameters in the same order, and the "
        "same parameters must have gradients on every rank (a parameter unused on one "
        "rank still needs a gradient, e.g. a zero one). Nothing was updated."
    )


class RoundOutcomes:
    """Which owners' computations failed, agreed round by round.

    [Note: a failing computation on its owner]
    The function an owner runs on a full matrix (Newton–Schulz, a user's
    ``map_full_matrices`` function) may raise on that rank alone. Raising there
    at once would leave the other ranks in the exchange's next collective until
    the process group's timeout. Instead the owner records the error, returns
    zeros for that matrix and keeps taking part; with each round's return, every
    rank all-reduces (asynchronously, waited for just before the round's results
    are applied) one integer per rank of the group: ``1 + `` the first matrix
    that failed on that owner in the round, or 0. Every rank then skips the
    failed matrices' results (the owner included), applies the others, finishes
    every round, and at the end all raise the same error naming the matrix, its
    owner and the owner's message. The process group stays usable.
    """

    def __init__(self, comms: ToolCollectives, rank: int, world: int, device: torch.device):
        self.comms, self.rank, self.world, self.device = comms, rank, world, device
        self.errors: dict[int, BaseException] = {}  # matrix -> its error, on its owner
        self.failed: dict[int, int] = {}  # matrix -> owner, on every rank

    def compute(
        self,
        fn: Callable[[int, torch.Tensor], torch.Tensor],
        i: int,
        full: torch.Tensor,
        shape: tuple[int, int],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """``fn(i, full)`` in ``dtype``, contiguous (a tall matrix's result is a
        transposed view; rows need it contiguous), or zeros of ``shape`` after
        recording the error it raised."""
        try:
            return fn(i, full).to(dtype).contiguous()
        except Exception as exc:
            self.errors.setdefault(i, exc)
            return torch.zeros(shape, dtype=dtype, device=self.device)

    def post(self, mine: list[int]) -> tuple[torch.Tensor, PendingCollective]:
        """Posts this round's outcome (``mine``: the matrices this rank computed)."""
        flags = torch.zeros(self.world, dtype=torch.int64)
        first = min((i for i in mine if i in self.errors), default=-1)
        flags[self.rank] = first + 1
        flags = flags.to(self.device)
        return flags, self.comms.all_reduce(flags, "max", async_op=True)

    def failed_owners(self, posted: tuple[torch.Tensor, PendingCollective]) -> set[int]:
        """The owners whose computation failed in the round ``posted`` describes."""
        flags, pending = posted
        pending.wait()
        values = flags.tolist()
        owners = {r for r, v in enumerate(values) if v}
        for r in owners:
            self.failed.setdefault(values[r] - 1, r)
        return owners

    def raise_if_any(self, describe: Callable[[int], str]) -> None:
        """Raises the same error on every rank if any computation failed (then
        one ``all_gather_object`` of the owners' messages; the rounds' flags have
        already told every rank whether any did)."""
        if not self.failed:
            return
        i = min(self.failed)
        owner = self.failed[i]

        def explain(failures: dict[int, Any]) -> str:
            text = (failures.get(owner) or {}).get(i, "(no message)")
            return (
                f"fsdp_compose: the whole-matrix computation of {describe(i)} raised on its "
                f"owner, rank {owner} of the shard group: {text}. Every rank skipped that "
                f"matrix's update and applied the others'; {len(self.failed)} matrix(es) "
                "failed this step."
            )

        mine = {j: f"{type(e).__name__}: {e}" for j, e in self.errors.items()}
        agree_or_raise(
            self.errors.get(i),
            CollectiveExchange(self.comms),
            explain,
            report=mine or {},
            any_failed=True,
        )


#: Per shard group (by id): its layout and the (group index, position, parameter,
#: has a gradient) of every parameter of the optimizer's step on it.
Members = dict[int, tuple["ShardLayout", list[tuple[int, int, torch.Tensor, bool]]]]


def add_member(members: Members, layout: ShardLayout, gi: int, pi: int, p: torch.Tensor) -> None:
    """Records ``param_groups[gi]['params'][pi]`` under its shard group."""
    members.setdefault(id(layout.group), (layout, []))[1].append((gi, pi, p, p.grad is not None))


def agree_and_prune(
    optimizer: torch.optim.Optimizer,
    digests: DigestCache,
    layouts: Layouts,
    members: Members,
    what: str,
    label: str,
) -> None:
    """Checks every shard group's agreement (:func:`check_optimizer_agreement`, its
    collectives labelled ``label``), then drops the layouts of parameters the
    optimizer no longer holds."""
    for layout, items in members.values():
        check_optimizer_agreement(optimizer, digests, layout, items, what, label)
    layouts.prune({id(p) for _, items in members.values() for _, _, p, _ in items})
