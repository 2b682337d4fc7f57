"""Every collective fsdp_compose issues goes through this module.

Collectives are always issued asynchronously and return a :class:`PendingCollective`
whose :meth:`~PendingCollective.wait` makes the result visible to the caller:

* CPU / gloo: ``async_op=True`` work runs on gloo's own threads while Python
  computes; ``wait()`` blocks on the work.
* CUDA / NCCL: the collective runs on a dedicated all-gather or reduce-scatter
  stream that first waits for the compute stream; ``wait()`` makes the compute
  stream wait for an event, without blocking the CPU.

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

[Note: collectives per backend]
fsdp_compose runs on any c10d backend. The paths above (and issuing on the
ProcessGroup object, [Note: issuing gloo collectives] in ``_compat.py``) are tuned
for gloo and used only where a group's CPU backend really is ``ProcessGroupGloo``;
every other backend -- torch's threaded test group, the ``fake`` backend of dry
runs, MPI, UCC, vendor backends, NCCL -- gets torch.distributed's public
collectives (``all_gather_into_tensor``, ``reduce_scatter_tensor``, ...). Which
applies is a :class:`Route`, decided once per group (:func:`route_of`, at the lazy
init of the first unit on it) and kept by the unit, so issuing a collective costs
no backend lookup.

Listeners (the trace, tests counting collectives) subscribe with
:func:`add_listener`; with none subscribed, issuing costs nothing extra.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.distributed as dist

from . import _compat, _env, _guard, debug

logger = logging.getLogger("fsdp_compose")

CollectiveKind = Literal["all_gather", "reduce_scatter", "all_reduce"]
CollectiveEvent = Literal["issue", "complete", "wait_begin", "wait_end"]


@dataclass(frozen=True)
class CollectiveInfo:
    """What one rank issued: enough to count, size and cross-check collectives."""

    kind: CollectiveKind
    label: str
    group_size: int
    input_numel: int
    output_numel: int
    dtype: torch.dtype
    seq: int

    @property
    def input_bytes(self) -> int:
        return self.input_numel * self.dtype.itemsize

    @property
    def output_bytes(self) -> int:
        return self.output_numel * self.dtype.itemsize


class _CustomComm(Protocol):
    """FSDP2's ``Comm`` interface: ``allocate`` makes the communication buffers."""

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor: ...


class AllGatherComm(_CustomComm, Protocol):
    """A user-supplied all-gather (``FSDPModule.set_custom_all_gather``), with the
    interface of FSDP2's ``AllGather``: ``allocate`` makes the output buffer (the
    input is a view of it, in place) and the call issues the collective."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None: ...


class ReduceScatterComm(_CustomComm, Protocol):
    """A user-supplied reduce-scatter (``FSDPModule.set_custom_reduce_scatter``),
    with the interface of FSDP2's ``ReduceScatter``: ``allocate`` makes the input
    and output buffers and the call issues the collective."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None: ...


Listener = Callable[[CollectiveEvent, CollectiveInfo], None]
# Issues one collective: ``issue(async_op, group)``. The group is the caller's, or
# one with the same ranks that a launcher (the collective guard) issues on instead.
Issue = Callable[[bool, dist.ProcessGroup], "dist.Work | None"]
_listeners: list[Listener] = []
_seq = itertools.count()
current_step = 0  # set by the scheduler; names the step in errors and fingerprints


def add_listener(listener: Listener) -> None:
    """Subscribes ``listener(event, info)`` to every collective this process issues.

    ``"complete"`` may be delivered from a communication thread.
    """
    _listeners.append(listener)


def remove_listener(listener: Listener) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def _notify(event: CollectiveEvent, info: CollectiveInfo) -> None:
    for listener in tuple(_listeners):
        listener(event, info)


# ---------------------------------------------------------------------------
# gloo work at interpreter exit
# ---------------------------------------------------------------------------

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
_exit_guard_registered = False


def _let_gloo_workers_finish() -> None:
    gc.collect()
    time.sleep(_EXIT_GRACE_S)


def _register_exit_guard() -> None:
    global _exit_guard_registered
    _exit_guard_registered = True
    atexit.register(_let_gloo_workers_finish)


# ---------------------------------------------------------------------------
# Streams (accelerators only)
# ---------------------------------------------------------------------------


