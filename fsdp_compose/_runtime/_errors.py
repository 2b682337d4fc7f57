"""Exception types shared with torch's FSDP2.

[Note: FSDP2's exception types]
Code written against FSDP2 may catch the exceptions it raises for a refusal, so
fsdp_compose raises the same type for the same refusal (e.g. ``NotImplementedError``
for an uneven shard on a dim other than 0). Where FSDP2 signals a user error with
``AssertionError`` (``fully_shard`` twice, deep-copying a module, a shard dim out
of range, a non-``Shard`` placement), fsdp_compose raises a subclass of both
``AssertionError`` and the builtin type that says what went wrong
(``ValueError``, ``RuntimeError``): code catching either still works.
"""

from __future__ import annotations


class FSDPValueError(ValueError, AssertionError):
    """Bad input that torch's FSDP2 refuses with ``AssertionError``."""


class FSDPRuntimeError(RuntimeError, AssertionError):
    """A refused operation that torch's FSDP2 refuses with ``AssertionError``."""


class CollectiveMismatchError(RuntimeError):
    """Ranks of one process group issued different collectives (or some none):
    raised on every rank by the debug checks (``fsdp_compose.debug``)."""
