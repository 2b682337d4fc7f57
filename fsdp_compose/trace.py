"""A per-rank timeline of fsdp_compose's communication and compute.

A :class:`Timeline` is an observer of one root's runtime events ([Note: runtime
events]); while subscribed it records:

* on the **compute** track: each unit's forward and backward span, and every
  time the training thread *waited* for a collective (``wait: all_gather layers.3``);
* on one **communication** track per collective kind: each collective from the
  moment it was issued to the moment it completed (reported by the backend's own
  thread on gloo; on accelerators, from device events: how long it ran on its
  stream); the tools' collectives too (a Muon exchange, a safetensors export);
* the unsharded parameter bytes held (a counter), and prefetch decisions.

Usage::

    from fsdp_compose import trace
    with trace.recording(model) as timeline:   # model: the root FSDPModule
        for step in range(3):
            train_step()
    timeline.export_chrome_trace(f"trace_rank{rank}.json")   # open in ui.perfetto.dev
    print(timeline.exposed_communication())                   # {step: seconds waited}

Per-rank files can be combined into one timeline with one track group per rank
with :func:`merge_chrome_traces`. Nothing is recorded, and nothing costs, for a
model no timeline observes. torch's profiler sees the same units without this
tool: every hook and collective carries a ``record_function`` label named as
FSDP2's (``FSDP::all_gather (layers.3)``).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any, Literal, cast

import torch.distributed as dist
import torch.nn as nn

from ._runtime import CollectiveEvent, CollectiveInfo, FSDPModule, Observer, UnitEvent, UnitInfo

__all__ = ["Timeline", "merge_chrome_traces", "recording"]

_COMPUTE_TID = 0
_COMM_TIDS = {
    "all_gather": 1,
    "reduce_scatter": 2,
    "all_reduce": 3,
    "all_to_all": 4,  # the tools' (see [Note: tools' collectives])
    "all_gather_object": 5,
    "broadcast_object": 6,
    "send_recv": 7,
}
_SPANS: dict[UnitEvent, tuple[str, bool]] = {
    "forward_begin": ("forward", True),
    "forward_end": ("forward", False),
    "backward_begin": ("backward", True),
    "backward_end": ("backward", False),
}


class Timeline(Observer):
    """Records the events of the roots it observes, as Chrome-trace events."""

    unit_events = frozenset({*_SPANS, "prefetch", "prefetch_deferred"})

    def __init__(self) -> None:
        self._lock = threading.Lock()  # "complete" events arrive from backend threads
        self._events: list[dict[str, Any]] = []
        self._open_spans: dict[tuple[str, str], list[float]] = defaultdict(list)
        self._issued: dict[int, float] = {}
        self._wait_started: dict[int, float] = {}
        self._exposed: dict[int, float] = defaultdict(float)
        self._step = 0
        self._origin_ns = time.perf_counter_ns()

    # -- results ----------------------------------------------------------

    def events(self) -> list[dict[str, Any]]:
        """A copy of the recorded Chrome-trace events."""
        with self._lock:
            return [dict(e) for e in self._events]

    def clear(self) -> None:
        """Drops every recorded event."""
        with self._lock:
            self._events.clear()
            self._open_spans.clear()
            self._issued.clear()
            self._wait_started.clear()
            self._exposed.clear()

    def exposed_communication(self) -> dict[int, float]:
        """Seconds the training thread spent waiting on collectives, per step.

        A step starts when the root's forward begins. Time waited is communication
        that computation did not hide. On an accelerator, where the host does not
        wait, it is the time the waiting stream stalled until the collective
        finished, from device events (complete once the recording ends).
        """
        with self._lock:
            return {step: us / 1e6 for step, us in sorted(self._exposed.items())}

    def to_chrome_trace(self, rank: int | None = None) -> dict[str, Any]:
        """The events as a Chrome-trace object (``{"traceEvents": [...]}``)."""
        return _to_chrome_trace(self.events(), rank)

    def export_chrome_trace(self, path: str | os.PathLike[str], rank: int | None = None) -> None:
        """Writes the timeline as Chrome-trace JSON (opens in Perfetto)."""
        with open(path, "w") as f:
            json.dump(self.to_chrome_trace(rank), f)

    # -- recording (the runtime's events) ---------------------------------

    def _now_us(self) -> float:
        return (time.perf_counter_ns() - self._origin_ns) / 1000.0

    def _append(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._events.append(event)

    def _instant(self, name: str, cat: str, args: dict[str, Any], ts: float | None = None) -> None:
        ts = self._now_us() if ts is None else ts
        event = {"name": name, "cat": cat, "ph": "i", "s": "t", "ts": ts, "tid": _COMPUTE_TID}
        self._append({**event, "args": {**args, "step": self._step}})

    def on_step(self, step: int) -> None:
        self._step = step
        now = self._now_us()
        self._append(
            {"name": f"step {step}", "ph": "i", "s": "p", "ts": now, "tid": _COMPUTE_TID}
            | {"args": {"step": step}}
        )

    def on_unit(self, event: UnitEvent, info: UnitInfo) -> None:
        name = info.name
        span = _SPANS.get(event)
        if span is None:
            if event in ("prefetch", "prefetch_deferred"):
                self._instant(f"{event} {name}", event, {"unit": name})
            return
        kind, begins = span
        if begins:
            self._open_spans[(kind, name)].append(self._now_us())
            return
        starts = self._open_spans.get((kind, name))
        if starts:
            start = starts.pop()
            self._append(
                {"name": f"{kind} {name}", "cat": kind, "ph": "X", "ts": start}
                | {"dur": self._now_us() - start, "tid": _COMPUTE_TID}
                | {"args": {"unit": name, "step": self._step}}
            )

    def on_memory(
        self, event: Literal["alloc", "free"], info: UnitInfo, nbytes: int, total: int
    ) -> None:
        ts = self._now_us()
        args = {"unit": info.name, "bytes": nbytes, "total_bytes": total}
        self._instant(f"unsharded_{event} {info.name}", f"memory_{event}", args, ts)
        self._append({"name": "unsharded_bytes", "ph": "C", "ts": ts, "args": {"bytes": total}})

    def on_collective(self, event: CollectiveEvent, info: CollectiveInfo) -> None:
        now = self._now_us()
        if event == "issue":
            self._issued[info.seq] = now
        elif event == "complete":
            # On an accelerator, the device's time (see [Note: device times]).
            start = self._issued.pop(info.seq, now)
            dur = now - start if info.duration_s is None else info.duration_s * 1e6
            args = {"unit": info.label, "bytes": info.input_bytes, "group_size": info.group_size}
            self._append(
                {"name": f"{info.kind} {info.label}", "cat": info.kind, "ph": "X", "ts": start}
                | {"dur": dur, "tid": _COMM_TIDS.get(info.kind, _COMPUTE_TID)}
                | {"args": args | {"dtype": str(info.dtype), "step": self._step}}
            )
        elif event == "wait_begin":
            self._wait_started[info.seq] = now
        elif event == "wait_end":
            start = self._wait_started.pop(info.seq, now)
            # On an accelerator, reported later: the stall of the waiting stream.
            step = self._step if info.waited_s is None else info.step
            dur = now - start if info.waited_s is None else info.waited_s * 1e6
            with self._lock:
                self._exposed[step] += dur
            self._append(
                {"name": f"wait {info.kind} {info.label}", "cat": "wait", "ph": "X", "ts": start}
                | {"dur": dur, "tid": _COMPUTE_TID}
                | {"args": {"unit": info.label, "kind": info.kind, "step": step}}
            )


@contextlib.contextmanager
def recording(*modules: nn.Module, timeline: Timeline | None = None) -> Iterator[Timeline]:
    """Records the runtime events of ``modules`` (root ``FSDPModule``s, e.g. the
    model, or every pipeline stage's root) inside the ``with`` block, into
    ``timeline`` (a new one by default), which it yields."""
    if not modules:
        raise TypeError("trace.recording() needs the model: trace.recording(model)")
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise TypeError(
                f"trace.recording() takes modules annotated with fully_shard, got "
                f"{type(module).__name__}"
            )
    timeline = Timeline() if timeline is None else timeline
    for module in modules:
        cast(FSDPModule, module).register_observer(timeline)
    try:
        yield timeline
    finally:
        for module in modules:
            cast(FSDPModule, module).unregister_observer(timeline)


# ---------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _to_chrome_trace(recorded: list[dict[str, Any]], rank: int | None) -> dict[str, Any]:
    rank = _rank() if rank is None else rank
    trace_events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}},
        {
            "name": "thread_name",
            "ph": "M",
            "pid": rank,
            "tid": _COMPUTE_TID,
            "args": {"name": "compute"},
        },
    ]
    for kind, tid in _COMM_TIDS.items():
        trace_events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": rank,
                "tid": tid,
                "args": {"name": f"comm: {kind}"},
            }
        )
    for event in recorded:
        event["pid"] = rank
        event.setdefault("tid", _COMPUTE_TID)
        trace_events.append(event)
    return {"traceEvents": trace_events, "displayTimeUnit": "ms"}


def merge_chrome_traces(
    paths: Sequence[str | os.PathLike[str]], out_path: str | os.PathLike[str]
) -> None:
    """Combines per-rank trace files into one file, one process track per rank.

    Each rank's clock starts at its own import time, so tracks are aligned on each
    rank's first event (close enough to read overlap within a rank).
    """
    merged: list[dict[str, Any]] = []
    for path in paths:
        with open(path) as f:
            rank_events = json.load(f)["traceEvents"]
        timed = [e["ts"] for e in rank_events if "ts" in e]
        shift = min(timed) if timed else 0.0
        for event in rank_events:
            if "ts" in event:
                event["ts"] -= shift
            merged.append(event)
    with open(out_path, "w") as f:
        json.dump({"traceEvents": merged, "displayTimeUnit": "ms"}, f)
