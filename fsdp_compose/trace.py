"""A per-rank timeline of fsdp_compose's communication and compute.

Off by default; while off, nothing is recorded and the hot path pays one module
attribute check. While on, this process records:

* on the **compute** track: each unit's forward and backward span, and every
  time the training thread *waited* for a collective (``wait: all_gather layers.3``);
* on one **communication** track per collective kind: each collective from the
  moment it was issued to the moment it completed (reported by the backend's own
  thread on gloo; at the wait on accelerators);
* the unsharded parameter bytes held (a counter), and prefetch decisions.

Usage::

    from fsdp_compose import trace
    with trace.recording():
        for step in range(3):
            train_step()
    trace.export_chrome_trace(f"trace_rank{rank}.json")   # open in ui.perfetto.dev
    print(trace.exposed_communication())                   # {step: seconds waited}

Per-rank files can be combined into one timeline with one track group per rank
with :func:`merge_chrome_traces`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import torch.distributed as dist

from . import _collective_hooks, _scheduler

__all__ = [
    "clear",
    "disable",
    "enable",
    "events",
    "export_chrome_trace",
    "exposed_communication",
    "is_enabled",
    "merge_chrome_traces",
    "recording",
    "to_chrome_trace",
]

ENABLED = False

_COMPUTE_TID = 0
_COMM_TIDS = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3}

_lock = threading.Lock()
_events: list[dict[str, Any]] = []
_open_spans: dict[tuple[str, str], list[float]] = defaultdict(list)
_issued: dict[int, float] = {}
_wait_started: dict[int, float] = {}
_exposed: dict[int, float] = defaultdict(float)
_step = 0
_origin_ns = time.perf_counter_ns()


def _now_us() -> float:
    return (time.perf_counter_ns() - _origin_ns) / 1000.0


def _append(event: dict[str, Any]) -> None:
    with _lock:  # "complete" events arrive from communication threads
        _events.append(event)


def enable() -> None:
    """Starts recording (events already recorded are kept; see :func:`clear`)."""
    global ENABLED
    if not ENABLED:
        _collective_hooks.add_listener(_on_collective)
        _scheduler.observer = sys.modules[__name__]  # type: ignore[assignment]
        ENABLED = True


def disable() -> None:
    """Stops recording; recorded events stay available for export."""
    global ENABLED
    ENABLED = False
    _collective_hooks.remove_listener(_on_collective)
    _scheduler.observer = None


def is_enabled() -> bool:
    return ENABLED


def clear() -> None:
    """Drops every recorded event."""
    with _lock:
        _events.clear()
        _open_spans.clear()
        _issued.clear()
        _wait_started.clear()
        _exposed.clear()


@contextlib.contextmanager
def recording(*, clear_first: bool = True) -> Iterator[None]:
    """Records everything inside the ``with`` block."""
    if clear_first:
        clear()
    enable()
    try:
        yield
    finally:
        disable()


def events() -> list[dict[str, Any]]:
    """A copy of the recorded Chrome-trace events of this process."""
    with _lock:
        return [dict(e) for e in _events]


def exposed_communication() -> dict[int, float]:
    """Seconds the training thread spent waiting on collectives, per step.

    A step starts when the root's forward begins. Time waited is communication that
    computation did not hide.
    """
    with _lock:
        return {step: us / 1e6 for step, us in sorted(_exposed.items())}


# ---------------------------------------------------------------------------
# recording (called by the scheduler and the collectives listener)
# ---------------------------------------------------------------------------


def set_step(step: int) -> None:
    global _step
    _step = step
    _append(
        {
            "name": f"step {step}",
            "ph": "i",
            "s": "p",
            "ts": _now_us(),
            "tid": _COMPUTE_TID,
            "args": {"step": step},
        }
    )


def begin_span(kind: str, unit: str) -> None:
    _open_spans[(kind, unit)].append(_now_us())


def end_span(kind: str, unit: str) -> None:
    starts = _open_spans.get((kind, unit))
    if not starts:
        return
    start = starts.pop()
    _append(
        {
            "name": f"{kind} {unit}",
            "cat": kind,
            "ph": "X",
            "ts": start,
            "dur": _now_us() - start,
            "tid": _COMPUTE_TID,
            "args": {"unit": unit, "step": _step},
        }
    )


def instant(name: str, unit: str) -> None:
    _append(
        {
            "name": f"{name} {unit}",
            "cat": name,
            "ph": "i",
            "s": "t",
            "ts": _now_us(),
            "tid": _COMPUTE_TID,
            "args": {"unit": unit, "step": _step},
        }
    )


def memory_event(kind: str, unit: str, nbytes: int, total: int) -> None:
    ts = _now_us()
    _append(
        {
            "name": f"unsharded_{kind} {unit}",
            "cat": f"memory_{kind}",
            "ph": "i",
            "s": "t",
            "ts": ts,
            "tid": _COMPUTE_TID,
            "args": {"unit": unit, "bytes": nbytes, "total_bytes": total, "step": _step},
        }
    )
    _append({"name": "unsharded_bytes", "ph": "C", "ts": ts, "args": {"bytes": total}})


def _on_collective(event: str, info: _collective_hooks.CollectiveInfo) -> None:
    now = _now_us()
    if event == "issue":
        _issued[info.seq] = now
    elif event == "complete":
        start = _issued.pop(info.seq, now)
        _append(
            {
                "name": f"{info.kind} {info.label}",
                "cat": info.kind,
                "ph": "X",
                "ts": start,
                "dur": now - start,
                "tid": _COMM_TIDS[info.kind],
                "args": {
                    "unit": info.label,
                    "bytes": info.input_bytes,
                    "group_size": info.group_size,
                    "dtype": str(info.dtype),
                    "step": _step,
                },
            }
        )
    elif event == "wait_begin":
        _wait_started[info.seq] = now
    elif event == "wait_end":
        start = _wait_started.pop(info.seq, now)
        with _lock:
            _exposed[_step] += now - start
        _append(
            {
                "name": f"wait {info.kind} {info.label}",
                "cat": "wait",
                "ph": "X",
                "ts": start,
                "dur": now - start,
                "tid": _COMPUTE_TID,
                "args": {"unit": info.label, "kind": info.kind, "step": _step},
            }
        )


# ---------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def to_chrome_trace(rank: int | None = None) -> dict[str, Any]:
    """This process's events as a Chrome-trace object (``{"traceEvents": [...]}``)."""
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
    for event in events():
        event["pid"] = rank
        event.setdefault("tid", _COMPUTE_TID)
        trace_events.append(event)
    return {"traceEvents": trace_events, "displayTimeUnit": "ms"}


def export_chrome_trace(path: str | os.PathLike[str], rank: int | None = None) -> None:
    """Writes this process's timeline as Chrome-trace JSON (opens in Perfetto)."""
    with open(path, "w") as f:
        json.dump(to_chrome_trace(rank), f)


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
