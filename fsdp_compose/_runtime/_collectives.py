"""Every collective fsdp_compose issues goes through this module.

[Note: Comm objects]
As in FSDP2, each unit has an all-gather and a reduce-scatter object with FSDP2's
``Comm`` interface (``allocate``, ``__call__``); ``set_custom_all_gather`` /
``set_custom_reduce_scatter`` replace the defaults, which call torch.distributed's
public collectives, so torch's tools (``CommDebugMode``, the profiler, the flight
recorder) see what they see with FSDP2. The all-gather's input is this rank's row
of its output. Collectives are asynchronous, on a side stream on accelerators; the
:class:`PendingCollective` they return makes the result visible at ``wait()``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from . import _compat
from ._events import CollectiveInfo, CollectiveKind, Events

Group = dist.ProcessGroup


class _Allocates(Protocol):
    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor: ...


class AllGather(_Allocates, Protocol):
    """FSDP2's ``AllGather`` interface (``FSDPModule.set_custom_all_gather``):
    ``allocate`` makes the output buffer, whose row for this rank is the input."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None: ...


class ReduceScatter(_Allocates, Protocol):
    """FSDP2's ``ReduceScatter`` interface (``FSDPModule.set_custom_reduce_scatter``)."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None: ...


class _DefaultAllocation:
    """The default comms' buffers: plain ``torch.empty`` (the caching allocator on GPU)."""

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class DefaultAllGather(_DefaultAllocation):
    """torch.distributed's public ``all_gather_into_tensor`` (every backend)."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        out, inp = _real_view(output_tensor), _real_view(input_tensor)
        return getattr(dist, _compat.ALL_GATHER)(out, inp, group=group, async_op=async_op)


class DefaultReduceScatter(_DefaultAllocation):
    """torch.distributed's public ``reduce_scatter_tensor`` (every backend)."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        out, inp = _real_view(output_tensor), _real_view(input_tensor)
        # Keywords as FSDP2 passes them, for code that replaces the function (torch's tests).
        reduce_scatter = getattr(dist, _compat.REDUCE_SCATTER)
        return reduce_scatter(output=out, input=inp, group=group, op=op, async_op=async_op)


def _real_view(tensor: torch.Tensor) -> torch.Tensor:
    """A complex tensor as the flat real tensor of its (re, im) pairs: gloo has no
    complex types, and a sum or gather of the pairs is that of the numbers."""
    return torch.view_as_real(tensor).view(-1) if tensor.is_complex() else tensor


def allocate(
    comm: _Allocates,
    numel: int,
    dtype: torch.dtype,
    device: torch.device,
    label: str,
    kind: CollectiveKind,
) -> torch.Tensor:
    """A flat buffer of ``numel`` elements from ``comm.allocate``; a custom comm's
    buffer is checked (the error names unit ``label``'s collective ``kind``)."""
    buf = comm.allocate((numel,), dtype=dtype, device=device)
    if isinstance(comm, _DefaultAllocation) or (
        isinstance(buf, torch.Tensor)
        and (buf.numel(), buf.dtype, buf.device) == (numel, dtype, device)
        and buf.is_contiguous()
    ):
        return buf.view(-1)
    got = (
        f"a {'contiguous' if buf.is_contiguous() else 'non-contiguous'} tensor of "
        f"{buf.numel()} {buf.dtype} elements on {buf.device}"
        if isinstance(buf, torch.Tensor)
        else type(buf).__name__
    )
    raise ValueError(
        f"{label}'s custom {kind.replace('_', '-')}: allocate() returned {got}, but {numel} "
        f"contiguous {dtype} elements on {device} were asked for"
    )


@functools.cache
def _side_stream(device: torch.device, gather: bool) -> Any:
    """The all-gather (``gather``) or reduction stream of all units on ``device``; high
    priority, so that copies for communication are not starved by compute."""
    return getattr(torch, device.type).Stream(device=device, priority=-1)


