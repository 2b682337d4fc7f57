"""Debug mode: find ranks that issue different collectives instead of hanging.

The most expensive distributed failure is a hang: one rank takes a different
branch (a conditional module, an uneven number of batches), issues a different
all-gather, and every rank waits forever -- or, worse, two units of the same size
silently exchange each other's data. In debug mode every collective fsdp_compose
issues first publishes a fingerprint (unit, kind, sizes, dtype, step) through the
process group's key-value store and compares it with the fingerprints of the other
ranks of its group *before* the payload moves. On a mismatch every rank raises
(as long as the store outlives the ranks, as under torchrun; a store hosted by
rank 0, ``init_method="tcp://..."``, disappears when rank 0 exits after raising,
and a rank still reading it then fails with ``DistNetworkError`` instead)::

    RuntimeError: fsdp_compose collective mismatch on group [0, 1] (collective #17):
      rank 0 issued all_gather for blocks.2 (4160 x float32, step 3)
      rank 1 issued all_gather for blocks.1 (4160 x float32, step 3)

and a rank that stops issuing collectives makes the others raise after
``timeout`` seconds, naming the ranks they waited for.

The collective guard (:func:`enable_collective_guard`, off by default for now)
compares a fixed-size fingerprint of every collective on a CPU gloo group across
the group before issuing it, asynchronously (see [Note: collective guard] in
``_guard.py``), which catches mismatched collectives; debug mode goes through the
key-value store instead, so it also names a rank that stopped issuing
collectives altogether, and it covers accelerator collectives and every backend.
It replaces the guard while on.

Turn it on with the environment variable ``FSDP_COMPOSE_DEBUG_COLLECTIVES=1``
(``FSDP_COMPOSE_DEBUG_TIMEOUT`` sets the timeout; by default it is the process
group's own timeout, so debug mode never waits longer than the collective itself
would), or in code::

    from fsdp_compose import debug
    debug.enable_collective_checks(timeout=30.0)

Cost: each collective waits for a store round trip with every rank of its group
(about 0.1-1 ms on one host), and the wait makes communication synchronous with
the training thread, so overlap is lost. Use it to diagnose, not to train.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from . import _collective_hooks, _collectives, _compat, _env
from ._errors import CollectiveMismatchError

__all__ = [
    "CollectiveMismatchError",
    "collective_checks",
    "collective_checks_enabled",
    "disable_collective_checks",
    "enable_collective_checks",
    "enable_collective_guard",
]


def default_store() -> dist.Store:
    """The key-value store of the default process group (for the debug checks
    and the collective guard)."""
    return dist.distributed_c10d._get_default_store()


def process_group_timeout(group: dist.ProcessGroup) -> float | None:
    """The timeout (seconds) ``group`` was created with, or None if this torch
    version does not expose it (read through the backend's private options)."""
    try:
        device = (
            torch.device("cpu") if _compat.backend_name(group) == "gloo" else torch.device("cuda")
        )
        return float(group._get_backend(device).options._timeout.total_seconds())
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


class _FingerprintChecker:
    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout  # None: each group's own process-group timeout
        self._seq: dict[tuple[int, ...], int] = {}
        self._delete_supported = True

    def check(
        self,
        kind: str,
        label: str,
        group: dist.ProcessGroup,
        numel: int,
        dtype: torch.dtype,
        step: int,
    ) -> None:
        ranks = tuple(dist.get_process_group_ranks(group))
        seq = self._seq.get(ranks, 0)
        self._seq[ranks] = seq + 1
        me = dist.get_rank()
        store = default_store()
        group_key = "-".join(map(str, ranks))
        prefix = f"fsdp_compose/fingerprint/{group_key}/{seq}/"
        mine = f"{kind} for {label} ({numel} x {str(dtype).replace('torch.', '')}, step {step})"
        store.set(prefix + str(me), mine)
        others = [r for r in ranks if r != me]
        timeout = self.timeout
        if timeout is None:
            timeout = process_group_timeout(group) or _FALLBACK_TIMEOUT_S
        try:
            store.wait([prefix + str(r) for r in others], timedelta(seconds=timeout))
        except RuntimeError as exc:
            missing = [r for r in others if not store.check([prefix + str(r)])]
            raise CollectiveMismatchError(
                f"fsdp_compose: rank {me} issued {mine} as collective #{seq} on group "
                f"{list(ranks)}, but ranks {missing} issued no collective #{seq} within "
                f"{timeout:.0f}s. They may have stopped early (an uneven number of "
                "batches), crashed, taken a branch without this unit, or be blocked elsewhere."
            ) from exc
        seen = {r: store.get(prefix + str(r)).decode() for r in others}
        seen[me] = mine
        if self._delete_supported and seq >= 2:
            # Everyone has read collective seq-2's keys before publishing seq-1's.
            try:
                store.delete_key(f"fsdp_compose/fingerprint/{group_key}/{seq - 2}/{me}")
            except RuntimeError:
                self._delete_supported = False
        if len(set(seen.values())) > 1:
            lines = "\n".join(f"  rank {r} issued {seen[r]}" for r in sorted(seen))
            raise CollectiveMismatchError(
                f"fsdp_compose collective mismatch on group {list(ranks)} (collective #{seq}):\n"
                f"{lines}\nThe ranks ran different units or a different number of steps (e.g. a "
                "data-dependent branch taken on some ranks only). Every rank must run the same "
                "fully_shard units in the same order."
            )


_checker: _FingerprintChecker | None = None
_FALLBACK_TIMEOUT_S = 60.0  # where torch does not expose a group's timeout


def _env_enabled() -> bool:
    return _env.flag("FSDP_COMPOSE_DEBUG_COLLECTIVES", False)


def _set_checker(checker: _FingerprintChecker | None) -> None:
    """Installs ``checker`` (None: none) on the collectives' launch (see [Note:
    collective extensions] in ``_collectives.py``)."""
    global _checker
    _checker = checker
    if checker is None:
        _collective_hooks.remove_launch_wrapper(_check_before_launch)
    else:
        _collective_hooks.add_launch_wrapper(_check_before_launch)


def _check_before_launch(
    call: _collective_hooks.CollectiveCall, issue: _collectives.Issue
) -> dist.Work | None:
    checker = _checker
    if checker is not None:
        checker.check(call.kind, call.label, call.group, call.numel, call.dtype, call.step)
    return issue(call.group)


def enable_collective_checks(timeout: float | None = None) -> None:
    """Cross-checks every collective's fingerprint across ranks before it is issued.

    Args:
        timeout (Optional[float]): seconds to wait for the other ranks' fingerprints
            before raising :class:`CollectiveMismatchError`. Defaults to
            ``FSDP_COMPOSE_DEBUG_TIMEOUT`` if set, else the timeout of the process
            group the collective runs on.
    """
    if timeout is None:
        timeout = _env.seconds("FSDP_COMPOSE_DEBUG_TIMEOUT")
    _set_checker(_FingerprintChecker(timeout))


def disable_collective_checks() -> None:
    """Turns the cross-rank collective checks off (the default)."""
    _set_checker(None)


def collective_checks_enabled() -> bool:
    return _checker is not None


@contextlib.contextmanager
def collective_checks(timeout: float | None = None) -> Iterator[None]:
    """Enables the checks inside a ``with`` block."""
    previous = _checker
    enable_collective_checks(timeout)
    try:
        yield
    finally:
        _set_checker(previous)


def enable_collective_guard(enabled: bool = True) -> None:
    """Turns the collective guard on (or off): before each collective on a CPU
    gloo group, its ranks exchange a fixed-size fingerprint of it, so that ranks
    about to issue different collectives all raise :class:`CollectiveMismatchError`
    instead of exchanging the wrong data or aborting inside gloo (see [Note:
    collective guard] in ``_guard.py``). The exchange runs off the training thread
    and the collective is launched once it matched, so overlap is kept. Off by
    default until its step cost is shown within 2% (README, "Debugging hangs and
    errors"); ``FSDP_COMPOSE_COLLECTIVE_GUARD=1`` turns it on for the whole process.

    Args:
        enabled (bool): ``True`` to guard every later collective, ``False`` to stop.
    """
    from . import _guard  # _guard imports this module

    _guard.set_enabled(bool(enabled))


if _env_enabled():
    enable_collective_checks()
