"""Sizes, counts and plans as the planner reads and prints them."""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "budget_text",
    "describe_choice",
    "elide_rows",
    "format_bytes",
    "format_count",
    "parse_bytes",
]


def format_bytes(n: float) -> str:
    """``1536 -> '1.50 KiB'`` (binary units: 1 GiB = 2**30 bytes)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def format_count(n: float) -> str:
    """A count with a decimal unit: ``987_654 -> '0.99M'``, ``70.55e9 -> '70.55B'``."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= 0.995 * scale or (unit == "M" and abs(n) >= 0.1 * scale):
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_bytes(text: str | int) -> int:
    """``'80GiB'`` (2**30 bytes each), ``'1.5 GB'`` (10**9 each), ``'4096'`` -> bytes.

    Raises ``ValueError`` for anything but a finite size of at least one whole byte
    (``'lots'``, ``'1e999'``, ``'1e-9'``, ``1.5`` bytes).
    """
    if isinstance(text, bool) or not isinstance(text, (int, float, str)):
        raise ValueError(
            f"a memory size is an int of bytes or a string such as '80GiB', got {text!r}"
        )
    s = str(text).strip().lower().replace(" ", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if unit not in _UNITS or not math.isfinite(value):
        raise ValueError(f"cannot read {text!r} as a memory size; write e.g. 80GiB, 1.5GB or 4096")
    size = value * _UNITS[unit]
    if not size >= 1 or (_UNITS[unit] == 1 and not value.is_integer()):
        raise ValueError(f"a memory size is a positive number of whole bytes, got {text!r}")
    return int(size)


def budget_text(text: str | int) -> str:
    """The budget as read, in the units given and in binary units when they differ:
    ``'80GB' -> '80.00 GB (74.51 GiB)'``, ``'80GiB' -> '80.00 GiB'``."""
    n = parse_bytes(text)
    s = str(text).strip().lower().replace(" ", "")
    unit = s[len(s.rstrip("abcdefghijklmnopqrstuvwxyz")) :]
    if _UNITS.get(unit, 1) % 1000 == 0:  # a decimal unit
        dec = next(u for u in ("TB", "GB", "MB", "KB") if n >= _UNITS[u.lower()] or u == "KB")
        return f"{n / _UNITS[dec.lower()]:.2f} {dec} ({format_bytes(n)})"
    return format_bytes(n)


def describe_choice(choice: dict[str, Any]) -> str:
    """A candidate in words: ``units of 2 policy units, prefetch depth 1, ...``."""
    offloaded = len(choice.get("offload", ()))
    return (
        f"units of {choice['group']} policy unit(s), prefetch depth {choice['prefetch_depth']}, "
        f"activation checkpointing {'on' if choice['checkpoint'] else 'off'}, "
        f"reshard_after_forward=False on the last {choice['keep']} unit(s)"
    ) + (f", {offloaded} unit(s) offloaded" if offloaded else "")


def elide_rows(rows: list[tuple[str, ...]], keep: int = 6) -> list[tuple[str, ...]]:
    if len(rows) <= 2 * keep + 2:
        return rows
    gap = tuple(["..."] + [""] * (len(rows[0]) - 1))
    return rows[: keep + 1] + [gap] + rows[-keep:]
