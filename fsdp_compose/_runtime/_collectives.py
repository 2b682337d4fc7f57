"""Every collective fsdp_compose issues goes through this module.

[Note: Comm objects]
As in FSDP2, a unit's all-gather and reduce-scatter are objects with FSDP2's
``Comm`` interface (``allocate`` for the buffers, ``__call__`` to issue), one of
each per unit: :class:`DefaultAllGather` and :class:`DefaultReduceScatter` call
torch.distributed's public ``all_gather_into_tensor`` and ``reduce_scatter_tensor``
on every backend, so torch's own tools (``CommDebugMode``, the profiler, the
flight recorder) see the same collective kinds and counts as with FSDP2; a user's
object (``set_custom_all_gather`` / ``set_custom_reduce_scatter``) replaces them
for that unit. As in FSDP2, the all-gather's input is this rank's row of its
output (in place).

Collectives are issued asynchronously and return a :class:`PendingCollective`
whose :meth:`~PendingCollective.wait` makes the result visible: on CPU the work
runs on the backend's threads and ``wait()`` blocks on it; on an accelerator it
runs on an all-gather or reduce-scatter side stream that first waits for the
compute stream, and ``wait()`` makes the compute stream wait for an event.
Each launch is labelled for torch's profiler (``fsdp_compose::all_gather
(layers.3)``) and reported to the root's observers ([Note: runtime events]).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from . import _compat
from ._events import CollectiveInfo, CollectiveKind, Events

Group = dist.ProcessGroup


class AllGather(Protocol):
    """FSDP2's ``AllGather`` interface (``FSDPModule.set_custom_all_gather``):
    ``allocate`` makes the output buffer, whose row for this rank is the input."""

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor: ...

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None: ...


class ReduceScatter(Protocol):
    """FSDP2's ``ReduceScatter`` interface (``FSDPModule.set_custom_reduce_scatter``)."""

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor: ...

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
        return _compat.all_gather_into_tensor(out, inp, group, async_op)


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
        return _compat.reduce_scatter_tensor(out, inp, group, async_op, op)


def _real_view(tensor: torch.Tensor) -> torch.Tensor:
    """A complex tensor as the flat real tensor of its (re, im) pairs: gloo has no
    complex types, and a sum or gather of the pairs is that of the numbers."""
    return torch.view_as_real(tensor).view(-1) if tensor.is_complex() else tensor


def allocate(
    comm: AllGather | ReduceScatter,
    numel: int,
    dtype: torch.dtype,
    device: torch.device,
    label: str,
    kind: CollectiveKind,
) -> torch.Tensor:
    """A flat buffer of ``numel`` elements from ``comm.allocate``; a custom comm's
    buffer is checked (the error names unit ``label``'s collective ``kind``)."""
    buffer = comm.allocate((numel,), dtype=dtype, device=device)
    if not isinstance(comm, _DefaultAllocation):
        what = f"{label}'s custom {kind.replace('_', '-')}"
        _check_buffer(buffer, numel, dtype, device, what)
    return buffer.view(-1)


def _check_buffer(
    buffer: object, numel: int, dtype: torch.dtype, device: torch.device, what: str
) -> None:
    if (
        isinstance(buffer, torch.Tensor)
        and buffer.numel() == numel
        and buffer.dtype == dtype
        and buffer.device == device
        and buffer.is_contiguous()
    ):
        return
    got = (
        f"a {'contiguous' if buffer.is_contiguous() else 'non-contiguous'} tensor of "
        f"{buffer.numel()} {buffer.dtype} elements on {buffer.device}"
        if isinstance(buffer, torch.Tensor)
        else type(buffer).__name__
    )
    raise ValueError(
        f"{what}: allocate() returned {got}, but {numel} contiguous {dtype} elements "
        f"on {device} were asked for"
    )


class _DeviceStreams:
    """Side streams shared by all units on one accelerator device."""

    def __init__(self, device: torch.device) -> None:
        module = getattr(torch, device.type)
        # High priority so copies for communication are not starved by compute.
        self.all_gather = module.Stream(device=device, priority=-1)
        self.reduce_scatter = module.Stream(device=device, priority=-1)
        self.module = module


_device_streams = functools.cache(_DeviceStreams)


