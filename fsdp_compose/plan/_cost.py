"""The planner's step-time model: compute, collectives, offload copies, the host step.

[Note: the planner's cost model]
Step time = compute + exposed communication + the host optimizer step, per rank:

* compute of a unit = its forward + backward FLOPs (measured on the meta device
  by ``torch.utils.flop_counter``, attention's QK^T and AV included) /
  ``flop_rate``; forward is a third of it,
  backward two thirds, and activation checkpointing adds the forward again to
  backward;
* a collective takes ``latency + bytes sent / bandwidth`` (the ideal per-rank
  bytes of ``_estimate.py``) and collectives run one at a time;
* with ``CPUOffloadPolicy`` on a GPU (for every unit, or the units a plan
  offloads), an offloaded unit's gather first copies its shards
  from the host (``bytes / host_bandwidth``, the shards in their own dtype, again
  in backward when the unit was resharded) and its reduction ends by copying the
  reduced gradient shards back, on the same channel as the collective they feed
  or follow (fsdp_compose issues them in that order); the optimizer then steps
  on the host over the offloaded state (parameters, gradients, optimizer states:
  ``host bytes / host_optimizer_rate``), after backward and before the next
  forward, overlapping nothing;
* overlap follows fsdp_compose's scheduler: with prefetch depth ``d`` a unit's
  all-gather is issued when the unit ``d`` places earlier (in forward, or in
  backward's reverse order) starts computing (``d = 0``: when it is needed);
  a unit's compute starts when its parameters have arrived; its reduce-scatter
  is issued when its backward ends and backward ends when the last one is done;
* ``overlap`` is the fraction of a collective's time that can pass while the
  rank computes: 1 where communication has an engine of its own (NCCL beside
  compute on a GPU); near 0 where it takes the cores compute uses (gloo on a
  CPU whose cores the ranks already fill: its copies and checksums are CPU work,
  and prefetching then hides nothing). The schedule above is simulated with
  full overlap, and ``(1 - overlap)`` of the communication it hid behind compute
  is added back.

With ``M`` micro-batches per optimizer step (``grad_accum``), the step is ``M``
micro-batches: the last one as above (gradient sync on), and ``M - 1`` without
sync, each with the same compute and all-gathers, in which a unit accumulating
unsharded reduces nothing and a unit accumulating sharded reduce-scatters
(``latency + (W-1)/W N r / bandwidth``, no replica all-reduce: that waits for
the last micro-batch), issued when its backward ends like the last one's
([Note: choosing the accumulation mode] in ``_accumulation.py``). The host
optimizer step runs once per step; the offload copies before each gather run in
every micro-batch, those of reduced gradients only in the last: an offloaded
unit accumulating sharded keeps its fp32 sum on the device, so its reduce-scatters
without sync end with no copy to the host.

Every offload term only adds time to a schedule whose other durations are those
of the same plan without offload, and the schedule's end never decreases when a
duration grows: a plan that offloads is never predicted faster than the same
plan without offload on the same world size.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from ._estimate import MemoryEstimate, UnitEstimate

__all__ = ["CostModel", "StepCost", "step_cost", "step_time"]


@dataclass(frozen=True)
class CostModel:
    """Rates the planner's step-time model uses (see ``[Note: the planner's cost model]``).

    Args:
        flop_rate: sustained FLOP/s of one rank's training compute.
        bandwidth: bytes/s one rank sends in a collective.
        latency: seconds of fixed cost per collective.
        overlap: the fraction of a collective's time that can pass while the
            rank computes, from 0 (communication competes with compute for the
            same cores, as gloo on a CPU the ranks already fill) to 1 (a
            separate engine, as NCCL on a GPU).
        host_bandwidth: bytes/s of one rank's copies between host and device
            (each direction; PCIe with pinned host memory), used with offload.
        host_optimizer_rate: bytes of offloaded state (parameters, gradients,
            optimizer states) one rank's optimizer step on the host goes through
            per second, used with offload.
        source: where the rates come from, printed with the plan (``"given"``,
            ``"measured ..."``; :meth:`for_device` names its defaults).
    """

    flop_rate: float = 400e12
    bandwidth: float = 25e9
    latency: float = 20e-6
    overlap: float = 1.0
    host_bandwidth: float = 25e9
    host_optimizer_rate: float = 10e9
    source: str = field(default="given", compare=False)

    @classmethod
    def for_device(cls, device: str) -> CostModel:
        """The default rates for ``device``: ``"cuda"``, a datacenter GPU with NCCL
        (400 TFLOP/s of bf16 training compute, 25 GB/s per rank, communication
        fully overlapped; with offload, 25 GB/s of host-device copies and a host
        optimizer step through 10 GB/s of state); ``"cpu"``, a CPU rank with gloo
        (100 GFLOP/s, 2 GB/s, no overlap: gloo's copies take the cores compute
        uses). Rough orders of magnitude: pass a measured :class:`CostModel` for
        step times to trust."""
        if device == "cpu":
            return cls(100e9, 2e9, 100e-6, 0.0, source="default for device=cpu (gloo)")
        return cls(source=f"default for device={device} (a datacenter GPU with NCCL)")

    def describe(self, offload: bool = False) -> str:
        """One line: the rates (the host's too when ``offload``) and their source."""
        line = (
            f"cost model ({self.source}): {self.flop_rate / 1e12:g} TFLOP/s, "
            f"{self.bandwidth / 1e9:g} GB/s, latency {self.latency * 1e6:g} us, "
            f"overlap {self.overlap:g}"
        )
        if offload:
            line += (
                f"; host-device copies {self.host_bandwidth / 1e9:g} GB/s, host optimizer "
                f"step {self.host_optimizer_rate / 1e9:g} GB/s of state"
            )
        return line

    def to_dict(self) -> dict[str, Any]:
        """The rates and their source, for JSON."""
        return {
            "flop_rate": self.flop_rate,
            "bandwidth": self.bandwidth,
            "latency": self.latency,
            "overlap": self.overlap,
            "host_bandwidth": self.host_bandwidth,
            "host_optimizer_rate": self.host_optimizer_rate,
            "source": self.source,
        }

    def __post_init__(self) -> None:
        for name in ("flop_rate", "bandwidth", "host_bandwidth", "host_optimizer_rate"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v > 0 or math.isinf(v):
                raise ValueError(f"CostModel.{name} must be a positive number, got {v!r}")
        if not self.latency >= 0:
            raise ValueError(f"CostModel.latency must be >= 0, got {self.latency!r}")
        if not isinstance(self.overlap, (int, float)) or not 0 <= self.overlap <= 1:
            raise ValueError(f"CostModel.overlap must be in [0, 1], got {self.overlap!r}")


@dataclass(frozen=True)
class StepCost:
    """The predicted step time of one plan and its parts (seconds, bytes per rank).

    ``step_s = compute_s + exposed_comm_s + host_optimizer_s``; the offload terms
    are 0 without offload.

    Attributes:
        step_s: the whole step.
        compute_s: forward and backward compute (recompute included).
        exposed_comm_s: the time collectives and host-device copies add to compute.
        host_to_device_bytes: shards copied to the device per step (offload).
        device_to_host_bytes: gradient shards copied to the host per step (offload).
        host_copy_s: the copies' time at ``host_bandwidth`` (exposed or not).
        host_optimizer_s: the optimizer step on the host (offload).
    """

    step_s: float
    compute_s: float
    exposed_comm_s: float
    host_to_device_bytes: int = 0
    device_to_host_bytes: int = 0
    host_copy_s: float = 0.0
    host_optimizer_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _offload_copies(u: UnitEstimate) -> tuple[int, int, int]:
    """(host-to-device bytes in forward, in backward, device-to-host bytes) of ``u``
    per step: its shards before each gather from them (backward's too when the
    unit was resharded; an int reshard gathers from the copy it kept on the
    device), its gradient shards (trainable parameters) after its reduction."""
    backward = u.sharded_bytes if u.reshard_after_forward is True else 0
    grads = u.grad_bytes
    return u.sharded_bytes, backward, grads


def step_cost(
    est: MemoryEstimate,
    cost: CostModel,
    depth: int,
    grad_accum: int = 1,
    sharded: Collection[str] = (),
) -> StepCost:
    """The step time of ``est`` under ``cost``, in parts, over ``grad_accum``
    micro-batches of which the units named in ``sharded`` accumulate sharded
    (``[Note: the planner's cost model]``)."""
    units = list(est.units)
    fwd = {u.name: u.flops / 3 / cost.flop_rate for u in units}
    bwd = {
        u.name: u.flops * (2 / 3 + (1 / 3 if u.checkpoint else 0)) / cost.flop_rate for u in units
    }
    offload = bool(est.config.get("offload"))
    copies = {u.name: _offload_copies(u) if u.offload else (0, 0, 0) for u in units}

    def comm(nbytes: float, copied: int = 0) -> float:
        collective = cost.latency + nbytes / cost.bandwidth if nbytes else 0.0
        return collective + copied / cost.host_bandwidth

    gather_fwd = {
        u.name: comm(u.all_gather_bytes - u.backward_gather_bytes, copies[u.name][0]) for u in units
    }
    gather_bwd = {u.name: comm(u.backward_gather_bytes, copies[u.name][1]) for u in units}
    reduce = {u.name: comm(u.reduce_bytes, copies[u.name][2]) for u in units}

    def micro_batch(reductions: dict[str, float]) -> tuple[float, float]:
        """(end, compute seconds) of one micro-batch with these reductions."""
        comm_total = sum(gather_fwd.values()) + sum(gather_bwd.values())
        comm_total += sum(reductions.values())
        end, compute = _schedule(units, fwd, bwd, gather_fwd, gather_bwd, reductions, depth)
        hidden = max(0.0, comm_total - (end - compute))
        # what the hidden part still takes from compute
        return end + (1 - cost.overlap) * hidden, compute

    end, compute = micro_batch(reduce)
    if grad_accum > 1:  # the micro-batches without sync: only sharded units reduce-scatter
        shards = est.config["mesh_shape"][-1]
        scatter = {
            u.name: comm((shards - 1) * u.grad_reduce_bytes) if u.name in sharded else 0.0
            for u in units
        }
        more_end, more_compute = micro_batch(scatter)
        end += (grad_accum - 1) * more_end
        compute += (grad_accum - 1) * more_compute
    h2d = grad_accum * sum(c[0] + c[1] for c in copies.values())
    d2h = sum(c[2] for c in copies.values())
    host_step = est.host_bytes_per_rank / cost.host_optimizer_rate if offload else 0.0
    return StepCost(
        step_s=end + host_step,
        compute_s=compute,
        exposed_comm_s=end - compute,
        host_to_device_bytes=h2d,
        device_to_host_bytes=d2h,
        host_copy_s=(h2d + d2h) / cost.host_bandwidth,
        host_optimizer_s=host_step,
    )


def _schedule(
    units: list[UnitEstimate],
    fwd: dict[str, float],
    bwd: dict[str, float],
    gather_fwd: dict[str, float],
    gather_bwd: dict[str, float],
    reduce: dict[str, float],
    depth: int,
) -> tuple[float, float]:
    """(end of backward's last reduction, compute seconds) of forward then backward
    with one communication channel, communication fully overlapped."""
    channel = 0.0  # when the (single) communication channel is next free
    t = 0.0
    compute = 0.0
    root, blocks = units[0], units[1:]
    for order, gathers, times, backward in (
        ([root, *blocks], gather_fwd, fwd, False),
        ([*reversed(blocks), root], gather_bwd, bwd, True),
    ):
        arrive: dict[str, float] = {}
        for i, u in enumerate(order):
            # issue gathers up to `depth` ahead when unit i starts (and its own if not yet issued)
            for v in order[i : i + depth + 1]:
                if v.name not in arrive:
                    channel = max(channel, t) + gathers[v.name]
                    arrive[v.name] = channel
            t = max(t, arrive[u.name]) + times[u.name]
            compute += times[u.name]
            if backward:
                channel = max(channel, t) + reduce[u.name]
    return max(t, channel), compute


def step_time(est: MemoryEstimate, cost: CostModel, depth: int) -> tuple[float, float]:
    """(step seconds, exposed communication seconds) of ``est`` under ``cost``."""
    c = step_cost(est, cost, depth)
    return c.step_s, c.exposed_comm_s
