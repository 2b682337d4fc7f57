"""gloo's collectives issued fast: on the ProcessGroup object directly, an
all-gather as one broadcast per rank, and a reduce-scatter as one all-to-all.

[Note: reduce-scatter on gloo]
gloo has no native reduce-scatter: torch emulates it with a full all-reduce, which
sends (W-1)/W * 2 * N bytes per rank (ring) or more, instead of (W-1)/W * N. On gloo
we instead exchange the gradient chunks with one ``all_to_all_single`` (each rank
sends chunk r to rank r and receives everyone's chunk of its own shard) and sum the
W received chunks locally, which moves exactly (W-1)/W * N bytes per rank.

[Note: all-gather on gloo]
gloo's all-gather gathers into a buffer of its own and then copies every row into
the caller's output: one extra copy of the whole output (and an allocation) per
call, on gloo's thread. Above a small size, fsdp_compose instead issues one
broadcast per rank, each rooted at the rank whose row it carries and received
straight into that row of the output; this rank's row is written in place before
(the caller copies its shards there). Same bytes on the wire ((W-1)/W * N per
rank), about half the CPU and wall time (measured at 2 and 4 ranks, 1.7-12 MiB
rows, torch 2.13). ``FSDP_COMPOSE_GLOO_ALL_GATHER=native`` turns it off.

Used only for groups whose CPU backend really is ``ProcessGroupGloo``
(:func:`serves_cpu_with_gloo`); which path a group takes is its :class:`Route`,
see [Note: collectives per backend] in ``_collectives.py``.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from . import _compat, _env

logger = logging.getLogger("fsdp_compose")

# [Note: issuing gloo collectives]
# On the CPU, torch.distributed's Python wrappers (argument checks, group
# translation, coalescing bookkeeping) cost about as much as the collective's own
# issue for small tensors: 16-24 us of ~60 us per call (measured, torch 2.13).
# With hundreds of small units per step that is most of the per-unit overhead, so
# gloo collectives are issued on the ProcessGroup object directly. Accelerator
# backends keep the wrappers: they decide which stream the collective runs on.
# Only for groups whose CPU backend is a ProcessGroupGloo (serves_cpu_with_gloo):
# a group without one (torch's threaded test group, a CUDA-only group) has nothing
# to issue on, see [Note: collectives per backend] in _collectives.py.
_direct_gloo_ok = True


_W = TypeVar("_W")


def _issue_gloo(direct: Callable[[], _W], fallback: Callable[[], _W | None]) -> _W:
    global _direct_gloo_ok
    if _direct_gloo_ok:
        try:
            return direct()
        except (AttributeError, TypeError):  # pragma: no cover - binding changed
            _direct_gloo_ok = False
    work = fallback()
    assert work is not None
    return work


def gloo_all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup
) -> dist.Work:
    """Asynchronous all-gather on a gloo ``group`` (see [Note: issuing gloo collectives])."""
    return _issue_gloo(
        lambda: group._allgather_base(output, input),
        lambda: _compat.all_gather_into_tensor(output, input, group, async_op=True),
    )


class WorkGroup:
    """Several ``Work`` objects behaving as one: ``wait`` waits for all of them and
    ``get_future`` completes when all have."""

    __slots__ = ("_works",)

    def __init__(self, works: list[dist.Work]) -> None:
        self._works = works

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return torch.futures.collect_all([work.get_future() for work in self._works])


def gloo_all_gather_by_broadcast(output: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
    """Asynchronous all-gather on a gloo ``group`` as one broadcast per rank, each
    straight into its row of ``output`` (this rank's row already holds its input).
    See [Note: all-gather on gloo]."""
    rows = output.view(group.size(), -1)

    def direct() -> WorkGroup:
        works = []
        for root in range(group.size()):
            opts = dist.BroadcastOptions()
            opts.rootRank = root
            opts.rootTensor = 0
            works.append(group.broadcast([rows[root]], opts))
        return WorkGroup(works)

    def fallback() -> WorkGroup:
        ranks = dist.get_process_group_ranks(group)
        return WorkGroup(
            [
                dist.broadcast(rows[root], ranks[root], group=group, async_op=True)  # type: ignore[misc]
                for root in range(group.size())
            ]
        )

    # A WorkGroup has the part of Work's interface the collectives use (wait,
    # get_future), so callers treat it as one.
    return _issue_gloo(direct, fallback)  # type: ignore[return-value]


def gloo_all_to_all_single(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup
) -> dist.Work:
    """Asynchronous even all-to-all on a gloo ``group`` (see [Note: issuing gloo collectives])."""
    return _issue_gloo(
        lambda: group.alltoall_base(output, input, [], []),
        lambda: dist.all_to_all_single(output, input, group=group, async_op=True),
    )


def serves_cpu_with_gloo(group: dist.ProcessGroup) -> bool:
    """Whether CPU tensors on ``group`` go to a real ``ProcessGroupGloo`` (possibly
    inside torch's debug wrapper), so that the gloo-only paths apply.

    Asks the group for its CPU backend object rather than comparing names: the
    threaded test group, the ``fake`` backend, MPI, UCC and vendor backends
    register other classes (or no CPU backend at all), and a group created with
    ``"cpu:gloo,cuda:nccl"`` is gloo for its CPU tensors.
    """
    gloo_class = getattr(dist, "ProcessGroupGloo", None)
    if gloo_class is None:  # torch built without gloo
        return False
    try:
        backend = group._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return False  # no backend object for the CPU (e.g. a Python-level ProcessGroup)
    # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the backend to check collectives first
    backend = getattr(backend, "wrapped_pg", backend)
    return isinstance(backend, gloo_class)


class _SumAfter:
    """The all-to-all of a reduce-scatter (see [Note: reduce-scatter on gloo]):
    ``wait`` waits for it and sums the received chunks into the output."""

    __slots__ = ("_output", "_received", "_work")

    def __init__(self, work: dist.Work, received: torch.Tensor, output: torch.Tensor) -> None:
        self._work = work
        self._received = received
        self._output = output

    def wait(self) -> bool:
        self._work.wait()
        output = self._output
        rows = self._received.view(-1, output.numel())
        if rows.size(0) == 2:  # a binary add is about twice as fast as a 2-row sum (same bits)
            torch.add(rows[0], rows[1], out=output)
        else:
            torch.sum(rows, dim=0, out=output)
        return True

    def get_future(self) -> torch.futures.Future:
        return self._work.get_future()


def reduce_scatter_by_all_to_all(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup
) -> dist.Work:
    """Asynchronous sum reduce-scatter on a gloo ``group`` as one all-to-all and a
    local sum at ``wait`` (see [Note: reduce-scatter on gloo])."""
    received = torch.empty_like(input)
    work = gloo_all_to_all_single(received, input, group)
    # Has the part of Work's interface the collectives use (wait, get_future).
    return _SumAfter(work, received, output)  # type: ignore[return-value]


# ---------------------------------------------------------------------------
# Routes: which path each group's collectives take
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """How this process issues collectives of CPU tensors on one process group
    (see [Note: collectives per backend]); the default is the public collectives.

    Attributes:
        gloo: the group's CPU backend is ``ProcessGroupGloo``: collectives are
            issued on the group object directly.
        all_to_all_reduce_scatter: reduce-scatter as one all-to-all and a local sum
            ([Note: reduce-scatter on gloo]).
        broadcast_all_gather: large all-gathers as one broadcast per rank
            ([Note: all-gather on gloo]).
    """

    gloo: bool = False
    all_to_all_reduce_scatter: bool = False
    broadcast_all_gather: bool = False


PUBLIC_ROUTE = Route()
_routes: weakref.WeakKeyDictionary[dist.ProcessGroup, Route] = weakref.WeakKeyDictionary()


def route_of(group: dist.ProcessGroup) -> Route:
    """The :class:`Route` of ``group``, decided on the first call for the group
    (backend and ``FSDP_COMPOSE_GLOO_*`` settings) and remembered after."""
    route = _routes.get(group)
    if route is None:
        gloo = serves_cpu_with_gloo(group)
        route = Route(
            gloo=gloo,
            all_to_all_reduce_scatter=gloo and _use_all_to_all_reduce_scatter(group),
            broadcast_all_gather=gloo and _broadcast_all_gather_enabled,
        )
        _routes[group] = route
        if not gloo:
            logger.debug(
                "fsdp_compose: group of size %d (backend %s) uses the public collectives",
                group.size(),
                _compat.backend_name(group),
            )
    return route


def _use_all_to_all_reduce_scatter(group: dist.ProcessGroup) -> bool:
    """Whether reduce-scatters on ``group`` go by all-to-all ([Note: reduce-scatter
    on gloo]): a real gloo group, unless ``FSDP_COMPOSE_GLOO_REDUCE_SCATTER=native``.
    Read by :func:`route_of`, once per group."""
    mode = _env.choice("FSDP_COMPOSE_GLOO_REDUCE_SCATTER", ("all_to_all", "native"), "all_to_all")
    return mode != "native" and serves_cpu_with_gloo(group)


# Rows smaller than this gather with gloo's own all-gather: for tiny units one
# collective costs less to issue than W broadcasts.
_BROADCAST_ALL_GATHER_MIN_ROW_BYTES = 64 * 1024
_broadcast_all_gather_enabled = (
    _env.choice("FSDP_COMPOSE_GLOO_ALL_GATHER", ("broadcast", "native"), "broadcast") != "native"
)


def gathers_in_place(group: dist.ProcessGroup, row_bytes: int, device: torch.device) -> bool:
    """Whether :func:`all_gather` wants its input to be this rank's row of the
    output (else a separate buffer serves gloo's own all-gather, and CPU backends
    that may not accept an aliased input, better). Fixed for a unit: decide once
    and pass it as ``in_place``."""
    if device.type != "cpu":
        return True  # NCCL gathers in place
    return route_of(group).broadcast_all_gather and row_bytes >= _BROADCAST_ALL_GATHER_MIN_ROW_BYTES


# [Note: gloo work at interpreter exit]
# A gloo worker thread marks a collective complete (waking the waiting caller) a
# moment before it drops its own reference to the work and the tensors it holds. If
# Python dropped those tensors first, the worker must take the GIL to free them; if
# the interpreter is already finalizing by then, the thread is torn down inside a
# destructor and the process aborts with "terminate called without an active
# exception" -- after training finished, on a loaded machine, a few percent of runs
# (any gloo program can hit it; DTensor's ``full_tensor()`` right before exit is a
# common trigger). An exit handler, registered on the first gloo collective, frees
# unreachable objects and releases the GIL briefly while the interpreter is still
# alive, so such a worker finishes first.
_EXIT_GRACE_S = 0.1
_exit_grace_registered = False


def _let_gloo_workers_finish() -> None:
    gc.collect()
    time.sleep(_EXIT_GRACE_S)


def ensure_exit_grace() -> None:
    """Registers the exit handler of [Note: gloo work at interpreter exit] once
    (called before every CPU collective)."""
    global _exit_grace_registered
    if not _exit_grace_registered:
        _exit_grace_registered = True
        atexit.register(_let_gloo_workers_finish)
