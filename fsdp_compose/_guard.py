"""The collective guard: ranks agree on a collective before it runs.

[Note: collective guard]
When ranks of a group issue different collectives (a data-dependent branch
skips a unit on one rank, one rank skips a batch, a parameter's
``requires_grad`` differs), nothing in a process group matches collectives by
identity: gloo pairs them by issue order, so two ranks either exchange
different units' data of the same size (a silently wrong result) or abort the
whole process inside gloo on a size mismatch (``SIGABRT``, no Python exception).

Before every collective fsdp_compose issues on a CPU (gloo) group, its ranks
all-gather a fingerprint of fixed size -- the unit label's hash, the kind of
collective, its element count and dtype, the training step and the group's
collective counter -- with one tiny synchronous all-gather on the same group.
Because the guard's size never varies, it always pairs, whatever the ranks
were about to do; every rank sees every fingerprint, so on a mismatch every
rank raises :class:`~fsdp_compose.debug.CollectiveMismatchError` naming each
rank's collective (the labels are exchanged once more on that error path), and
the real collective is never issued. A rank that issues no further collective
leaves the others waiting in the guard, which ends as the process group's
timeout error, again a Python exception.

Cost: one 6-element all-gather per collective, on the issuing thread; each waits
for the peer ranks, which also removes overlap: 7-15% of the small preset's step
at W=2 (README, "Debugging hangs and errors"), so the guard is off by default
(``debug.enable_collective_guard()`` or ``FSDP_COMPOSE_COLLECTIVE_GUARD=1``). Accelerator collectives are not
guarded (the comparison would synchronize the host with the device at every
collective); neither are groups of the ``fake`` backend, whose collectives move
no data. The debug
mode (:mod:`fsdp_compose.debug`) replaces it with its own, slower check that
also names a rank that stopped issuing collectives.
"""

from __future__ import annotations

import functools
import zlib

import torch
import torch.distributed as dist

from . import _collectives, _compat, _env, debug

_FIELDS = 6  # label hash, kind, numel, dtype, step, per-group counter
_KINDS = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3}

# Off by default until it fits its cost budget (see the README); debug.enable_collective_guard().
enabled = False
_counters: dict[int, int] = {}  # id(group) -> collectives issued on it
_unguarded: dict[int, bool] = {}  # id(group) -> backend without the guard


@functools.lru_cache(maxsize=4096)
def _code(text: str) -> int:
    # Python's hash() is salted per process; the ranks need the same value.
    return zlib.crc32(text.encode())


def _skipped(group: dist.ProcessGroup) -> bool:
    skip = _unguarded.get(id(group))
    if skip is None:
        skip = _unguarded[id(group)] = _compat.process_group_backend(group) == "fake"
    return skip


def check(
    kind: str, label: str, group: dist.ProcessGroup, numel: int, dtype: torch.dtype, step: int
) -> None:
    """Raises :class:`~fsdp_compose.debug.CollectiveMismatchError` on every rank of
    ``group`` if its ranks are not all about to issue the same collective."""
    if _skipped(group):
        return
    seq = _counters.get(id(group), 0)
    _counters[id(group)] = seq + 1
    mine = [_code(label), _KINDS[kind], numel, _code(str(dtype)), step, seq]
    world = group.size()
    gathered = torch.empty(world * _FIELDS, dtype=torch.int64)
    _compat.all_gather_into_tensor(
        gathered, torch.tensor(mine, dtype=torch.int64), group, async_op=False
    )
    rows = gathered.view(world, _FIELDS).tolist()
    if all(row == mine for row in rows):
        return
    _raise_mismatch(kind, label, group, numel, dtype, step, seq)


def _raise_mismatch(
    kind: str,
    label: str,
    group: dist.ProcessGroup,
    numel: int,
    dtype: torch.dtype,
    step: int,
    seq: int,
) -> None:
    # Every rank saw the same fingerprints, so every rank is here: one more
    # exchange, of the readable descriptions, is safe.
    mine = f"{kind} for {label} ({numel} x {str(dtype).replace('torch.', '')}, step {step})"
    described = [
        blob.decode(errors="replace")
        for blob in _compat.all_gather_bytes(mine.encode(), group, torch.device("cpu"))
    ]
    ranks = dist.get_process_group_ranks(group)
    lines = "\n".join(f"  rank {r} issued {d}" for r, d in zip(ranks, described))
    raise debug.CollectiveMismatchError(
        f"fsdp_compose collective mismatch on group {ranks} (collective #{seq}), caught before "
        f"any data moved:\n{lines}\nThe ranks ran different units or a different number of "
        "steps (a data-dependent branch taken on some ranks only, a batch skipped on one "
        "rank, requires_grad or settings changed on one rank, unshard() called on one rank). "
        "Every rank must run the same fully_shard units in the same order."
    )


def set_enabled(on: bool) -> None:
    """Attaches the guard to (or detaches it from) the collectives' launch, see
    [Note: collective extensions] in ``_collectives.py``."""
    global enabled
    enabled = on
    if on:
        _collectives.add_launch_wrapper(_guard_launch)
    else:
        _collectives.remove_launch_wrapper(_guard_launch)


def _guard_launch(call: _collectives.CollectiveCall, issue: _collectives.Issue) -> dist.Work | None:
    # The debug mode's own check replaces the guard; accelerator collectives are
    # not guarded (see [Note: collective guard]).
    if call.device.type == "cpu" and not debug.collective_checks_enabled():
        check(call.kind, call.label, call.group, call.numel, call.dtype, call.step)
    return issue()


set_enabled(_env.flag("FSDP_COMPOSE_COLLECTIVE_GUARD", False))
