"""Checks of a unit's use at run time, beyond FSDP2's (its ``on_unit`` events).

FSDP2 silently loses an in-place change made to unsharded parameters (resharding
frees them), and runs a backward whose parameters an optimizer step changed after
the forward (old activations, new parameters); these warn and refuse instead.
"""

from __future__ import annotations

import warnings

from .._runtime import Unit, UnitEvent

__all__ = ["check_use"]

# On a unit (hot path: an attribute, not a weak mapping): its flat buffer's version
# after the last copy-out, and its shards' versions when its forward ran.
_GATHERED = "_fsdp_compose_gathered_version"
_FORWARD = "_fsdp_compose_forward_versions"


def check_use(event: UnitEvent, unit: Unit) -> None:
    """Records or checks ``unit``'s parameter versions at ``event``."""
    if event == "gathered" and unit.buffer is not None and unit.buffer.unsharded is not None:
        setattr(unit, _GATHERED, unit.buffer.unsharded._version)
    elif event == "resharding":
        _check_unchanged_while_unsharded(unit)
    elif event == "forward_begin":
        setattr(unit, _FORWARD, [p.data_version() for p in unit.params])
    elif event == "backward_begin":
        _check_unchanged_since_forward(unit)


def _check_unchanged_while_unsharded(unit: Unit) -> None:
    flat = unit.buffer.unsharded if unit.buffer is not None else None
    if flat is not None and flat._version != getattr(unit, _GATHERED, 0):
        warnings.warn(
            f"fsdp_compose: parameters of unit {unit.name!r} were modified in place while "
            "unsharded (e.g. under torch.no_grad() in forward); resharding discards the change. "
            "Modify them outside forward/backward, where they are the sharded DTensors.",
            stacklevel=7,
        )


def _check_unchanged_since_forward(unit: Unit) -> None:
    versions = getattr(unit, _FORWARD, None)
    if versions is not None and any(p.data_version() != v for p, v in zip(unit.params, versions)):
        raise RuntimeError(
            f"fsdp_compose: backward reached unit {unit.name!r}, but its parameters were modified "
            "(e.g. by optimizer.step()) after the forward that built this graph (old activations, "
            "new parameters). Run a forward before each backward; step after all backwards."
        )
