"""Exception types shared with torch's FSDP2.

[Note: FSDP2's exception types]
Code written against FSDP2 may catch its exceptions, so fsdp_compose raises the
same type for the same refusal (e.g. ``NotImplementedError`` for an uneven shard on
a dim other than 0). Where FSDP2 raises ``AssertionError`` for a user error
(``fully_shard`` twice, a shard dim out of range, ...), fsdp_compose raises a
subclass of both it and the builtin type that says what went wrong.
"""

from __future__ import annotations


class FSDPValueError(ValueError, AssertionError):
    """Bad input that torch's FSDP2 refuses with ``AssertionError``."""


class FSDPRuntimeError(RuntimeError, AssertionError):
    """A refused operation that torch's FSDP2 refuses with ``AssertionError``."""
