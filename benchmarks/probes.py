"""Instrumentation used only in the extra (untimed) steps of a job.

The timed steps run with nothing attached. Afterwards a few more steps run under a
probe that records what the implementation itself says about its communication:

* ``fsdp_compose``: its timeline (``fsdp_compose.trace``, which measures the time
  the training thread waited on collectives and sees the kind and size of every
  collective), an observer of the model (``FSDPModule.register_observer``).
* ``fsdp2``: torch FSDP2 issues its collectives through ``dist.all_gather_single``,
  ``dist.reduce_scatter_single`` and ``dist.all_reduce``; the probe wraps those
  module attributes to record sizes (and restores them afterwards).
* ``single`` / ``ddp``: nothing (DDP's reducer calls the process group from C++).

Sizes are turned into the bytes an ideal algorithm sends per rank (see
:func:`ideal_bytes_sent`), which is what the loopback counters are checked against.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


def ideal_bytes_sent(kind: str, group_size: int, input_bytes: int, output_bytes: int) -> float:
    """Bytes one rank must send for a collective with a bandwidth-optimal algorithm.

    all-gather: its shard to W-1 ranks, (W-1)/W of the output; reduce-scatter (and
    fsdp_compose's all-to-all form of it): (W-1)/W of the input; all-reduce (ring):
    2 (W-1)/W of the tensor.
    """
    frac = (group_size - 1) / group_size
    if kind == "all_gather":
        return frac * output_bytes
    if kind == "reduce_scatter":
        return frac * input_bytes
    if kind == "all_reduce":
        return 2 * frac * input_bytes
    raise ValueError(kind)


@dataclass
class Probe:
    """What the implementation reported during the instrumented steps."""

    collectives: list[dict[str, Any]] = field(default_factory=list)
    exposed_by_step: list[float] | None = None  # fsdp_compose's own measure

    def record(self, kind: str, group_size: int, input_bytes: int, output_bytes: int) -> None:
        self.collectives.append(
            {"kind": kind, "group_size": group_size, "input_bytes": input_bytes,
             "output_bytes": output_bytes}
        )

    def summary(self, steps: int) -> dict[str, Any]:
        """Per-step collective counts, payload and ideal bytes sent (this rank)."""
        kinds: dict[str, dict[str, float]] = {}
        for c in self.collectives:
            k = kinds.setdefault(c["kind"], {"count": 0, "input_bytes": 0, "output_bytes": 0})
            k["count"] += 1 / steps
            k["input_bytes"] += c["input_bytes"] / steps
            k["output_bytes"] += c["output_bytes"] / steps
        ideal = sum(
            ideal_bytes_sent(c["kind"], c["group_size"], c["input_bytes"], c["output_bytes"])
            for c in self.collectives
        )
        return {
            "collectives_per_step": kinds if self.collectives else None,
            "ideal_bytes_sent_per_step": ideal / steps if self.collectives else None,
            "trace_exposed_by_step": self.exposed_by_step,
        }


@contextlib.contextmanager
def probe(impl: str, model: Any = None) -> Iterator[Probe]:
    """Attaches ``impl``'s probe (for fsdp_compose: to ``model``, the root) for the
    duration of the ``with`` block."""
    result = Probe()
    if impl == "fsdp_compose":
        with _fsdp_compose_probe(result, model):
            yield result
    elif impl == "fsdp2":
        with _fsdp2_probe(result):
            yield result
    else:
        yield result


@contextlib.contextmanager
def _fsdp_compose_probe(result: Probe, model: Any) -> Iterator[None]:
    from fsdp_compose import Observer, trace

    class _Sizes(Observer):
        def on_collective(self, event: Any, info: Any) -> None:
            if event == "issue":
                result.record(info.kind, info.group_size, info.input_bytes, info.output_bytes)

    sizes, timeline = _Sizes(), trace.Timeline()
    model.register_observer(sizes)
    try:
        with trace.recording(model, timeline=timeline):
            yield
    finally:
        model.unregister_observer(sizes)
    result.exposed_by_step = list(timeline.exposed_communication().values())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def torch_collective_name(kind: str) -> str:
    """The ``torch.distributed`` function FSDP2 calls for ``kind`` in this torch
    (``*_single`` since 2.10; the older names now forward to them)."""
    new, old = {
        "all_gather": ("all_gather_single", "all_gather_into_tensor"),
        "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
    }[kind]
    return new if hasattr(dist, new) else old


@contextlib.contextmanager
def _fsdp2_probe(result: Probe) -> Iterator[None]:
    originals: dict[str, Callable[..., Any]] = {}

    def wrap(kind: str, name: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            output = kwargs["output"] if "output" in kwargs else args[0]
            input = kwargs["input"] if "input" in kwargs else args[1]
            if kind == "all_gather" and "output_tensor" in kwargs:
                output, input = kwargs["output_tensor"], kwargs["input_tensor"]
            group_pos = 2 if kind == "all_gather" else 3  # (output, input[, op], group, ...)
            group = kwargs.get("group", args[group_pos] if len(args) > group_pos else None)
            result.record(kind, dist.get_world_size(group), _nbytes(input), _nbytes(output))
            return originals[name](*args, **kwargs)

        return wrapper

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group")
        result.record("all_reduce", dist.get_world_size(group), _nbytes(tensor), _nbytes(tensor))
        return originals["all_reduce"](tensor, *args, **kwargs)

    wrappers = {name: wrap(kind, name) for kind in ("all_gather", "reduce_scatter")
                for name in [torch_collective_name(kind)]}
    wrappers["all_reduce"] = all_reduce
    for name, wrapper in wrappers.items():
        originals[name] = getattr(dist, name)
        setattr(dist, name, wrapper)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
