"""All ranks agree, or all raise: the one mechanism behind every agreement.

[Note: all ranks agree or all raise]
A step that fails on one rank only (a file unreadable there, an owner's
Newton–Schulz raising, ranks that built different models) must not leave the
other ranks in their next collective until the process group's timeout. So the
ranks exchange their outcome: :func:`agree_or_raise` takes each rank's error (or
``None``), and where any rank has one, every rank raises the same exception type,
its message naming each failing rank's error (``raise_own``: a failing rank
raises its own exception, the others the common one). :func:`raise_unless_same`
compares a value every rank computes (a digest, a description) and, where they
differ, raises on every rank from what each rank describes.

Two transports: :class:`CollectiveExchange` issues the tool's collectives through
the runtime ([Note: tools' collectives]): a one-integer all-reduce, then only on
failure an object gather. :class:`StoreExchange` goes through the job's key-value
store, so that the checks and debug mode, which must issue exactly FSDP2's
collectives, communicate without any: each rank publishes its value, waits for
every other rank's and reads them all (three store requests a round; a rank
that waits on a single rank and a barrier instead costs several store polls). Its rounds are numbered per topic and
group of ranks in a table of the default process group of the rank (a weak map,
so a new process group starts from zero and each threaded rank counts its own):
two roots on one group number their rounds together and never collide.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ._runtime import ToolCollectives

__all__ = [
    "CollectiveExchange",
    "CollectiveMismatchError",
    "Exchange",
    "RanksMissing",
    "StoreExchange",
    "agree_or_raise",
    "raise_unless_same",
]


class CollectiveMismatchError(RuntimeError):
    """Ranks of one process group issued, or were about to issue, different
    collectives (or some none): raised on every rank, by the debug checks
    (``fsdp_compose.debug``) and by a tool whose ranks disagree on what its next
    collective exchanges (a whole-matrix optimizer's matrices)."""

    __module__ = "fsdp_compose.debug"  # where users import it from


class Exchange(Protocol):
    """How the ranks of a group share a value."""

    def ranks(self) -> list[int]:
        """The group's global ranks, by group rank."""
        ...

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank."""
        ...

    def same(self, value: Any) -> bool:
        """Whether every rank passed an equal ``value``."""
        ...

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by group rank."""
        ...


class CollectiveExchange:
    """An :class:`Exchange` through a tool's collectives (``comms``); the flags live
    on ``device`` (a CUDA device for an NCCL-only group)."""

    def __init__(self, comms: ToolCollectives, device: torch.device | None = None) -> None:
        self.comms, self.device = comms, device

    def ranks(self) -> list[int]:
        return self.comms.ranks()

    def any(self, flag: bool) -> bool:
        flags = torch.tensor([int(flag)], dtype=torch.int64, device=self.device)
        self.comms.all_reduce(flags)
        return int(flags.item()) > 0

    def same(self, value: Any) -> bool:
        """``value``: a 64-bit integer (a digest); one all-reduce of two integers."""
        flags = torch.tensor([value, -value], dtype=torch.int64, device=self.device)
        self.comms.all_reduce(flags, "max")
        return int(flags[0].item()) == -int(flags[1].item())  # max == min

    def gather(self, obj: Any) -> list[Any]:
        return self.comms.all_gather_object(obj)


class RanksMissing(RuntimeError):
    """Some ranks of a :class:`StoreExchange` did not publish within its timeout."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


# Per default process group (weakly): the next round of each (topic, rank, ranks).
_rounds: weakref.WeakKeyDictionary[Any, dict[tuple[str, int, tuple[int, ...]], int]] = (
    weakref.WeakKeyDictionary()
)


def _default_store() -> dist.Store:
    # torch's private accessor: the store the default process group was built on.
    return dist.distributed_c10d._get_default_store()


class StoreExchange:
    """An :class:`Exchange` of strings through the job's key-value store among the
    global ``ranks``, under ``topic``; a rank missing for ``timeout`` seconds
    raises :class:`RanksMissing` (see [Note: all ranks agree or all raise])."""

    def __init__(self, topic: str, ranks: tuple[int, ...], timeout: float) -> None:
        self.topic, self._ranks, self.timeout = topic, ranks, timedelta(seconds=timeout)
        self.round = -1  # the number of the latest round
        self._values: tuple[str, list[str]] | None = None  # latest: (mine, every rank's)
        self._deletes = True

    def ranks(self) -> list[int]:
        return list(self._ranks)

    def any(self, flag: bool) -> bool:
        return not self.same(str(int(flag))) or flag

    def same(self, value: Any) -> bool:
        """One round: publishes ``str(value)``, reads every rank's."""
        mine, ranks, me = str(value), self._ranks, dist.get_rank()
        counts = _rounds.setdefault(dist.group.WORLD, {})
        self.round = n = counts.get((self.topic, me, ranks), 0)
        counts[(self.topic, me, ranks)] = n + 1
        store, key = _default_store(), self._key(n)
        store.set(f"{key}{me}", mine)
        self._wait(store, key, [r for r in ranks if r != me])
        values = [v.decode() for v in store.multi_get([f"{key}{r}" for r in ranks])]
        self._forget(store, key=self._key(n - 1))  # every rank has read it: it published n
        self._values = (mine, values)
        return all(v == values[0] for v in values)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``str(obj)``: the latest round's values when ``obj`` is what
        it published, else a new round."""
        if self._values is None or self._values[0] != str(obj):
            self.same(obj)
        assert self._values is not None
        return list(self._values[1])

    def _key(self, n: int) -> str:
        group = hashlib.sha1(repr(self._ranks).encode()).hexdigest()[:12]
        return f"fsdp_compose/{self.topic}/{group}/{n}/"

    def _wait(self, store: dist.Store, key: str, names: list[Any]) -> None:
        try:
            store.wait([f"{key}{name}" for name in names], self.timeout)
        except RuntimeError as exc:
            missing = [r for r in self._ranks if not store.check([f"{key}{r}"])]
            raise RanksMissing(
                f"ranks {missing} published nothing for round {self.round} of {self.topic}",
                missing,
            ) from exc

    def _forget(self, store: dist.Store, key: str) -> None:
        """Deletes this rank's value of a round (the store stays small over a run)."""
        if not self._deletes or key.endswith("/-1/"):
            return
        try:
            store.delete_key(f"{key}{dist.get_rank()}")
        except (RuntimeError, NotImplementedError):  # a store without deletes
            self._deletes = False


def _describe(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def agree_or_raise(
    error: BaseException | None,
    exchange: Exchange,
    explain: Callable[[dict[int, Any]], str],
    *,
    error_type: type[Exception] = RuntimeError,
    raise_own: bool = False,
    report: Any = None,
    any_failed: bool | None = None,
) -> None:
    """Returns on every rank of ``exchange``'s group if no rank has an error, else
    raises on every rank ``error_type(explain(failures))``, ``failures`` mapping each
    failing rank (group rank) to its report (see [Note: all ranks agree or all
    raise]).

    Args:
        error: this rank's error, ``None`` if it succeeded.
        exchange: the transport (collectives or the store).
        explain: the message, from the failing ranks' reports.
        error_type: the exception every rank raises.
        raise_own: a rank with an ``error`` raises it, the others ``error_type``.
        report: what this rank contributes (default: ``error``'s type and message;
            ``None`` with no error).
        any_failed: whether any rank failed, where the caller's ranks have already
            agreed on it (no flag is exchanged).
    """
    mine = report if report is not None else _describe(error)
    if any_failed is None:
        any_failed = exchange.any(mine is not None)
    if not any_failed:
        return
    reports = exchange.gather(mine)
    if raise_own and error is not None:
        raise error
    failures = {r: m for r, m in enumerate(reports) if m is not None}
    raise error_type(explain(failures)) from error


def raise_unless_same(
    value: Any,
    exchange: Exchange,
    explain: Callable[[list[Any]], str],
    *,
    describe: Callable[[], Any] | None = None,
    error_type: type[Exception] = RuntimeError,
) -> None:
    """Returns on every rank of ``exchange``'s group if every rank passed an equal
    ``value``, else raises ``error_type(explain(descriptions))`` on every rank, from
    each rank's ``describe()`` (default: its ``value``), by group rank."""
    if exchange.same(value):
        return
    raise error_type(explain(exchange.gather(value if describe is None else describe())))
