"""The ranks' agreement on an I/O step's outcome: one that fails on one rank
fails on every rank at once, the process group usable after."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def agree_ok(error: BaseException | None, group: Any = None) -> bool:
    """True when no rank of ``group`` failed (collective when a process group exists)."""
    if not dist_on():
        return error is None
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, group=group)
    return int(flag.item()) == 0


def raise_if_any_failed(
    error: BaseException | None,
    what: str,
    outcome: str = "nothing was published",
    group: Any = None,
) -> None:
    """Raises on every rank of ``group`` if ``error`` is set on any (collective
    when a process group exists): the failing rank its own error, the others a
    ``RuntimeError`` quoting it and ``outcome``. Every rank returns or raises
    together, so the process group stays usable."""
    if not dist_on():
        if error is not None:
            raise error
        return
    if agree_ok(error, group):
        return
    messages: list[str | None] = [None] * dist.get_world_size(group)
    mine = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(messages, mine, group=group)
    if error is not None:
        raise error
    ranks = dist.get_process_group_ranks(group) if group is not None else range(len(messages))
    failed = "; ".join(f"rank {r}: {m}" for r, m in zip(ranks, messages) if m is not None)
    raise RuntimeError(f"{what} failed on another rank ({failed}); {outcome}.")
