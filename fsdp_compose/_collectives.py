"""Every collective fsdp_compose issues goes through this module.

Collectives are issued asynchronously and return a :class:`PendingCollective`
whose :meth:`~PendingCollective.wait` makes the result visible: on CPU the work
runs on the backend's threads and ``wait()`` blocks on it; on CUDA it runs on an
all-gather or reduce-scatter side stream that first waits for the compute
stream, and ``wait()`` makes the compute stream wait for an event.

[Note: collectives per backend]
fsdp_compose runs on any c10d backend. Which path a group's CPU collectives take
is its :class:`Route`, decided once per group (:func:`route_of`, at the lazy init
of the first unit on it) and kept by the unit's :class:`DefaultComm`, so issuing
costs no backend lookup; a user's custom comm goes through the same launch. The
core's route issues torch.distributed's public collectives, which every backend
has (torch's threaded test group, the ``fake`` backend of dry runs, MPI, UCC,
vendor backends); extensions register routes for the backends they know
(:data:`route_providers`), e.g. gloo's (``_gloo.py``). Accelerator tensors
(NCCL) always take the public collectives, on side streams.

[Note: collective extensions]
Capabilities beyond FSDP2 attach here (the core never imports them), per
process: routes (above); the error for a failed collective
(:data:`explain_failure`, ``_failures.py``); one hook around every launch
(:data:`launch_hook`), set by ``_collective_hooks.py`` while listeners (the
timeline, tests) or launch wrappers (debug fingerprints, the guard) exist; and
the check of custom comms' buffers (:data:`check_custom_buffer`). A hook raising
:class:`~fsdp_compose._errors.CollectiveMismatchError` is re-raised as is; any
other ``RuntimeError`` is reported like a failure of the collective. With none
set, issuing costs one ``None`` check. A collective's step comes from the
:class:`StepContext` of the root that issues it, so two roots in one process do
not mix their steps.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.distributed as dist

from . import _compat
from ._errors import CollectiveMismatchError

logger = logging.getLogger("fsdp_compose")

Group = dist.ProcessGroup
CollectiveKind = Literal["all_gather", "reduce_scatter", "all_reduce"]


class _CustomComm(Protocol):
    """FSDP2's ``Comm`` interface: ``allocate`` makes the communication buffers
    (for an all-gather, the output, whose row for this rank is the input)."""

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor: ...


class AllGatherComm(_CustomComm, Protocol):
    """FSDP2's ``AllGather`` (``FSDPModule.set_custom_all_gather``)."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None: ...


class ReduceScatterComm(_CustomComm, Protocol):
    """FSDP2's ``ReduceScatter`` (``FSDPModule.set_custom_reduce_scatter``)."""

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
    """One root's training step, advanced by its scheduler at each forward and
    named by its units' collectives (in errors, fingerprints and the guard)."""

    step: int = 0


class WaitObserver(Protocol):
    """Told when the training thread waits for one collective."""

    def wait_begin(self) -> None: ...
    def wait_end(self) -> None: ...


class CollectiveHook(Protocol):
    """Attached to every collective (see [Note: collective extensions]):
    ``launch`` issues it through ``issue(group)`` -- on ``group``, or where
    ``movable`` on another group with the same ranks -- and returns the work and
    an observer of the waits (or ``None``)."""

    def launch(
        self,
        kind: CollectiveKind,
        label: str,
        group: Group,
        inp: torch.Tensor,
        out: torch.Tensor,
        step: int,
        movable: bool,
        issue: Issue,
    ) -> tuple[dist.Work | None, WaitObserver | None]: ...


#: Launches one collective on the group it is given: the caller's, or one with the
#: same ranks that a hook issues on instead (the collective guard).
Issue = Callable[[Group], "dist.Work | None"]
#: Attached to every later collective (``_collective_hooks.py``); ``None`` costs nothing.
launch_hook: CollectiveHook | None = None


class Route:
    """How the collectives of CPU tensors on one group are issued ([Note: collectives
    per backend]), here torch.distributed's public ones: asynchronously, returning
    the work to wait on; ``label`` (the unit) and ``step`` (the root's) name it."""

    __slots__ = ()
    name = "public"

    def gathers_in_place(self, row_bytes: int) -> bool:
        """Whether all-gathers of ``row_bytes`` rows take this rank's row of the
        output as input (else a buffer of its own: not every backend allows aliasing)."""
        return False

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: Group, label: str, step: int
    ) -> dist.Work | None:
        return _compat.all_gather_into_tensor(output, input, group, True)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, group: Group, label: str, step: int
    ) -> dist.Work | None:
        return _compat.reduce_scatter_tensor(output, input, group, True)

    def all_reduce(
        self, tensor: torch.Tensor, group: Group, label: str, step: int
    ) -> dist.Work | None:
        return dist.all_reduce(tensor, group=group, async_op=True)


