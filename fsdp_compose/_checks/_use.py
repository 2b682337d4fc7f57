"""Checks of a unit's use at run time, beyond FSDP2's (its ``on_unit`` events).

FSDP2 silently loses an in-place change made to unsharded parameters (resharding
frees them), and runs a backward whose parameters an optimizer step changed after
the forward (old activations, new parameters); these warn and refuse instead.
"""

from __future__ import annotations

import warnings

from .._runtime import UnitEvent, UnitInfo

__all__ = ["UseChecks"]


class UseChecks:
    """Records each unit's data versions at the events that carry them and compares
    them later; its state is keyed by :attr:`UnitInfo.id` (plain numbers: it keeps no
    unit or model alive)."""

    #: The unit events :meth:`check` reads.
    events: frozenset[UnitEvent] = frozenset(
        {"gathered", "resharding", "forward_begin", "backward_begin"}
    )

    def __init__(self) -> None:
        # Per unit: its unsharded storage's version after the last gather (dropped at
        # the reshard that frees it), its shards' versions when its last forward began.
        self._gathered: dict[int, int] = {}
        self._forward: dict[int, tuple[int, ...]] = {}

    def check(self, event: UnitEvent, info: UnitInfo) -> None:
        """Records or checks ``info``'s parameter versions at ``event``."""
        if event == "gathered" and info.unsharded_version is not None:
            self._gathered[info.id] = info.unsharded_version
        elif event == "resharding":
            self._check_unchanged_while_unsharded(info)
        elif event == "forward_begin" and info.sharded_versions is not None:
            self._forward[info.id] = info.sharded_versions
        elif event == "backward_begin":
            self._check_unchanged_since_forward(info)

    def _check_unchanged_while_unsharded(self, info: UnitInfo) -> None:
        gathered = self._gathered.pop(info.id, 0)
        if info.unsharded_version is not None and info.unsharded_version != gathered:
            warnings.warn(
                f"fsdp_compose: parameters of unit {info.name!r} were modified in place while "
                "unsharded (e.g. under torch.no_grad() in forward); resharding discards the "
                "change. Modify them outside forward/backward, where they are the sharded "
                "DTensors.",
                stacklevel=7,
            )

    def _check_unchanged_since_forward(self, info: UnitInfo) -> None:
        versions = self._forward.get(info.id)
        if versions is not None and versions != info.sharded_versions:
            raise RuntimeError(
                f"fsdp_compose: backward reached unit {info.name!r}, but its parameters were "
                "modified (e.g. by optimizer.step()) after the forward that built this graph "
                "(old activations, new parameters). Run a forward before each backward; step "
                "after all backwards."
            )
