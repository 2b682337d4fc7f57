"""Gradient accumulation per unit: unsharded or sharded, from memory and bandwidth.

[Note: choosing the accumulation mode]
With ``M`` micro-batches per step and gradient sync disabled for the first
``M - 1``, a unit accumulates its gradients in one of two ways
(``FSDPModule.set_gradient_accumulation``). Per rank, with ``N`` the unit's
padded trainable elements, ``W`` the shard size, ``R`` the replicate size and
``r`` the reduce dtype's bytes (also the accumulation dtype's):

* **unsharded** (FSDP2's): holds the unsharded gradients between micro-batches,
  ``N r`` bytes whatever ``W``; one reduce-scatter per step, ``(W-1)/W N r``
  bytes sent (HSDP: plus ``2 (R-1)/R N/W r``);
* **sharded**: reduce-scatters every micro-batch and keeps an fp32 shard sum,
  ``N/W max(4, r)`` bytes; ``M`` reduce-scatters per step, ``M (W-1)/W N r``
  bytes sent (HSDP: the replica all-reduce still once, of the fp32 sum,
  ``2 (R-1)/R N/W max(4, r)``).

All-gathers are the same in both modes. The held bytes live through the next
micro-batch's forward and backward, so they add to the plan's peak. A unit is
sharded when its extra reduce-scatters hide under compute (the cost model
overlaps communication fully and one reduce-scatter takes no longer than the
backward compute of the unit that runs after it in backward), or when the
plan does not fit with unsharded accumulation: then the units that save the
most memory by sharding go first. Otherwise it stays unsharded: fewer bytes
sent. Mixed reduce dtypes in one unit are counted as ``max(4 N/W, r N/W)``.
A CPU-offloaded unit holds both kinds on the device too, so held bytes are
device bytes for every unit: its unsharded gradients are those of the unsharded
(device) parameters, and the runtime keeps the sharded fp32 sum from the
reduce-scatter's output on the device (``GradientReducer.partial_reduce``),
moving a gradient to the host only at the synchronizing hand-over. So neither
mode copies between host and device in the micro-batches without sync: the
reduced gradient shards cross once per step (in the reduce dtype cast to the
gradient's, as without accumulation), and the host holds the same offloaded
state as with one micro-batch. Sharded accumulation is therefore not free on the
device for an offloaded unit: an offloaded unit chooses as it would on the
device, only with more free device memory (offloading moves its parameters,
gradients and optimizer states, not its accumulator), which can let units that
had to be sharded stay unsharded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._cost import CostModel
from ._estimate import MemoryEstimate, UnitEstimate
from ._units import format_bytes

__all__ = ["UnitAccumulation", "choose_accumulation"]


@dataclass(frozen=True)
class UnitAccumulation:
    """One unit's accumulation costs in both modes and the chosen one (per rank).

    Attributes:
        name: the unit.
        held_unsharded, held_sharded: bytes held between micro-batches.
        sent_unsharded, sent_sharded: gradient bytes sent per step.
        reduce_scatters: reduce-scatters per step in (unsharded, sharded) mode.
        mode: ``"unsharded"`` or ``"sharded"``.
        reason: why, from the numbers above.
    """

    name: str
    held_unsharded: int
    held_sharded: int
    sent_unsharded: int
    sent_sharded: int
    reduce_scatters: tuple[int, int]
    mode: str
    reason: str

    @property
    def held(self) -> int:
        return self.held_sharded if self.mode == "sharded" else self.held_unsharded

    @property
    def sent(self) -> int:
        return self.sent_sharded if self.mode == "sharded" else self.sent_unsharded

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "reduce_scatters": list(self.reduce_scatters)}


def unit_costs(u: UnitEstimate, shard: int, replicate: int, m: int) -> tuple[int, int, int, int]:
    """(held unsharded, held sharded, sent unsharded, sent sharded) of ``u`` per
    rank ([Note: choosing the accumulation mode])."""
    row = u.grad_reduce_bytes  # N / W * r
    fp32_row = max(4 * u.grad_numel, row)  # N / W * max(4, r)
    scatter = (shard - 1) * row  # (W-1)/W * N * r
    replica = 2 * (replicate - 1) / replicate
    return (
        shard * row,
        fp32_row,
        round(scatter + replica * row),
        round(m * scatter + replica * fp32_row),
    )


def choose_accumulation(
    est: MemoryEstimate, cost: CostModel, m: int, free: int
) -> tuple[UnitAccumulation, ...]:
    """Each unit's accumulation mode for ``m`` micro-batches per step, ``free`` the
    device bytes per rank the plan leaves under its cap ([Note: choosing the
    accumulation mode])."""
    shape = est.config["mesh_shape"]
    replicate, shard = (1, shape[0]) if len(shape) == 1 else (shape[0], shape[1])
    units = list(est.units)
    backward = [*reversed(units[1:]), units[0]]
    after = {
        u.name: backward[i + 1] if i + 1 < len(backward) else None for i, u in enumerate(backward)
    }
    costs = {u.name: unit_costs(u, shard, replicate, m) for u in units}
    modes: dict[str, tuple[str, str]] = {}
    for u in units:
        hu, hs, su, ss = costs[u.name]
        nxt = after[u.name]
        rs = cost.latency + (shard - 1) * u.grad_reduce_bytes / cost.bandwidth
        cover = 0.0 if nxt is None else nxt.flops * 2 / 3 / cost.flop_rate
        if cost.overlap >= 1 and rs <= cover and u.grad_numel and shard > 1:
            modes[u.name] = (
                "sharded",
                f"its extra reduce-scatters hide under compute ({rs * 1e3:.2f} ms each, "
                f"under {cover * 1e3:.2f} ms of backward); holds {format_bytes(hs)}, "
                f"not {format_bytes(hu)}",
            )
        else:
            why = (
                "communication does not overlap compute"
                if cost.overlap < 1
                else f"a reduce-scatter ({rs * 1e3:.2f} ms) would not hide under "
                f"{cover * 1e3:.2f} ms of backward"
            )
            modes[u.name] = (
                "unsharded",
                f"fewer bytes sent ({format_bytes(su)}, not {format_bytes(ss)}); {why}",
            )
    held = sum(costs[n][0 if mo == "unsharded" else 1] for n, (mo, _) in modes.items())
    over = held - free
    saving = sorted(
        (n for n, (mo, _) in modes.items() if mo == "unsharded"),
        key=lambda n: costs[n][1] - costs[n][0],
    )
    for name in saving:
        if over <= 0:
            break
        hu, hs = costs[name][:2]
        if hu <= hs:
            continue
        modes[name] = (
            "sharded",
            f"unsharded accumulation does not fit: it would hold {format_bytes(hu)}, not "
            f"{format_bytes(hs)}, with the plan {format_bytes(over)} over its budget",
        )
        over -= hu - hs
    return tuple(UnitAccumulation(u.name, *costs[u.name], (1, m), *modes[u.name]) for u in units)
