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
list of descriptors (position in ``param_groups``, the name given to the
optimizer if any, the label of the unit that sharded it, shape, dtype, whether it
has a gradient) and to a 64-bit digest of that list. One all-reduce of two
integers (``MAX`` of ``(d, -d)``) per shard group tells every rank whether all
digests are equal; only when they are not do the ranks gather the full lists
(``all_gather_object``) to name the first differing matrix, and every rank raises
the same error. The digest of a rank's list is cached per list (a bounded
dictionary), so a step costs one small collective and no hashing.

Without names (an optimizer built from ``model.parameters()``), two matrices of
the same shape and unit class in another order cannot be told apart: build the
optimizer from ``model.named_parameters()`` to have the names compared too.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch
import torch.distributed as dist

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
    return f"{position}{named} of fully_shard({label}), shape {shape}, {dtype}, {grad} a gradient"


def check_agreement(
    group: dist.ProcessGroup,
    digest: int,
    descriptors: Callable[[], list[Descriptor]],
    what: str,
) -> None:
    """Raises the same ``RuntimeError`` on every rank of ``group`` unless every
    rank passed the same ``digest`` (of its ``descriptors()``), naming the first
    matrix on which the ranks differ. A collective: every rank of ``group`` must
    call it."""
    flags = torch.tensor([digest, -digest], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    if flags[0].item() == -flags[1].item():  # max == min: every rank passed the same digest
        return
    lists: list[list[Descriptor] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(lists, descriptors(), group=group)
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
    raise RuntimeError(
        f"fsdp_compose: the ranks of a shard group disagree on the matrices {what} "
        f"updates, at matrix {k} (ranks within the shard group): {detail}. Every rank "
        "must build the optimizer from the same parameters in the same order, and the "
        "same parameters must have gradients on every rank (a parameter unused on one "
        "rank still needs a gradient, e.g. a zero one; build the optimizer from "
        "model.named_parameters() to have names compared). Nothing was updated."
    )