class _DeviceStreams:
    """Side streams shared by all units on one accelerator device."""

    def __init__(self, device: torch.device) -> None:
        module = getattr(torch, device.type)
        # High priority so copies for communication are not starved by compute.
        self.all_gather = module.Stream(device=device, priority=-1)
        self.reduce_scatter = module.Stream(device=device, priority=-1)
        self.module = module


_streams: dict[torch.device, _DeviceStreams] = {}


def _device_streams(device: torch.device) -> _DeviceStreams:
    streams = _streams.get(device)
    if streams is None:
        streams = _streams[device] = _DeviceStreams(device)
    return streams


# ---------------------------------------------------------------------------
# Pending collectives
# ---------------------------------------------------------------------------


class PendingCollective:
    """An issued collective; :meth:`wait` makes its output usable.

    Holds references to the tensors involved until waited on, so that their memory
    cannot be reused while the communication may still touch it.
    """

    __slots__ = (
        "_done",
        "_finish",
        "_group",
        "_info",
        "_stream_wait",
        "_tensors",
        "_what",
        "_work",
    )

    def __init__(
        self,
        info: CollectiveInfo | None,
        work: dist.Work | None = None,
        stream_wait: Callable[[], None] | None = None,
        finish: Callable[[], None] | None = None,
        tensors: tuple[torch.Tensor, ...] = (),
        what: str = "",
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self._what = what
        self._group = group  # names the backend if the collective fails
        self._work = work
        self._stream_wait = stream_wait
        self._finish = finish
        self._info = info
        self._tensors = tensors
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def wait(self) -> None:
        if self._done:
            return
        info = self._info
        if info is not None and _listeners:
            _notify("wait_begin", info)
        if self._work is not None:
            try:
                self._work.wait()
            except debug.CollectiveMismatchError:
                raise
            except RuntimeError as exc:
                tensor = self._tensors[1] if self._tensors else None
                raise _failure(self._what, exc, tensor, self._group) from exc
        if self._stream_wait is not None:
            self._stream_wait()
        if self._finish is not None:
            self._finish()
        if info is not None and _listeners:
            if self._work is None:  # accelerator: completion observed at wait
                _notify("complete", info)
            _notify("wait_end", info)
        self._done = True
        self._work = self._stream_wait = self._finish = self._group = None
        self._tensors = ()


# [Note: why a collective failed]
# A collective fails either because of the other ranks -- one crashed (its
# connections close or reset), or stopped issuing or issued something else (this
# rank times out waiting, or a checking backend reports the mismatch) -- or
# because of this rank's own call: a dtype the backend does not support, no
# backend for the tensors' device. Only the first kind gets the hint about peers
# and mismatched collectives; the second says what the backend refused, so that
# nobody hunts for a crashed peer that does not exist.
# Backends word these differently (gloo: "Connection closed by peer", "Timed out
# waiting ... for recv"; NCCL: "ncclRemoteError", "Watchdog caught collective
# operation timeout", "communicator was aborted"); the signs below cover them.
_PEER_SIGNS = (
    "closed by peer",
    "reset by peer",
    "connection closed",
    "connection reset",
    "connection refused",
    "broken pipe",
    "timed out",
    "timeout",
    "remote process",
    "remote worker",
    "remoteerror",
    "network error",
    "communicator was aborted",
    # the ranks issued different collectives (TORCH_DISTRIBUTED_DEBUG=DETAIL, gloo)
    "mismatch",
    "doesn't match expected size",
)


def peer_may_have_failed(exc: BaseException) -> bool:
    """Whether ``exc`` (raised by a collective) can come from another rank: a lost
    connection or a timeout, see [Note: why a collective failed]."""
    text = str(exc).lower()
    return any(sign in text for sign in _PEER_SIGNS)


def _failure(
    what: str,
    exc: BaseException,
    tensor: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
) -> RuntimeError:
    """The error to raise for a failed collective ``what``; ``tensor`` and ``group``
    (where known) name the dtype, device and backend involved."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    head = f"fsdp_compose: {what} failed on rank {rank}: {exc}\n"
    if peer_may_have_failed(exc):
        return RuntimeError(
            head + "A peer rank may have crashed or timed out, or the ranks issued different "
            "collectives; run with FSDP_COMPOSE_DEBUG_COLLECTIVES=1 to compare the ranks' "
            "collectives."
        )
    return RuntimeError(head + _local_cause(exc, tensor, group))


def _local_cause(
    exc: BaseException, tensor: torch.Tensor | None, group: dist.ProcessGroup | None
) -> str:
    text = str(exc).lower()
    backend = "process group's backend"
    if group is not None:
        backend += f" ({_backend_name(group)})"
    device = tensor.device.type if tensor is not None else "these"
    dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else "this dtype"
    if "no backend type associated with device type" in text:
        return (
            f"This rank's call was refused, not a peer's: the {backend} has no backend for "
            f"{device} tensors. Create the process group with a backend for that device (e.g. "
            'init_process_group("gloo") for CPU, "cpu:gloo,cuda:nccl" for both) or build the '
            "mesh on a device its backend serves."
        )
    if "scalar type" in text or "dtype" in text or "data type" in text:
        return (
            f"This rank's call was refused, not a peer's: the {backend} does not support this "
            f"collective on {dtype} tensors. Use a dtype it supports for communication, e.g. "
            "MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...), or a backend that supports "
            f"{dtype}."
        )
    if any(sign in text for sign in ("support", "not implemented", "unimplemented")):
        return (
            f"This rank's call was refused, not a peer's: the {backend} does not implement this "
            f"collective ({dtype} tensors on {device}). fsdp_compose needs all-gather into one "
            "tensor, reduce-scatter of one tensor and all-reduce (gloo, NCCL and UCC have them); "
            "or supply your own with set_custom_all_gather / set_custom_reduce_scatter."
        )
    return (
        f"The {backend} raised this on this rank ({dtype} tensors on {device}); it does not "
        "look like a lost connection or a timeout, so a failed peer is an unlikely cause."
    )


def _info(
    kind: CollectiveKind, label: str, group_size: int, inp: torch.Tensor, out: torch.Tensor
) -> CollectiveInfo | None:
    if not _listeners:
        return None
    return CollectiveInfo(kind, label, group_size, inp.numel(), out.numel(), inp.dtype, next(_seq))


def _on_complete(work: dist.Work, info: CollectiveInfo) -> None:
    """Reports the completion time of gloo work from gloo's own thread."""
    try:
        work.get_future().add_done_callback(lambda _f: _notify("complete", info))
    except RuntimeError:  # backends without futures: report at wait time instead
        _notify("complete", info)


def _launch(
    kind: CollectiveKind,
    label: str,
    group: dist.ProcessGroup,
    inp: torch.Tensor,
    out: torch.Tensor,
    issue: Issue,
    finish: Callable[[], None] | None = None,
    keepalive: tuple[torch.Tensor, ...] = (),
    movable: bool = True,
) -> PendingCollective:
    """Issues ``issue``; ``movable=False``: it must run on ``group`` itself (a
    user-supplied comm), not on a private group with the same ranks."""
    if debug._checker is not None:
        debug._check(kind, label, group, inp.numel(), inp.dtype, current_step)
    info = _info(kind, label, group.size(), inp, out)
    if info is not None:
        _notify("issue", info)
    what = f"{kind} for {label} (step {current_step})"
    if out.device.type == "cpu":
        if not _exit_guard_registered:
            _register_exit_guard()
        try:
            if _guard.enabled and debug._checker is None:  # see [Note: collective guard]
                work = _guard.launch(
                    kind, label, group, inp.numel(), inp.dtype, current_step, issue, movable
                )
            else:
                work = issue(True, group)
        except debug.CollectiveMismatchError:
            raise
        except RuntimeError as exc:
            raise _failure(what, exc, out, group) from exc
        if info is not None and work is not None:
            _on_complete(work, info)
        return PendingCollective(
            info, work=work, finish=finish, tensors=(inp, out, *keepalive), what=what, group=group
        )
    streams = _device_streams(out.device)
    stream = streams.reduce_scatter if kind != "all_gather" else streams.all_gather
    current = streams.module.current_stream(out.device)
    stream.wait_stream(current)
    with streams.module.stream(stream):
        try:
            issue(False, group)
        except RuntimeError as exc:
            raise _failure(what, exc, out, group) from exc
        if finish is not None:
            finish()
        event = stream.record_event()
    device = out.device

    def stream_wait() -> None:
        streams.module.current_stream(device).wait_event(event)

    return PendingCollective(
        info, stream_wait=stream_wait, tensors=(inp, out, *keepalive), what=what, group=group
    )


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
        gloo = _compat.serves_cpu_with_gloo(group)
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
                _backend_name(group),
            )
    return route