PUBLIC_ROUTE = Route()
RouteProvider = Callable[[dist.ProcessGroup], "Route | None"]
#: ``provider(group)`` returns the :class:`Route` for a group it serves, else ``None``;
#: asked (the latest added first) once per group, at the first collective on it.
route_providers: list[RouteProvider] = []
_routes: weakref.WeakKeyDictionary[dist.ProcessGroup, Route] = weakref.WeakKeyDictionary()


def route_of(group: dist.ProcessGroup) -> Route:
    """The :class:`Route` of ``group``: decided on the first call for the group and
    remembered after (units decide theirs at lazy init, so issuing costs no lookup)."""
    route = _routes.get(group)
    if route is None:
        found = (r for provider in reversed(route_providers) if (r := provider(group)) is not None)
        route = _routes[group] = next(found, PUBLIC_ROUTE)
        logger.debug(
            "fsdp_compose: a group of %d ranks takes the %s route", group.size(), route.name
        )
    return route


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
    communication may still touch it (``_group`` names the backend if it fails)."""

    _work: dist.Work | None
    _observer: WaitObserver | None = None
    _tensors: tuple[torch.Tensor, ...] = ()
    _what: str = ""
    _group: Group | None = None
    _stream_wait: Callable[[], None] | None = None
    _done: bool = False

    def wait(self) -> None:
        if self._done:
            return
        observer = self._observer
        if observer is not None:
            observer.wait_begin()
        if self._work is not None:
            try:
                self._work.wait()
            except CollectiveMismatchError:
                raise
            except RuntimeError as exc:
                raise explain_failure(self._what, exc, self._tensors[1], self._group) from exc
        if self._stream_wait is not None:
            self._stream_wait()
        if observer is not None:
            observer.wait_end()
        self._done = True
        self._work = self._stream_wait = self._group = self._observer = None
        self._tensors = ()


def _plain_failure(
    what: str, exc: BaseException, tensor: torch.Tensor | None, group: Group | None
) -> RuntimeError:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return RuntimeError(f"fsdp_compose: {what} failed on rank {rank}: {exc}")


FailureExplainer = Callable[
    [str, BaseException, "torch.Tensor | None", "Group | None"], RuntimeError
]
#: The error raised for a failed collective ``what`` on ``tensor`` and ``group``;
#: ``_failures.py`` sets one that says why.
explain_failure: FailureExplainer = _plain_failure


def _launch(
    kind: CollectiveKind,
    label: str,
    group: Group,
    inp: torch.Tensor,
    out: torch.Tensor,
    issue: Callable[[bool, Group], dist.Work | None],
    step: int = 0,
    movable: bool = True,
) -> PendingCollective:
    """Launches ``issue(async_op, group)`` (through the hook, if any); ``movable``:
    whether a hook may issue it on another group with the same ranks (not a
    user-supplied comm, which may ask its group for its ranks)."""
    what = f"{kind} for {label} (step {step})"
    on_cpu = out.device.type == "cpu"
    if not on_cpu:
        streams = _device_streams(out.device)
        stream = streams.reduce_scatter if kind != "all_gather" else streams.all_gather
        stream.wait_stream(streams.module.current_stream(out.device))
    try:
        with contextlib.nullcontext() if on_cpu else streams.module.stream(stream):
            hook = launch_hook
            if hook is None:
                work, observer = issue(on_cpu, group), None
            else:
                run = lambda on: issue(on_cpu, on)  # noqa: E731
                work, observer = hook.launch(kind, label, group, inp, out, step, movable, run)
    except CollectiveMismatchError:
        raise
    except RuntimeError as exc:
        raise explain_failure(what, exc, out, group) from exc
    if on_cpu:
        return PendingCollective(work, observer, (inp, out), what, group)
    event, device = stream.record_event(), out.device

    def stream_wait() -> None:
        streams.module.current_stream(device).wait_event(event)

    return PendingCollective(None, observer, (inp, out), what, group, stream_wait)


def _real_view(tensor: torch.Tensor) -> torch.Tensor:
    """A complex tensor as the flat real tensor of its (re, im) pairs: gloo has no
    complex types, and a sum or gather of the pairs is that of the numbers."""
    return torch.view_as_real(tensor).view(-1) if tensor.is_complex() else tensor


class DefaultComm:
    """fsdp_compose's own all-gather or reduce-scatter (plain buffers) on the
    ``route`` of its group, made per unit and group; a custom comm replaces it, in
    the same launch. ``in_place`` (all-gathers): whether the input is this rank's
    row of the output (:meth:`Route.gathers_in_place`; always on NCCL), else a buffer of its own."""

    __slots__ = ("in_place", "route")

    def __init__(self, route: Route, in_place: bool = False) -> None:
        self.route = route
        self.in_place = in_place


#: ``check(buffer, numel, dtype, device, what)`` raises if the buffer a custom comm
#: allocated is not ``numel`` contiguous elements as asked (``_validation``).
check_custom_buffer: Callable[[object, int, torch.dtype, torch.device, str], None] | None = None
_SUM: dist.ReduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # (a RedOpType member)


def allocate(
    comm: AllGatherComm | ReduceScatterComm,
    numel: int,
    dtype: torch.dtype,
    device: torch.device,
    label: str,
    kind: CollectiveKind,
) -> torch.Tensor:
    """A flat communication buffer from a custom ``comm.allocate``, checked by
    :data:`check_custom_buffer` where set (naming ``label``'s custom ``kind``)."""
    buffer = comm.allocate((numel,), dtype=dtype, device=device)
    if check_custom_buffer is not None:
        what = f"{label}'s custom {kind.replace('_', '-')}"
        check_custom_buffer(buffer, numel, dtype, device, what)
    return buffer.view(-1)


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    label: str,
    *,
    comm: AllGatherComm | DefaultComm | None = None,
    step: int = 0,
) -> PendingCollective:
    """Gathers ``input`` from every rank of ``group`` into ``output`` (rank-major)
    with ``comm`` (default: a :class:`DefaultComm` on the group's route, not in
    place). ``step``: the issuing root's step (:class:`StepContext`)."""
    return _launch_comm("all_gather", output, input, group, label, comm, step)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    label: str,
    *,
    comm: ReduceScatterComm | DefaultComm | None = None,
    step: int = 0,
) -> PendingCollective:
    """Sums ``input`` (``group.size()`` equal chunks) over ``group`` with ``comm``
    (default: a :class:`DefaultComm` on the group's route); rank r receives the
    sum of chunk r in ``output``."""
    return _launch_comm("reduce_scatter", output, input, group, label, comm, step)


