"""gloo's collectives, issued as point-to-point exchanges tagged with what they are.

An extension: it registers the :class:`GlooRoute` of every group whose CPU backend
is a real ``ProcessGroupGloo`` (:func:`serves_cpu_with_gloo`) with
``_collectives.route_providers``; every other backend keeps the public
collectives (see [Note: collectives per backend] in ``_collectives.py``).

[Note: collectives matched by what they are]
gloo pairs collectives by their order on a group: if ranks issue different
collectives (control flow that differs between ranks, ``requires_grad`` changed
on one rank, a batch skipped on one rank), the n-th collective of one rank meets
the n-th of another. Equal sizes silently exchange the wrong unit's data; different
sizes abort the process inside gloo (``gloo::EnforceNotMet ... Received data size
doesn't match expected size``, SIGABRT: no Python exception, no clean-up).

fsdp_compose therefore issues its gloo collectives as point-to-point sends and
receives whose tag is a hash of what the collective is: kind, unit, element
count, dtype and the issuing root's step (:meth:`_Peers.tag`). gloo matches a
receive only with a send of the same tag, so different collectives never pair:
a mismatch waits instead of exchanging or aborting, and
``_stall.py`` turns that wait into a :class:`~fsdp_compose.debug.CollectiveMismatchError`
on every rank involved ([Note: stalled exchanges]). Collectives that agree pair
whatever order they were issued in.

It costs nothing: the exchanges move the same bytes as the collectives they
replace ((W-1)/W * N per rank for an all-gather or a reduce-scatter, N for a
2-rank all-reduce) and skip gloo's worker queue, so they are as fast or faster
(measured: ``benchmarks/guard_cost.py``, BENCHMARKS.md).

* all-gather: each rank sends its row of the output to every other rank and
  receives theirs straight into their rows (in place: no extra buffer or copy).
* reduce-scatter: each rank sends chunk r of its input to rank r and receives
  every rank's copy of its own chunk, then sums them in rank order (as gloo's
  own reduce-scatter would need a full all-reduce: twice the bytes).
* all-reduce (HSDP's replicas): with 2 ranks, each sends its tensor to the other
  and adds what it receives; with more, gloo's own all-reduce (not tagged).

``FSDP_COMPOSE_GLOO_ALL_GATHER=native`` / ``FSDP_COMPOSE_GLOO_REDUCE_SCATTER=native``
use gloo's own all-gather / torch's reduce-scatter instead (not tagged: the
protection above is lost).
"""

from __future__ import annotations

import atexit
import collections
import gc
import time
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from . import _collectives, _compat, _env, _host_memory, _stall

_TAG_MODULUS = _stall.BREAK_TAG  # tags are below it
_STEP_MIX = 0x9E3779B1  # spreads consecutive steps over the tag space
# How many tags a rank remembers per group: far more than can be in flight, so a
# stalled exchange can be told apart from one whose data is still coming.
_HISTORY = 16384


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


class _Peers:
    """This rank's view of one gloo group: its rank, the others, and the tags of
    the exchanges it issued on the group (the last ``_HISTORY``, newest last, of
    ``count`` in all)."""

    __slots__ = (
        "closed",
        "closed_at",
        "count",
        "global_ranks",
        "group",
        "issued",
        "name",
        "others",
        "rank",
        "size",
    )

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.others = [r for r in range(self.size) if r != self.rank]
        self.global_ranks = dist.get_process_group_ranks(group)
        self.name = getattr(group, "group_name", "") or str(self.global_ranks)
        self.issued: collections.deque[int] = collections.deque(maxlen=_HISTORY)
        self.count = 0
        self.closed = False  # by _stall.break_group: no exchange on it can complete
        self.closed_at = 0.0  # when (time.monotonic()) break_group was first called

    def tag(self, kind: str, label: str, numel: int, dtype: torch.dtype, step: int) -> int:
        """The tag of a collective: the same on every rank that issues it, and
        (but for a hash collision) different for any other collective."""
        key = (kind, label, numel, dtype)
        base = _tag_bases.get(key)
        if base is None:
            base = _tag_bases[key] = zlib.crc32(f"{kind}|{label}|{numel}|{dtype}".encode())
        tag = (base + step * _STEP_MIX) % _TAG_MODULUS
        self.issued.append(tag)
        self.count += 1
        return tag


_tag_bases: dict[tuple[str, str, int, torch.dtype], int] = {}