@dataclass(slots=True, eq=False)
class PendingCollective:
    """An issued collective; :meth:`wait` makes its output usable. Until then it holds
    the tensors involved, whose memory the communication may still touch."""

    _work: dist.Work | None
    _events: Events | None = None
    _info: CollectiveInfo | None = None
    _what: tuple[str, str, int] = ("", "", 0)  # kind, unit, step: named if it fails
    _tensors: tuple[torch.Tensor, ...] = ()
    _stream_wait: Callable[[], None] | None = None
    _complete_at_wait: bool = True
    _done: bool = False
    _timing: _DeviceTiming | None = None

    def wait(self) -> None:
        if self._done:
            return
        events, info = self._events, self._info
        if events is not None and info is not None:
            events.report_deferred()
            events.collective("wait_begin", info)
        if self._work is not None:
            try:
                self._work.wait()
            except RuntimeError as exc:
                _explain(exc, *self._what)
                raise
        if self._stream_wait is not None:
            self._stream_wait()
        if events is not None and info is not None:
            if self._timing is not None:  # reported once the device has passed the wait
                events.defer(self._timing.report)
            else:
                if self._complete_at_wait:
                    events.collective("complete", info)
                events.collective("wait_end", info)
        self._done = True
        self._work = self._stream_wait = self._events = self._timing = None
        self._tensors = ()


class _DeviceTiming:
    """When a collective on a side stream ran, and how long the stream that waits
    for it stalled, from device events.

    [Note: device times]
    On an accelerator the host's ``wait()`` only queues a wait on the current
    stream, so the host's clock says nothing about the collective. While an
    observer listens, the launch records timing events on the side stream before
    (``start``: the stream could begin it) and after the collective (``end``), and
    the wait one on the waiting stream (``reached``) before it waits. Once the
    device has passed both ``end`` and ``reached``, ``complete`` carries
    ``duration_s = end - start`` and ``wait_end`` carries
    ``waited_s = max(0, end - reached)``: the time the waiting stream really
    stalled. The two events are queued on the root's :class:`Events` and reported
    without blocking at its next collective, or waiting for the device when an
    observer unsubscribes (the timeline has them all when its recording ends).
    """

    __slots__ = ("end", "events", "info", "reached", "start")

    def __init__(self, module: Any, stream: Any, events: Events, info: CollectiveInfo) -> None:
        self.events, self.info = events, info
        self.start, self.end = module.Event(enable_timing=True), module.Event(enable_timing=True)
        self.reached = module.Event(enable_timing=True)
        self.start.record(stream)

    def report(self, block: bool) -> bool:
        for event in (self.end, self.reached):
            if not event.query():
                if not block:
                    return False
                event.synchronize()
        ran = self.start.elapsed_time(self.end) / 1e3  # milliseconds
        waited = max(0.0, ran - self.start.elapsed_time(self.reached) / 1e3)
        self.events.collective("complete", dataclasses.replace(self.info, duration_s=ran))
        self.events.collective("wait_end", dataclasses.replace(self.info, waited_s=waited))
        return True


#: Complete when issued (one-rank groups): waiting on it does nothing.
DONE = PendingCollective(None, _done=True)


def _explain(exc: BaseException, kind: str, label: str, step: int) -> None:
    """Adds a note naming the unit and step to a failed collective's exception,
    keeping its type (code catching torch's ``DistBackendError`` still works)."""
    if not kind or not hasattr(exc, "add_note"):
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    note = f"fsdp_compose: {kind} for {label} (step {step}) failed on rank {rank}"
    if note not in getattr(exc, "__notes__", ()):
        exc.add_note(note)


_SPANS = {"reduce_scatter": "post_backward_reduce"}
_SUM: dist.ReduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # (a RedOpType member)


def _issue(
    kind: CollectiveKind, comm: Any, output: torch.Tensor, input: torch.Tensor, group: Group
) -> dist.Work | None:
    if kind == "all_gather":
        return comm(output_tensor=output, input_tensor=input, group=group, async_op=True)
    if kind == "reduce_scatter":
        return comm(output_tensor=output, input_tensor=input, group=group, op=_SUM, async_op=True)
    return dist.all_reduce(output, group=group, async_op=True)


