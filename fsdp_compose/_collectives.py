"""Every collective fsdp_compose issues goes through this module.

Collectives are always issued asynchronously and return a :class:`PendingCollective`
whose :meth:`~PendingCollective.wait` makes the result visible to the caller:

* CPU / gloo: ``async_op=True`` work runs on gloo's own threads while Python
  computes; ``wait()`` blocks on the work.
* CUDA / NCCL: the collective runs on a dedicated all-gather or reduce-scatter
  stream that first waits for the compute stream; ``wait()`` makes the compute
  stream wait for an event, without blocking the CPU.

[Note: collectives per backend]
fsdp_compose runs on any c10d backend. The gloo paths ([Note: reduce-scatter on
gloo], [Note: all-gather on gloo] and [Note: issuing gloo collectives], all in
``_gloo.py``) are tuned for gloo and used only where a group's CPU backend
really is ``ProcessGroupGloo``; every other backend -- torch's threaded test group, the ``fake`` backend of dry
runs, MPI, UCC, vendor backends, NCCL -- gets torch.distributed's public
collectives (``all_gather_into_tensor``, ``reduce_scatter_tensor``, ...). Which
applies is a :class:`Route`, decided once per group (:func:`route_of`, at the lazy
init of the first unit on it) and kept by the unit's default collectives
(:class:`DefaultAllGather`, :class:`DefaultReduceScatter`: the same interface as a
user's custom comm, one code path for both), so issuing costs no backend lookup.

[Note: collective extensions]
The core issues collectives; capabilities beyond FSDP2 attach here and the core
never imports them. Two registration points, both per process:

* :func:`add_listener`: observe every collective (``issue``, ``complete``,
  ``wait_begin``, ``wait_end``), e.g. the timeline (``trace``) or tests counting
  collectives;
* :func:`add_launch_wrapper`: wrap the launch of every collective. A wrapper is
  called as ``wrapper(call, issue)`` with the :class:`CollectiveCall` (kind,
  label, group, element count, dtype, step, device) and the ``issue`` callable
  that launches it; it returns what ``issue`` returns (the work to wait on, or a
  work-like object with ``wait`` and ``get_future``), and may run checks before
  or around it (debug fingerprints, the collective guard). A wrapper raising
  :class:`~fsdp_compose._errors.CollectiveMismatchError` is re-raised as is; any
  other ``RuntimeError`` is reported like a failure of the collective.

With none registered, issuing costs nothing extra. The step a collective belongs
to comes from the :class:`StepContext` of the root that issues it (each root's
scheduler owns one), so two roots in one process do not mix their steps.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.distributed as dist

from . import _compat, _gloo
from ._errors import CollectiveMismatchError

# Which path each group's collectives take (used by units and tests from here).
from ._gloo import PUBLIC_ROUTE as PUBLIC_ROUTE
from ._gloo import Route as Route
from ._gloo import gathers_in_place as gathers_in_place
from ._gloo import route_of as route_of

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


@dataclass
class StepContext:
    """The training step of one root's collectives: its scheduler advances
    ``step`` at each forward, and the units it drives pass it to the collectives
    they issue (named in errors, fingerprints and the guard)."""

    step: int = 0


@dataclass(frozen=True)
class CollectiveCall:
    """A collective about to be launched, as a launch wrapper sees it."""

    kind: CollectiveKind
    label: str
    group: dist.ProcessGroup
    numel: int  # of the input
    dtype: torch.dtype
    step: int
    device: torch.device
    # False for a user-supplied comm: it must be issued on ``group`` itself (it
    # may ask the group for its ranks), not on another group with the same ranks.
    movable: bool = True


Listener = Callable[[CollectiveEvent, CollectiveInfo], None]
# Launches one collective on the group it is given: the caller's, or one with the
# same ranks that a launch wrapper issues on instead (the collective guard).
Issue = Callable[[dist.ProcessGroup], "dist.Work | None"]
LaunchWrapper = Callable[[CollectiveCall, Issue], "dist.Work | None"]
_listeners: list[Listener] = []
_wrappers: list[LaunchWrapper] = []
_seq = itertools.count()


def add_launch_wrapper(wrapper: LaunchWrapper) -> None:
    """Wraps the launch of every later collective with ``wrapper(call, issue)``
    (see [Note: collective extensions]); the first added is the outermost."""
    if wrapper not in _wrappers:
        _wrappers.append(wrapper)


def remove_launch_wrapper(wrapper: LaunchWrapper) -> None:
    if wrapper in _wrappers:
        _wrappers.remove(wrapper)


def _wrapped(call: CollectiveCall, issue: Issue) -> dist.Work | None:
    for wrapper in reversed(_wrappers):
        issue = _through(wrapper, call, issue)
    return issue(call.group)


def _through(wrapper: LaunchWrapper, call: CollectiveCall, inner: Issue) -> Issue:
    """``inner`` behind ``wrapper``: the group an outer wrapper issues on reaches
    ``wrapper`` (in its call) and ``inner``."""

    def issue(on: dist.ProcessGroup) -> dist.Work | None:
        return wrapper(call if on is call.group else dataclasses.replace(call, group=on), inner)

    return issue


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
            except CollectiveMismatchError:
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
        backend += f" ({_compat.backend_name(group)})"
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
    issue: Callable[[bool, dist.ProcessGroup], dist.Work | None],
    step: int = 0,
    movable: bool = True,
) -> PendingCollective:
    """Launches ``issue(async_op, group)`` through the launch wrappers;
    ``movable``: see :class:`CollectiveCall`."""
    info = _info(kind, label, group.size(), inp, out)
    what = f"{kind} for {label} (step {step})"
    cpu = out.device.type == "cpu"

    def launch(on: dist.ProcessGroup = group) -> dist.Work | None:
        return issue(cpu, on)

    # "issue" is when the training thread issues it, even where a launch wrapper
    # (the guard) launches it later from another thread.
    if info is not None:
        _notify("issue", info)

    if _wrappers:
        call = CollectiveCall(kind, label, group, inp.numel(), inp.dtype, step, out.device, movable)
        launch = functools.partial(_wrapped, call, launch)
    if cpu:
        _gloo.ensure_exit_grace()
        try:
            work = launch()
        except CollectiveMismatchError:
            raise
        except RuntimeError as exc:
            raise _failure(what, exc, out, group) from exc
        if info is not None and work is not None:
            _on_complete(work, info)
        return PendingCollective(info, work=work, tensors=(inp, out), what=what, group=group)
    streams = _device_streams(out.device)
    stream = streams.reduce_scatter if kind != "all_gather" else streams.all_gather
    current = streams.module.current_stream(out.device)
    stream.wait_stream(current)
    with streams.module.stream(stream):
        try:
            launch()
        except CollectiveMismatchError:
            raise
        except RuntimeError as exc:
            raise _failure(what, exc, out, group) from exc
        event = stream.record_event()
    device = out.device

    def stream_wait() -> None:
        streams.module.current_stream(device).wait_event(event)

    return PendingCollective(
        info, stream_wait=stream_wait, tensors=(inp, out), what=what, group=group
    )


# ---------------------------------------------------------------------------
# The collectives
# ---------------------------------------------------------------------------


def _real_view(tensor: torch.Tensor) -> torch.Tensor:
    """A complex tensor as the flat real tensor of its (re, im) pairs: gloo has no
    complex types, and a sum or gather of the pairs is that of the numbers."""
    return torch.view_as_real(tensor).view(-1) if tensor.is_complex() else tensor


class _DefaultComm:
    """What fsdp_compose's own collectives share: plain buffers, which need no
    checking, and the :class:`Route` of the group they run on."""

    __slots__ = ("route",)
    trusted = True

    def __init__(self, route: Route) -> None:
        self.route = route

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class DefaultAllGather(_DefaultComm):
    """fsdp_compose's own all-gather, with the :class:`AllGatherComm` interface
    that a custom one (``set_custom_all_gather``) replaces: one code path issues
    both. Made per unit and group, on the group's :class:`Route`.

    Args:
        route: ``route_of(group)`` of the group it gathers on.
        in_place: whether its input is this rank's row of its output (as
            :func:`gathers_in_place` decided); gloo then gathers by broadcasts.
    """

    __slots__ = ("in_place",)

    def __init__(self, route: Route, in_place: bool) -> None:
        super().__init__(route)
        self.in_place = in_place

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        output, input = _real_view(output_tensor), _real_view(input_tensor)
        if output.device.type != "cpu":
            return _compat.all_gather_into_tensor(output, input, group, async_op)
        route = self.route
        if not route.gloo:
            return _compat.all_gather_into_tensor(output, input, group, True)
        if self.in_place and route.broadcast_all_gather:
            return _gloo.gloo_all_gather_by_broadcast(output, group)
        return _gloo.gloo_all_gather_into_tensor(output, input, group)


class DefaultReduceScatter(_DefaultComm):
    """fsdp_compose's own reduce-scatter (a sum), with the
    :class:`ReduceScatterComm` interface that a custom one
    (``set_custom_reduce_scatter``) replaces; see [Note: reduce-scatter on gloo].
    Made per unit and group, on the group's :class:`Route`.
    """

    __slots__ = ()

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        output, input = _real_view(output_tensor), _real_view(input_tensor)
        if output.device.type == "cpu" and self.route.all_to_all_reduce_scatter:
            return _gloo.reduce_scatter_by_all_to_all(output, input, group)
        return _compat.reduce_scatter_tensor(output, input, group, async_op)


def allocate(
    comm: AllGatherComm | ReduceScatterComm,
    numel: int,
    dtype: torch.dtype,
    device: torch.device,
    label: str,
    kind: CollectiveKind,
) -> torch.Tensor:
    """A flat communication buffer from ``comm.allocate``; a custom comm's is
    checked (the error names ``label``'s custom ``kind``)."""
    buffer = comm.allocate((numel,), dtype=dtype, device=device)
    if getattr(comm, "trusted", False):
        return buffer
    if (
        not isinstance(buffer, torch.Tensor)
        or buffer.numel() != numel
        or buffer.dtype != dtype
        or buffer.device != device
        or not buffer.is_contiguous()
    ):
        got = (
            f"a {'contiguous' if buffer.is_contiguous() else 'non-contiguous'} tensor of "
            f"{buffer.numel()} {buffer.dtype} elements on {buffer.device}"
            if isinstance(buffer, torch.Tensor)
            else type(buffer).__name__
        )
        raise ValueError(
            f"{label}'s custom {kind.replace('_', '-')}: allocate() returned {got}, but {numel} contiguous {dtype} elements "
            f"on {device} were asked for"
        )
    return buffer.view(-1)


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    label: str,
    *,
    comm: AllGatherComm | None = None,
    step: int = 0,
) -> PendingCollective:
    """Gathers ``input`` from every rank of ``group`` into ``output`` (rank-major)
    with ``comm`` (default: a :class:`DefaultAllGather` on the group's route, not
    in place). ``step``: the issuing root's step (:class:`StepContext`)."""
    gather = comm if comm is not None else DefaultAllGather(route_of(group), in_place=False)
    return _launch(
        "all_gather",
        label,
        group,
        input,
        output,
        lambda async_op, on: gather(
            output_tensor=output, input_tensor=input, group=on, async_op=async_op
        ),
        step=step,
        movable=isinstance(gather, _DefaultComm),
    )


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    label: str,
    *,
    comm: ReduceScatterComm | None = None,
    step: int = 0,
) -> PendingCollective:
    """Sums ``input`` (``group.size()`` equal chunks) over ``group`` with ``comm``
    (default: a :class:`DefaultReduceScatter` on the group's route); rank r
    receives the sum of chunk r in ``output``."""
    scatter = comm if comm is not None else DefaultReduceScatter(route_of(group))
    return _launch(
        "reduce_scatter",
        label,
        group,
        input,
        output,
        lambda async_op, on: scatter(
            output_tensor=output,
            input_tensor=input,
            group=on,
            op=dist.ReduceOp.SUM,  # type: ignore[arg-type]  # (a RedOpType member)
            async_op=async_op,
        ),
        step=step,
        movable=isinstance(scatter, _DefaultComm),
    )


def all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup, label: str, *, step: int = 0
) -> PendingCollective:
    """Sums ``tensor`` in place over ``group``."""
    tensor = _real_view(tensor)
    return _launch(
        "all_reduce",
        label,
        group,
        tensor,
        tensor,
        lambda async_op, on: dist.all_reduce(tensor, group=on, async_op=async_op),
        step=step,
    )
