"""The ranks' agreement on an I/O step's outcome: one that fails on one rank
fails on every rank at once, the process group usable after (the runtime's
``agree_or_raise``; see [Note: all ranks agree or all raise])."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._agree import CollectiveExchange, agree_or_raise
from .._runtime import ToolCollectives


def dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _exchange(comms: ToolCollectives) -> CollectiveExchange:
    on_gpu = dist.get_backend(comms.group) == "nccl"  # its one-integer flags live there
    return CollectiveExchange(comms, torch.device("cuda") if on_gpu else None)


def agree_ok(error: BaseException | None, comms: ToolCollectives) -> bool:
    """True when no rank of ``comms``' group failed (collective when a process
    group exists)."""
    if not dist_on():
        return error is None
    return not _exchange(comms).any(error is not None)


def raise_if_any_failed(
    error: BaseException | None,
    what: str,
    comms: ToolCollectives,
    outcome: str = "nothing was published",
) -> None:
    """Raises on every rank of ``comms``' group if ``error`` is set on any
    (collective when a process group exists): the failing rank its own error, the
    others a ``RuntimeError`` quoting it and ``outcome``. Every rank returns or
    raises together, so the process group stays usable."""
    if not dist_on():
        if error is not None:
            raise error
        return

    def explain(failures: dict[int, str]) -> str:
        ranks = comms.ranks()
        failed = "; ".join(f"rank {ranks[r]}: {m}" for r, m in sorted(failures.items()))
        return f"{what} failed on another rank ({failed}); {outcome}."

    agree_or_raise(error, _exchange(comms), explain, raise_own=True)