@dataclass(slots=True, eq=False)
class PendingCollective:
    """An issued collective; :meth:`wait` makes its output usable. Holds the tensors
    involved until then, so that their memory cannot be reused while the
    communication may still touch it."""

    _work: dist.Work | None
    _events: Events | None = None
    _info: CollectiveInfo | None = None
    _what: tuple[str, str, int] = ("", "", 0)  # kind, unit, step: named if it fails
    _tensors: tuple[torch.Tensor, ...] = ()
    _stream_wait: Callable[[], None] | None = None
    _complete_at_wait: bool = True
    _done: bool = False

    def wait(self) -> None:
        if self._done:
            return
        events, info = self._events, self._info
        if events is not None and info is not None:
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
            if self._complete_at_wait:
                events.collective("complete", info)
            events.collective("wait_end", info)
        self._done = True
        self._work = self._stream_wait = self._events = None
        self._tensors = ()


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


def launch(
    kind: CollectiveKind,
    issue: Callable[[], dist.Work | None],
    output: torch.Tensor,
    input: torch.Tensor,
    group: Group,
    label: str,
    events: Events,
    *,
    custom: bool = False,
) -> PendingCollective:
    """Launches ``issue()`` (an asynchronous collective from ``input`` into
    ``output`` on ``group``) for unit ``label``, on a side stream on accelerators,
    labelled for the profiler and reported to ``events``."""
    info = None
    if events.on_collective:
        numels = (input.numel(), output.numel())
        info = CollectiveInfo(
            kind, label, group, *numels, input.dtype, events.step, events.next_seq(), custom
        )
        events.collective("issue", info)  # an observer may refuse it by raising
    on_cpu = output.device.type == "cpu"
    with _compat.profiler_label(kind, label):
        try:
            if on_cpu:
                work = issue()
            else:
                streams = _device_streams(output.device)
                stream = streams.all_gather if kind == "all_gather" else streams.reduce_scatter
                stream.wait_stream(streams.module.current_stream(output.device))
                with streams.module.stream(stream):
                    work = issue()
        except RuntimeError as exc:
            _explain(exc, kind, label, events.step)
            raise
    what = (kind, label, events.step)
    if not on_cpu:
        event, device = stream.record_event(), output.device

        def stream_wait() -> None:
            streams.module.current_stream(device).wait_event(event)

        return PendingCollective(None, events, info, what, (input, output), stream_wait)
    complete_at_wait = info is None or not _reports_completion(work, events, info)
    return PendingCollective(work, events, info, what, (input, output), None, complete_at_wait)


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


def all_gather(
    comm: AllGather,
    output: torch.Tensor,
    input: torch.Tensor,
    group: Group,
    label: str,
    events: Events,
) -> PendingCollective:
    """Gathers ``input`` (this rank's row of ``output``) from every rank of ``group``
    into ``output`` (rank-major) with ``comm``."""

    def issue() -> dist.Work | None:
        return comm(output_tensor=output, input_tensor=input, group=group, async_op=True)

    custom = not isinstance(comm, DefaultAllGather)
    return launch("all_gather", issue, output, input, group, label, events, custom=custom)


_SUM: dist.ReduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # (a RedOpType member)


def reduce_scatter(
    comm: ReduceScatter,
    output: torch.Tensor,
    input: torch.Tensor,
    group: Group,
    label: str,
    events: Events,
) -> PendingCollective:
    """Sums ``input`` (``group.size()`` equal chunks) over ``group`` with ``comm``;
    rank r receives the sum of chunk r in ``output``."""

    def issue() -> dist.Work | None:
        return comm(output_tensor=output, input_tensor=input, group=group, op=_SUM, async_op=True)

    custom = not isinstance(comm, DefaultReduceScatter)
    return launch("reduce_scatter", issue, output, input, group, label, events, custom=custom)


def all_reduce(tensor: torch.Tensor, group: Group, label: str, events: Events) -> PendingCollective:
    """Sums ``tensor`` in place over ``group`` (HSDP's replicate all-reduce)."""
    flat = _real_view(tensor)

    def issue() -> dist.Work | None:
        return dist.all_reduce(flat, group=group, async_op=True)

    return launch("all_reduce", issue, flat, flat, group, label, events)