def launch_unit(
    kind: CollectiveKind,
    comm: AllGather | ReduceScatter | None,
    output: torch.Tensor,
    input: torch.Tensor,
    group: Group,
    label: str,
    events: Events,
) -> PendingCollective:
    """Issues a unit's ``kind`` from ``input`` into ``output`` with ``comm``
    (``all_reduce``: in place) on ``group`` for unit ``label``, asynchronously (on
    accelerators, on a side stream), through :func:`launch`."""
    custom = comm is not None and not isinstance(comm, _DefaultAllocation)
    device = None if output.device.type == "cpu" else output.device
    return launch(
        kind, label, group, events, lambda: _issue(kind, comm, output, input, group),
        (input.numel(), output.numel()), input.dtype, device=device, custom=custom,
        keep=(input, output),
    )  # fmt: skip


def launch(
    kind: CollectiveKind,
    label: str,
    group: Group,
    events: Events | None,
    issue: Callable[[], dist.Work | None],
    numels: tuple[int, int],
    dtype: torch.dtype,
    *,
    device: torch.device | None = None,
    blocking: bool = False,
    custom: bool = False,
    op: str = "",
    total_numel: int | None = None,
    keep: tuple[torch.Tensor, ...] = (),
) -> PendingCollective:
    """The one launch path of every collective fsdp_compose issues, the units' and the
    tools' (see [Note: tools' collectives]): ``issue()`` makes the torch.distributed
    (or ``Comm``) call, ``blocking`` (it returns when done) or not (it returns its
    work), on the current stream, or with ``device`` (an accelerator) on its side
    stream, ordered after the current one. It runs inside a profiler label, a
    failure's exception names ``label``, and it is reported to ``events``, the
    observers of the root it serves (``None``: no root, nothing reported); ``keep``
    holds the tensors the collective may still touch until it is waited on."""
    info = None
    if events is not None and events.on_collective:
        events.report_deferred()
        step, seq = events.step, events.next_seq()
        info = CollectiveInfo(
            kind, label, group, *numels, dtype, step, seq, custom, op, total_numel
        )
        events.collective("issue", info)  # an observer may refuse it by raising
        if blocking:
            events.collective("wait_begin", info)
    what = (kind, label, 0 if events is None else events.step)
    timing = None
    # (FSDP2's span for a unit's reduce-scatter, as its profiler traces show it)
    with _compat.profiler_label(_SPANS.get(kind, kind), label):
        try:
            if device is None:
                work = issue()
            else:
                module = getattr(torch, device.type)
                stream = _side_stream(device, kind == "all_gather")
                stream.wait_stream(module.current_stream(device))
                if info is not None:  # see [Note: device times]
                    timing = _DeviceTiming(module, stream, events, info)  # type: ignore[arg-type]
                with module.stream(stream):
                    work = issue()
        except RuntimeError as exc:
            _explain(exc, *what)
            raise
    if device is not None:
        if timing is not None:
            event = timing.end
            event.record(stream)
        else:
            event = stream.record_event()

        def stream_wait() -> None:
            current = module.current_stream(device)
            if timing is not None:
                timing.reached.record(current)
            current.wait_event(event)

        return PendingCollective(None, events, info, what, keep, stream_wait, _timing=timing)
    if blocking:
        if events is not None and info is not None:
            events.collective("complete", info)
            events.collective("wait_end", info)
        return DONE
    complete_at_wait = info is None or not _reports_completion(work, events, info)  # type: ignore[arg-type]
    return PendingCollective(work, events, info, what, keep, None, complete_at_wait)


def _reports_completion(work: dist.Work | None, events: Events, info: CollectiveInfo) -> bool:
    """Whether ``work``'s future reports the completion (from the backend's thread)."""
    if work is None:
        return False
    try:
        future = work.get_future()
    except (AttributeError, RuntimeError):
        return False
    future.add_done_callback(lambda _f: events.collective("complete", info))
    return True


def all_reduce(tensor: torch.Tensor, group: Group, label: str, events: Events) -> PendingCollective:
    """Sums ``tensor`` in place over ``group`` (HSDP's replicate all-reduce)."""
    flat = _real_view(tensor)
    return launch_unit("all_reduce", None, flat, flat, group, label, events)