def _launch_comm(
    kind: Literal["all_gather", "reduce_scatter"],
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    label: str,
    comm: AllGatherComm | ReduceScatterComm | DefaultComm | None,
    step: int,
) -> PendingCollective:
    gather = kind == "all_gather"
    issue: Callable[[bool, Group], dist.Work | None]
    if own := comm is None or isinstance(comm, DefaultComm):  # fsdp_compose's own
        route = route_of(group) if comm is None else comm.route
        out, inp = _real_view(output), _real_view(input)
        public = _compat.all_gather_into_tensor if gather else _compat.reduce_scatter_tensor
        route_issue = route.all_gather if gather else route.reduce_scatter

        def issue(async_op: bool, on: Group) -> dist.Work | None:
            if out.device.type != "cpu":
                return public(out, inp, on, async_op)
            return route_issue(out, inp, on, label, step)

    else:  # FSDP2's Comm interface: keywords, and ReduceScatter's op
        call: Callable[..., dist.Work | None] = comm
        extra = {} if gather else {"op": _SUM}

        def issue(async_op: bool, on: Group) -> dist.Work | None:
            return call(
                output_tensor=output, input_tensor=input, group=on, async_op=async_op, **extra
            )

    return _launch(kind, label, group, input, output, issue, step, movable=own)


def all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup, label: str, *, step: int = 0
) -> PendingCollective:
    """Sums ``tensor`` in place over ``group``."""
    tensor = _real_view(tensor)

    def issue(async_op: bool, on: Group) -> dist.Work | None:
        if tensor.device.type != "cpu":
            return dist.all_reduce(tensor, group=on, async_op=async_op)
        return route_of(group).all_reduce(tensor, on, label, step)

    return _launch("all_reduce", label, group, tensor, tensor, issue, step)