class Exchange:
    """The sends and receives of one tagged collective, waited on as one work;
    ``finish`` (if any) runs after they completed (the sum of a reduce-scatter).

    ``name``: (kind, label, step, element count, dtype), for error messages;
    ``seq``: how many exchanges the group had issued before this one.
    """

    __slots__ = ("_done", "_finish", "_recvs", "_sends", "name", "peers", "seq", "tag")

    def __init__(
        self,
        peers: _Peers,
        tag: int,
        name: tuple[str, str, int, int, torch.dtype],
        recvs: list[dist.Work],
        sends: list[dist.Work],
        finish: Callable[[], None] | None = None,
    ) -> None:
        self.peers = peers
        self.tag = tag
        self.seq = peers.count - 1
        self.name = name
        self._recvs = recvs
        self._sends = sends
        self._finish = finish
        self._done = False

    def wait(self) -> bool:
        if self._done:
            return True
        watch = _stall.watch
        watch.current, watch.since = self, time.monotonic()
        try:
            if self.peers.closed:
                raise RuntimeError("the process group was closed after a desync")
            for work in self._recvs:
                work.wait()
            for work in self._sends:
                work.wait()
        except RuntimeError as exc:
            watch.current = None
            # A failed wait closes this rank's connections on the group too, so
            # that no rank waits on for a peer that will not come ([Note: stalled
            # exchanges]).
            _stall.break_group(self.peers)
            mismatch = _stall.explain(self)
            if mismatch is not None:
                raise mismatch from exc
            raise
        watch.current = None
        if watch.published is not None:
            _stall.unpublish(self)
        self._done = True
        if self._finish is not None:
            self._finish()
        # Completed works still reference the buffers they sent and received:
        # drop them now, so that the buffers go back to their allocator (e.g. the
        # host-buffer pool, for the next request of their size) when fsdp_compose
        # drops them, not when this exchange object happens to be collected.
        self._recvs = self._sends = []
        self._finish = None
        return True

    def get_future(self) -> torch.futures.Future:
        # listeners then learn of the completion at wait (_collectives._on_complete)
        raise RuntimeError("a point-to-point exchange has no future")

    def __del__(self) -> None:
        if not self._done:
            # Dropped unwaited (a step abandoned after an error): gloo may still
            # write into the receive buffers, so they must outlive the transfer.
            _abandoned[:] = [works for works in _abandoned if not _finished(works)]
            _abandoned.append((self._recvs, self._sends))


def _finished(works: tuple[list[dist.Work], list[dist.Work]]) -> bool:
    return all(work.is_completed() for side in works for work in side)


# Works dropped before they completed, kept alive (with their tensors) for gloo.
_abandoned: list[tuple[list[dist.Work], list[dist.Work]]] = []


def _post(
    peers: _Peers, tag: int, outgoing: list[torch.Tensor], incoming: list[torch.Tensor]
) -> tuple[list[dist.Work], list[dist.Work]]:
    """Posts one exchange: ``outgoing[i]`` to and ``incoming[i]`` from
    ``peers.others[i]``. Sends first: posted before the receives, a transfer needs
    fewer round trips of gloo's event loop (1 MiB rows at W=2: ~0.9 against 1.4-2 ms
    on a loaded machine). On a group already closed ([Note: stalled exchanges]) this
    rank's other connections are closed too."""
    group = peers.group
    try:
        sends = [group.send([t], peer, tag) for t, peer in zip(outgoing, peers.others)]
        recvs = [group.recv([t], peer, tag) for t, peer in zip(incoming, peers.others)]
    except RuntimeError:
        _stall.break_group(peers)
        raise
    return sends, recvs


class GlooRoute(_collectives.Route):
    """The :class:`~fsdp_compose._collectives.Route` of a gloo group: tagged
    exchanges (see [Note: collectives matched by what they are]).

    A collective a launch wrapper moved to another group with the same ranks
    (the collective guard's lanes, which pair collectives themselves) is issued
    as gloo's own collective on that group.
    """

    __slots__ = ("exchange_all_gather", "exchange_reduce_scatter", "peers")
    name = "gloo"

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.peers = _Peers(group)
        self.exchange_all_gather = _exchange_all_gather
        self.exchange_reduce_scatter = _exchanges_reduce_scatter()

    def gathers_in_place(self, row_bytes: int) -> bool:
        # gloo's own all-gather is slower with its input inside its output (6.3 ms
        # vs 4.5 ms for 7 MiB at W=2): it gets a buffer of its own.
        return self.exchange_all_gather

    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        label: str,
        step: int,
    ) -> Any:
        peers = self.peers
        if group is not peers.group or not self.exchange_all_gather:
            return group._allgather_base(output, input)
        rows = output.view(peers.size, -1)
        mine = rows[peers.rank]
        if input.data_ptr() != mine.data_ptr():
            mine.copy_(input)
        numel = mine.numel()
        tag = peers.tag("all_gather", label, numel, mine.dtype, step)
        sends, recvs = _post(
            peers, tag, [mine] * len(peers.others), [rows[p] for p in peers.others]
        )
        return Exchange(peers, tag, ("all_gather", label, step, numel, mine.dtype), recvs, sends)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        label: str,
        step: int,
    ) -> Any:
        peers = self.peers
        if group is not peers.group or not self.exchange_reduce_scatter:
            if group is not peers.group and self.exchange_reduce_scatter:
                return _reduce_scatter_by_all_to_all(output, input, group)
            return _compat.reduce_scatter_tensor(output, input, group, True)
        chunks = input.view(peers.size, -1)
        me, others = peers.rank, peers.others
        # Every rank's copy of this rank's chunk, in rank order (the sum's order);
        # at W=2 only the peer's (a binary add: twice as fast as a 2-row sum, the
        # same bits, and half the buffer).
        binary = peers.size == 2
        received = _host_memory.receive_buffer(chunks[:1] if binary else chunks)
        into = [received[0]] if binary else [received[p] for p in others]
        tag = peers.tag("reduce_scatter", label, input.numel(), input.dtype, step)
        sends, recvs = _post(peers, tag, [chunks[p] for p in others], into)

        def finish() -> None:
            if binary:
                torch.add(chunks[me], received[0], out=output)
            else:
                received[me].copy_(chunks[me])
                torch.sum(received, dim=0, out=output)

        name = ("reduce_scatter", label, step, input.numel(), input.dtype)
        return Exchange(peers, tag, name, recvs, sends, finish)

    def all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup, label: str, step: int
    ) -> Any:
        peers = self.peers
        if group is not peers.group or peers.size != 2:
            return dist.all_reduce(tensor, group=group, async_op=True)
        theirs = torch.empty_like(tensor)
        tag = peers.tag("all_reduce", label, tensor.numel(), tensor.dtype, step)
        sends, recvs = _post(peers, tag, [tensor], [theirs])

        def finish() -> None:
            tensor.add_(theirs)  # a + b == b + a: both ranks get the same bits

        name = ("all_reduce", label, step, tensor.numel(), tensor.dtype)
        return Exchange(peers, tag, name, recvs, sends, finish)


