"""Listeners and launch wrappers: how extensions observe and wrap every collective.

The core offers one hook (``_collectives.launch_hook``); this module fills it while at
least one listener or wrapper is registered, and empties it when the last one is
removed, so that without them issuing a collective costs nothing extra. See
[Note: collective extensions] in ``_collectives.py``.

* :func:`add_listener`: ``listener(event, info)`` for every collective (``issue``,
  ``complete``, ``wait_begin``, ``wait_end``), e.g. the timeline (``trace``) or
  tests counting collectives. ``complete`` comes from the communication thread where
  the work has a future, else at the wait.
* :func:`add_launch_wrapper`: ``wrapper(call, issue)`` around the launch of every
  collective (debug fingerprints, the collective guard); it returns what ``issue``
  returns and may issue on another group with the same ranks (``call.movable``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from . import _collectives
from ._collectives import CollectiveKind, Issue

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
LaunchWrapper = Callable[[CollectiveCall, Issue], "dist.Work | None"]
_listeners: list[Listener] = []
_wrappers: list[LaunchWrapper] = []
_seq = itertools.count()


def add_launch_wrapper(wrapper: LaunchWrapper) -> None:
    """Wraps the launch of every later collective with ``wrapper(call, issue)``;
    the first added is the outermost."""
    if wrapper not in _wrappers:
        _wrappers.append(wrapper)
    _attach()


def remove_launch_wrapper(wrapper: LaunchWrapper) -> None:
    if wrapper in _wrappers:
        _wrappers.remove(wrapper)
    _attach()


def add_listener(listener: Listener) -> None:
    """Subscribes ``listener(event, info)`` to every collective this process issues."""
    _listeners.append(listener)
    _attach()


def remove_listener(listener: Listener) -> None:
    if listener in _listeners:
        _listeners.remove(listener)
    _attach()


def _notify(event: CollectiveEvent, info: CollectiveInfo) -> None:
    for listener in tuple(_listeners):
        listener(event, info)


def _through(wrapper: LaunchWrapper, call: CollectiveCall, inner: Issue) -> Issue:
    """``inner`` behind ``wrapper``: the group an outer wrapper issues on reaches
    ``wrapper`` (in its call) and ``inner``."""

    def issue(on: dist.ProcessGroup) -> dist.Work | None:
        return wrapper(call if on is call.group else dataclasses.replace(call, group=on), inner)

    return issue


class _Observer:
    """Reports one collective's waits (and its completion, where the work has no
    future to report it from the communication thread) to the listeners."""

    __slots__ = ("_complete_at_wait", "_info")

    def __init__(self, info: CollectiveInfo, complete_at_wait: bool) -> None:
        self._info = info
        self._complete_at_wait = complete_at_wait

    def wait_begin(self) -> None:
        if _listeners:
            _notify("wait_begin", self._info)

    def wait_end(self) -> None:
        if _listeners:
            if self._complete_at_wait:
                _notify("complete", self._info)
            _notify("wait_end", self._info)


def _reports_completion(work: dist.Work | None, info: CollectiveInfo) -> bool:
    """Whether ``work``'s future reports the completion (from the communication thread)."""
    if work is None:
        return False
    try:
        future = work.get_future()
    except (AttributeError, RuntimeError):  # e.g. point-to-point exchanges
        return False
    future.add_done_callback(lambda _f: _notify("complete", info))
    return True


class _Hook:
    """The core's collective hook while listeners or wrappers are registered."""

    def launch(
        self,
        kind: CollectiveKind,
        label: str,
        group: dist.ProcessGroup,
        inp: torch.Tensor,
        out: torch.Tensor,
        step: int,
        movable: bool,
        issue: Issue,
    ) -> tuple[dist.Work | None, _Observer | None]:
        info = None
        if _listeners:
            numel = (inp.numel(), out.numel())
            info = CollectiveInfo(kind, label, group.size(), *numel, inp.dtype, next(_seq))
            # "issue" is when the training thread issues it, even where a launch
            # wrapper (the guard) launches it later from another thread.
            _notify("issue", info)
        if _wrappers:
            call = CollectiveCall(
                kind, label, group, inp.numel(), inp.dtype, step, out.device, movable
            )
            for wrapper in reversed(_wrappers):
                issue = _through(wrapper, call, issue)
        work = issue(group)
        if info is None:
            return work, None
        return work, _Observer(info, not _reports_completion(work, info))


_HOOK = _Hook()


def _attach() -> None:
    _collectives.launch_hook = _HOOK if (_listeners or _wrappers) else None