def _use_all_to_all_reduce_scatter(group: dist.ProcessGroup) -> bool:
    """Whether reduce-scatters on ``group`` go by all-to-all ([Note: reduce-scatter
    on gloo]): a real gloo group, unless ``FSDP_COMPOSE_GLOO_REDUCE_SCATTER=native``.
    Read by :func:`route_of`, once per group."""
    mode = _env.choice("FSDP_COMPOSE_GLOO_REDUCE_SCATTER", ("all_to_all", "native"), "all_to_all")
    return mode != "native" and _compat.serves_cpu_with_gloo(group)


def _backend_name(group: dist.ProcessGroup) -> str:
    try:
        return _compat.process_group_backend(group)
    except (RuntimeError, ValueError, KeyError):  # a group torch does not know
        return "unknown"


# ---------------------------------------------------------------------------
# The collectives
# ---------------------------------------------------------------------------


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


def _real_view(tensor: torch.Tensor) -> torch.Tensor:
    """A complex tensor as the flat real tensor of its (re, im) pairs: gloo has no
    complex types, and a sum or gather of the pairs is that of the numbers."""
    return torch.view_as_real(tensor).view(-1) if tensor.is_complex() else tensor


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    label: str,
    *,
    comm: AllGatherComm | None = None,
    in_place: bool = False,
    route: Route | None = None,
) -> PendingCollective:
    """Gathers ``input`` from every rank of ``group`` into ``output`` (rank-major),
    with ``comm`` if given. ``in_place``: ``input`` is this rank's row of
    ``output``, as :func:`gathers_in_place` asked for (gloo then gathers by
    broadcasts). ``route``: ``route_of(group)``, kept by the caller."""
    if comm is None:
        output, input = _real_view(output), _real_view(input)
    issue: Issue
    if comm is not None:
        issue = lambda async_op, on: comm(  # noqa: E731
            output_tensor=output, input_tensor=input, group=on, async_op=async_op
        )
    elif output.device.type == "cpu":
        if route is None:
            route = route_of(group)
        if not route.gloo:
            issue = lambda async_op, on: _compat.all_gather_into_tensor(output, input, on, True)  # noqa: E731
        elif in_place and route.broadcast_all_gather:
            issue = lambda async_op, on: _compat.gloo_all_gather_by_broadcast(output, on)  # noqa: E731
        else:
            issue = lambda async_op, on: _compat.gloo_all_gather_into_tensor(output, input, on)  # noqa: E731
    else:
        issue = lambda async_op, on: _compat.all_gather_into_tensor(output, input, on, async_op)  # noqa: E731
    return _launch("all_gather", label, group, input, output, issue, movable=comm is None)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    label: str,
    *,
    comm: ReduceScatterComm | None = None,
    route: Route | None = None,
) -> PendingCollective:
    """Sums ``input`` (``group.size()`` equal chunks) over ``group``; rank r receives
    the sum of chunk r in ``output``. With ``comm`` if given, else see [Note:
    reduce-scatter on gloo]. ``route``: ``route_of(group)``, kept by the caller."""
    world = group.size()
    if comm is None:
        output, input = _real_view(output), _real_view(input)
    if comm is not None:
        issue = lambda async_op, on: comm(  # noqa: E731
            output_tensor=output,
            input_tensor=input,
            group=on,
            op=dist.ReduceOp.SUM,  # type: ignore[arg-type]  # (a RedOpType member)
            async_op=async_op,
        )
        return _launch("reduce_scatter", label, group, input, output, issue, movable=False)
    if output.device.type == "cpu" and (route or route_of(group)).all_to_all_reduce_scatter:
        received = torch.empty_like(input)

        def finish() -> None:
            rows = received.view(world, -1)
            if world == 2:  # a binary add is about twice as fast as a 2-row sum (same bits)
                torch.add(rows[0], rows[1], out=output)
            else:
                torch.sum(rows, dim=0, out=output)

        return _launch(
            "reduce_scatter",
            label,
            group,
            input,
            output,
            lambda async_op, on: _compat.gloo_all_to_all_single(received, input, on),
            finish=finish,
            keepalive=(received,),
        )
    return _launch(
        "reduce_scatter",
        label,
        group,
        input,
        output,
        lambda async_op, on: _compat.reduce_scatter_tensor(output, input, on, async_op),
    )


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, label: str) -> PendingCollective:
    """Sums ``tensor`` in place over ``group``."""
    tensor = _real_view(tensor)
    return _launch(
        "all_reduce",
        label,
        group,
        tensor,
        tensor,
        lambda async_op, on: dist.all_reduce(tensor, group=on, async_op=async_op),
    )