class _SumAfter:
    """gloo's all-to-all of a reduce-scatter on a lane of the collective guard:
    ``wait`` waits for it and sums the received chunks into the output."""

    __slots__ = ("_output", "_received", "_work")

    def __init__(self, work: dist.Work, received: torch.Tensor, output: torch.Tensor) -> None:
        self._work: dist.Work | None = work
        self._received = received
        self._output = output

    def wait(self) -> bool:
        work = self._work
        if work is None:
            return True
        work.wait()
        torch.sum(self._received.view(-1, self._output.numel()), dim=0, out=self._output)
        # gloo's work holds the input until it is destroyed: drop it now, so that
        # a pooled input goes back to the pool (as ``Exchange.wait`` does).
        self._work = None
        return True

    def get_future(self) -> torch.futures.Future:
        if self._work is None:  # waited: complete
            future: torch.futures.Future = torch.futures.Future()
            future.set_result(None)
            return future
        return self._work.get_future()


def _reduce_scatter_by_all_to_all(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup
) -> Any:
    received = torch.empty_like(input)
    work = group.alltoall_base(received, input, [], [])
    return _SumAfter(work, received, output)


# "broadcast" and "all_to_all" (the exchanges' predecessors) are still accepted.
_exchange_all_gather = (
    _env.choice("FSDP_COMPOSE_GLOO_ALL_GATHER", ("exchange", "broadcast", "native"), "exchange")
    != "native"
)


def _exchanges_reduce_scatter() -> bool:
    """``FSDP_COMPOSE_GLOO_REDUCE_SCATTER``, read for each new gloo route."""
    choices = ("exchange", "all_to_all", "native")
    return _env.choice("FSDP_COMPOSE_GLOO_REDUCE_SCATTER", choices, "exchange") != "native"


def _route(group: dist.ProcessGroup) -> GlooRoute | None:
    """The route provider: a :class:`GlooRoute` for gloo groups of 2 ranks or more."""
    if not serves_cpu_with_gloo(group) or group.size() < 2:
        return None
    _ensure_exit_grace()
    _stall.start()
    return GlooRoute(group)


_collectives.route_providers.append(_route)


# [Note: gloo work at interpreter exit]
# A gloo worker thread marks a collective complete (waking the waiting caller) a
# moment before it drops its own reference to the work and the tensors it holds. If
# Python dropped those tensors first, the worker must take the GIL to free them; if
# the interpreter is already finalizing by then, the thread is torn down inside a
# destructor and the process aborts with "terminate called without an active
# exception" -- after training finished, on a loaded machine, a few percent of runs
# (any gloo program can hit it; DTensor's ``full_tensor()`` right before exit is a
# common trigger). An exit handler, registered with the first gloo route, frees
# unreachable objects and releases the GIL briefly while the interpreter is still
# alive, so such a worker finishes first.
_EXIT_GRACE_S = 0.1
_exit_grace_registered = False


def _let_gloo_workers_finish() -> None:
    gc.collect()
    time.sleep(_EXIT_GRACE_S)


def _ensure_exit_grace() -> None:
    global _exit_grace_registered
    if not _exit_grace_registered:
        _exit_grace_registered = True
        atexit.register(_let_gloo_workers_finish)
