"""The checks fsdp_compose adds to FSDP2's, as one subscriber of the runtime's events.

[Note: checks beyond FSDP2]
The runtime (``fsdp_compose._runtime``) does what FSDP2 does, FSDP2's own validations
included. What fsdp_compose refuses or warns about beyond them (bad arguments, ranks
that built different models, in-place changes FSDP2 silently loses) is
:data:`CHECKS`, an :class:`~fsdp_compose.Observer` that the public
:func:`fsdp_compose.fully_shard` passes to every call: it sees each call before the
call changes anything (``on_annotate``), each root's units at its lazy init
(``on_root_init``: where ``FSDP_COMPOSE_DEBUG_COLLECTIVES=1`` asks for them, it
subscribes ``fsdp_compose.debug``'s collective checks to the root's tree), and each
unit's events. It keeps no state of its own (what it records is on the unit), so
one object serves every tree. A test or a tool that
wants FSDP2's behaviour alone calls the runtime's ``fully_shard`` without it.
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import _env
from .._runtime import Annotation, Observer, Unit, UnitEvent
from ._arguments import check_annotation
from ._ranks import check_same_inputs, check_same_structure
from ._use import check_use

__all__ = ["CHECKS", "Checks"]


class Checks(Observer):
    """fsdp_compose's checks beyond FSDP2's; see [Note: checks beyond FSDP2]."""

    def on_annotate(self, call: Annotation) -> None:
        check_annotation(call)

    def on_root_init(self, units: Sequence[Unit]) -> None:
        check_same_structure(units)
        if units and _env.debug_collectives():
            from ..debug import CollectiveChecks  # the user turned debug mode on

            units[0].events.add(CollectiveChecks())  # (the tree's one event list)

    def on_unit(self, event: UnitEvent, unit: Unit) -> None:
        if event == "packed":
            check_same_inputs(unit)
        else:
            check_use(event, unit)


CHECKS = Checks()
