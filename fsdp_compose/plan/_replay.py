"""Replays the profile's allocation trace with fsdp_compose's buffers: the
activation, unsharded and communication terms of the memory estimate.

[Note: replaying the trace]
The profile's allocation trace ([Note: the allocation trace] in ``_profile.py``)
lists every storage the step allocates and frees, on the meta device, in order:
activations, temporaries, the loss and its gradient, parameter gradients. The
replay adds what fsdp_compose allocates around them: a unit's all-gather buffer
from its pre-forward (or a prefetch ``depth`` units ahead) until it reshards,
its gradients (the trace's ``g`` storages) until its post-backward packs them
into the reduce-scatter buffers, and one reduce-scatter in flight while the
next unit packs. With activation checkpointing a unit's saved tensors leave at
its post-forward (its output stays) and come back when its backward recomputes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ._profile import ModelProfile

__all__ = ["UnitBuffers", "simulate"]


class UnitBuffers(Protocol):
    """What the replay needs of one unit (``_estimate._Unit``)."""

    name: str
    fqns: list[str]
    checkpoint: bool
    unsharded: int
    rs_buffers: int

    def kept_after_forward(self) -> int: ...


def simulate(
    units: Sequence[UnitBuffers], profile: ModelProfile, depth: int
) -> tuple[int, str, dict[str, int]]:
    """Replays the step's allocation trace with the units' buffers; returns (peak of
    the transient terms, where, terms at the peak)."""
    replay = _Replay(units, depth)
    replay.gather_forward(units[0], 0)
    for event in profile.events:
        replay.apply(event)
    replay.finish_backward(None)
    replay.finish(units[0])
    return replay.best


class _Replay:
    """Running totals of one replay (see [Note: replaying the trace])."""

    def __init__(self, units: Sequence[UnitBuffers], depth: int) -> None:
        self.units, self.depth = units, depth
        self.unit_of = {fqn: u for u in units for fqn in u.fqns}
        self.forward = units[1:]
        self.index = {id(u): i for i, u in enumerate(self.forward)}
        self.next_key = 0  # the trace numbers its storages in allocation order
        self.held: dict[str, int] = {}  # unit name -> unsharded bytes it holds
        self.held_bytes = 0  # their sum (kept as it changes: the replay marks every event)
        self.live: dict[int, int] = {}  # trace storage -> bytes
        self.live_bytes = 0  # their sum
        self.grads: dict[str, set[int]] = {}  # unit name -> its live gradient storages
        self.grad_units: dict[int, list[str]] = {}  # the reverse: storage -> unit names
        self.grad_bytes = 0
        self.pending = 0  # the reduce-scatter in flight
        self.stash: dict[str, dict[int, int]] = {}  # checkpointed unit -> saved tensors
        self.begun: dict[str, int] = {}  # unit name -> trace position of its pre-forward
        self.backward: UnitBuffers | None = None  # the unit whose backward runs
        self.where = "forward, start"
        self.best: tuple[int, str, dict[str, int]] = (-1, "", {})
        self.mark()

    def mark(self, extra_comm: int = 0) -> None:
        total = self.held_bytes + self.live_bytes + self.pending + extra_comm
        if total > self.best[0]:  # the terms only when needed: this runs at every event
            terms = {
                "unsharded": self.held_bytes + self.grad_bytes,
                "activations": self.live_bytes - self.grad_bytes,
                "comm_buffers": self.pending + extra_comm,
            }
            self.best = (total, self.where, terms)

    def hold(self, name: str, nbytes: int) -> None:
        """Sets what unit ``name`` holds unsharded."""
        self.held_bytes += nbytes - self.held.get(name, 0)
        self.held[name] = nbytes

    def gather_forward(self, u: UnitBuffers, index: int) -> None:
        self.hold(u.name, u.unsharded)
        for nxt in self.forward[index : index + self.depth]:
            self.hold(nxt.name, nxt.unsharded)

    def apply(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == "a":
            self.live[event[1]] = event[2]
            self.live_bytes += event[2]
            self.next_key = event[1] + 1
            self.mark()
        elif kind == "f":
            self._free(event[1])
        elif kind == "g":
            u = self.unit_of.get(event[1], self.units[0])
            if event[2] is not None and event[2] not in self.grads.setdefault(u.name, set()):
                self.grads[u.name].add(event[2])
                self.grad_units.setdefault(event[2], []).append(u.name)
                self.grad_bytes += self.live.get(event[2], 0)
        elif kind == "loss":
            self.where = "backward, loss"
        elif event[1] in self.unit_of:
            u = self.unit_of[event[1]]
            {"fp": self._pre_forward, "fo": self._post_forward, "bs": self._pre_backward}[kind](u)

    def _free(self, key: int) -> None:
        nbytes = self.live.pop(key, 0)
        self.live_bytes -= nbytes
        for name in self.grad_units.pop(key, ()):
            self.grads[name].discard(key)
            self.grad_bytes -= nbytes

    def _pre_forward(self, u: UnitBuffers) -> None:
        self.where = f"forward {u.name}"
        self.begun[u.name] = self.next_key
        if id(u) in self.index:
            self.gather_forward(u, self.index[id(u)] + 1)
        self.mark()

    def _post_forward(self, u: UnitBuffers) -> None:
        self.hold(u.name, u.kept_after_forward())
        if u.checkpoint:  # keep only the output (the unit's newest live storage)
            mine = sorted(k for k in self.live if k >= self.begun.get(u.name, 0))
            self.stash[u.name] = {k: self.live.pop(k) for k in mine[:-1]}
            self.live_bytes -= sum(self.stash[u.name].values())

    def _pre_backward(self, u: UnitBuffers) -> None:
        self.finish_backward(u)
        self.where = f"backward {u.name}"
        self.hold(u.name, u.unsharded)
        if id(u) in self.index:  # prefetch the units whose backward comes next
            i = self.index[id(u)]
            for prev in reversed(self.forward[max(0, i - self.depth) : i]):
                self.hold(prev.name, max(self.held.get(prev.name, 0), prev.unsharded))
        recomputed = self.stash.pop(u.name, {})
        self.live.update(recomputed)
        self.live_bytes += sum(recomputed.values())
        self.mark()

    def finish_backward(self, nxt: UnitBuffers | None) -> None:
        """Ends the running unit's backward (``nxt``'s begins); the root's ends last."""
        done, self.backward = self.backward, nxt
        if done is not None and done is not nxt and done is not self.units[0]:
            self.finish(done)

    def finish(self, u: UnitBuffers) -> None:
        """``u``'s post-backward: reshard, pack its gradients for the reduction."""
        self.hold(u.name, 0)
        self.where = f"reduce {u.name}"
        self.mark(extra_comm=u.rs_buffers)
        for key in list(self.grads.get(u.name, ())):
            self._free(key)
        self.pending = u.rs_buffers
