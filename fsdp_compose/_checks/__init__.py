"""The checks fsdp_compose adds to FSDP2's, as one subscriber of the runtime's events.

[Note: checks beyond FSDP2]
The runtime (``fsdp_compose._runtime``) does what FSDP2 does, FSDP2's own validations
included. What fsdp_compose refuses or warns about beyond them (bad arguments, ranks
that built different models, in-place changes FSDP2 silently loses) is
:data:`CHECKS`, an :class:`~fsdp_compose.Observer` that the public
:func:`fsdp_compose.fully_shard` passes to every call (:func:`observers`; with
``FSDP_COMPOSE_DEBUG_COLLECTIVES=1``, ``fsdp_compose.debug``'s collective checks too):
it sees each call before the call changes anything (``on_annotate``), each root's
units at its lazy init (``on_root_init``), and each unit's events. Like any observer it
gets values (``UnitInfo``), and keeps what it records itself, keyed by unit id, so one
object serves every tree. A test or a tool that wants FSDP2's behaviour alone calls the
runtime's ``fully_shard`` without it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from .. import _env
from .._runtime import Annotation, Observer, UnitEvent, UnitInfo
from ._arguments import check_annotation
from ._ranks import check_same_inputs, check_same_structure
from ._use import UseChecks

__all__ = ["CHECKS", "Checks", "observers"]


class Checks(Observer):
    """fsdp_compose's checks beyond FSDP2's; see [Note: checks beyond FSDP2]."""

    unit_events = UseChecks.events | {"packed"}

    def __init__(self) -> None:
        self._use = UseChecks()
        self._inputs_checked: set[int] = set()  # extension units compared at a first pack

    def on_annotate(self, call: Annotation) -> None:
        check_annotation(call)

    def on_root_init(self, units: Sequence[UnitInfo]) -> None:
        check_same_structure(units)

    def on_unit(self, event: UnitEvent, info: UnitInfo) -> None:
        if event == "packed":
            if info.id not in self._inputs_checked:
                self._inputs_checked.add(info.id)
                check_same_inputs(info)
        else:
            self._use.check(event, info)


CHECKS = Checks()


def observers() -> tuple[Observer, ...]:
    """What the public ``fully_shard`` subscribes to each call: :data:`CHECKS`, and
    where ``FSDP_COMPOSE_DEBUG_COLLECTIVES`` asks for them (read at each call), the
    debug mode's collective checks (one object for every tree, as ``Events`` keeps one
    subscription per object)."""
    if not _env.debug_collectives():
        return (CHECKS,)
    return (CHECKS, _collective_checks(_env.debug_timeout()))


@functools.cache
def _collective_checks(timeout: float | None) -> Observer:
    from ..debug import CollectiveChecks  # the user turned debug mode on

    return CollectiveChecks(timeout)
