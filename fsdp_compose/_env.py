"""The ``FSDP_COMPOSE_*`` environment variables, read and validated in one place.

A value fsdp_compose does not understand raises a ``ValueError`` naming the
variable, the value and the accepted ones, instead of silently meaning the default
(``FSDP_COMPOSE_DEBUG_COLLECTIVES=ture``). Unset or empty means the default.
"""

from __future__ import annotations

import math
import os

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _raw(name: str) -> str | None:
    return os.environ.get(name, "").strip() or None


def _invalid(name: str, value: str, accepted: str) -> ValueError:
    return ValueError(
        f"environment variable {name}={value!r} is not valid: use {accepted}, or unset it"
    )


def flag(name: str, default: bool) -> bool:
    """A boolean variable: ``1/true/yes/on`` or ``0/false/no/off`` (any case)."""
    value = _raw(name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise _invalid(name, value, "1 or 0 (also true/false, yes/no, on/off)")


def seconds(name: str) -> float | None:
    """A positive, finite number of seconds, or ``None`` where unset."""
    value = _raw(name)
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and number > 0):
        raise _invalid(name, value, "a positive number of seconds")
    return number


# -- the variables fsdp_compose reads ------------------------------------------


def debug_collectives() -> bool:
    """``FSDP_COMPOSE_DEBUG_COLLECTIVES``: each public ``fully_shard`` call subscribes
    ``fsdp_compose.debug``'s collective checks to its unit (``fsdp_compose._checks``)."""
    return flag("FSDP_COMPOSE_DEBUG_COLLECTIVES", False)


def debug_timeout() -> float | None:
    """``FSDP_COMPOSE_DEBUG_TIMEOUT``: seconds the debug checks wait for the other ranks."""
    return seconds("FSDP_COMPOSE_DEBUG_TIMEOUT")
