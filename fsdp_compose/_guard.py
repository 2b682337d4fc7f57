"""The collective guard: ranks agree on a collective before it runs.

[Note: collective guard]
When ranks of a group issue different collectives (a data-dependent branch
skips a unit on one rank, one rank skips a batch, a parameter's
``requires_grad`` differs), nothing in a process group matches collectives by
identity: gloo pairs them by issue order, so two ranks either exchange
different units' data of the same size (a silently wrong result) or abort the
whole process inside gloo on a size mismatch (``SIGABRT``, no Python exception).

Before every collective fsdp_compose issues on a CPU gloo group, its ranks
all-gather a fingerprint of fixed size -- the unit label's hash, the kind of
collective, its element count and dtype, the training step, the collective's
number on its group, and 128 bytes of readable description. Because the
fingerprint's size never varies, its exchange always pairs, whatever the ranks
were about to do; every rank sees every fingerprint, so on a mismatch every
rank raises :class:`~fsdp_compose.debug.CollectiveMismatchError` naming each
rank's collective, and the data collective is never issued anywhere.

The guard is asynchronous, so that it costs no overlap:

* Each guarded group ("lane") gets two private gloo groups with the same ranks,
  built lazily without any collective on the world (a ``ProcessGroupGloo`` over
  a ``PrefixStore`` of the default store): one carries the fingerprints, the
  other the data collectives. The training thread only *issues* the fingerprint
  exchange and returns a :class:`GuardedCollective` at once.
* When a fingerprint exchange completes (on gloo's thread), its callback marks
  it verified and drains the lane's queue strictly in issue order: every
  verified collective at the head is issued on the data group. gloo tags
  collectives by issue order, and the queue makes that order the same on every
  rank, whichever exchange completes first.
* :meth:`GuardedCollective.wait` waits for that launch, then for the data.

Why a private data group rather than the caller's: the data collectives are
issued from gloo's thread at a moment that differs between ranks, while the
training thread may issue its own collectives on the caller's group at any
time (a loss all-reduce, ``SyncBatchNorm``, DTensor ops, the structure check);
on one group the two orders would interleave differently per rank and pair the
wrong collectives. On their own group they cannot meet. The fingerprints too
have their own group: a rank that stops issuing collectives (it skipped a
unit, then all-reduced its loss) leaves the others waiting in the guard until
the group's timeout -- a Python exception -- instead of pairing a fingerprint
with the user's all-reduce.

A user-supplied comm (``set_custom_all_gather`` / ``set_custom_reduce_scatter``)
must be called with the caller's group (it may ask the group for its ranks); it
is issued on the training thread once its fingerprint matched (synchronous,
like the old guard, but still in order with the others).

On a mismatch (or a failed exchange: a peer crashed, the timeout expired) the
lane fails: that collective and every later one queued on it raise at
``wait`` (a new one raises at once), and the data group stays consistent
because no rank issued any of them. Once the error has reached the caller, the
next guarded collective on the group starts a fresh lane (every rank raised, so
every rank starts the same fresh lane), so training can go on after
``reset_iter_state()`` on every rank.

Cost: one 22-int exchange and one callback per collective, off the training
thread: about 400 µs of CPU over all threads per collective on loopback (3x a
small unguarded all-gather), but no lost overlap; on an idle machine 1.9-3.0% of
the small preset's step at W=2 (README, "Debugging hangs and errors"). That is
over its 2% budget, so it stays off by default (``debug.enable_collective_guard()`` or
``FSDP_COMPOSE_COLLECTIVE_GUARD=1`` turns it on). Accelerator collectives are
not guarded (the comparison would synchronize the host with the device at
every collective), nor are groups whose CPU backend is not gloo (the threaded
test group, the ``fake`` backend of dry runs, MPI, ...). The debug mode
(:mod:`fsdp_compose.debug`) replaces it with its own, slower check that also
names a rank that stopped issuing collectives, on every backend.
"""

from __future__ import annotations

import atexit
import collections
import functools
import logging
import threading
import time
import weakref
import zlib
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist

from . import _collective_hooks, _collectives, _env, _gloo, debug

logger = logging.getLogger("fsdp_compose")

_FIELDS = 6  # label hash, kind, numel, dtype, step, per-lane counter
_TEXT_BYTES = 128  # readable description carried for the error message
_WORDS = _FIELDS + _TEXT_BYTES // 8
_KINDS = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3}
_DEFAULT_TIMEOUT_S = 1800.0  # torch's default, where a group's own is unknown

# Off by default: 2-3% of a step on an idle machine, over its 2% budget (README,
# "Debugging hangs and errors"); debug.enable_collective_guard() turns it on.
enabled = False  # set_enabled(), at the end of this module

# Test hook: when a list, every data collective a lane issues appends its
# description, in issue order (what this rank really exchanged).
launched: list[str] | None = None


@functools.lru_cache(maxsize=4096)
def _code(text: str) -> int:
    # Python's hash() is salted per process; the ranks need the same value.
    return zlib.crc32(text.encode())


@functools.lru_cache(maxsize=4096)
def _fingerprint_parts(
    kind: str, label: str, numel: int, dtype: torch.dtype
) -> tuple[list[int], list[int]]:
    """The fields before step and counter, and the readable description (without
    the step) as int64 words; the same every step, so cached."""
    text = f"{kind} for {label} ({numel} x {str(dtype).replace('torch.', '')}"
    padded = text.encode()[:_TEXT_BYTES].ljust(_TEXT_BYTES, b"\0")
    words = torch.frombuffer(bytearray(padded), dtype=torch.int64).tolist()
    return [_code(label), _KINDS[kind], numel, _code(str(dtype))], words


def _description(row: list[int]) -> str:
    """What a fingerprint row says, for messages: the text and the step."""
    text = torch.tensor(row[_FIELDS:], dtype=torch.int64).numpy().tobytes()
    return f"{text.rstrip(bytes(1)).decode(errors='replace')}, step {row[_FIELDS - 2]})"


_OK = object()  # verdict of a fingerprint that matched on every rank


class GuardedCollective:
    """A collective waiting for its fingerprint exchange; work-like (``wait``,
    ``get_future``) for :class:`~fsdp_compose._collectives.PendingCollective`."""

    __slots__ = (
        "_error",
        "_event",
        "_future",
        "_issue",
        "_lane",
        "_work",
        "gathered",
        "inference",
        "mine",
        "verdict",
    )

    def __init__(self, lane: _Lane, issue: _collectives.Issue, mine: list[int]) -> None:
        self._lane = lane
        self._issue: _collectives.Issue | None = issue
        self.mine = mine
        # Thread-local: the launch on gloo's thread must see the caller's mode
        # (buffers made under inference_mode may only be written under it).
        self.inference = torch.is_inference_mode_enabled()
        self.gathered = torch.empty(lane.size * _WORDS, dtype=torch.int64)
        self.verdict: object = None  # _OK or the exception the exchange ended with
        self._event = threading.Event()
        self._work: dist.Work | None = None
        self._error: BaseException | None = None
        self._future: torch.futures.Future | None = None

    def settle(self) -> None:
        """Waits for the launch; raises the lane's failure (a mismatch, or an
        exchange that failed or timed out) if there was none."""
        while not self._event.wait(1.0):  # set by the callback; short waits stay interruptible
            pass
        if self._error is not None:
            self._lane.retire()
            raise _copy(self._error)

    def wait(self) -> bool:
        """Waits for the launch, then for the data collective."""
        self.settle()
        assert self._work is not None
        return bool(self._work.wait())

    def get_future(self) -> torch.futures.Future:
        """Completes when the data collective has (or the lane failed)."""
        with self._lane.lock:
            if self._work is not None:
                return self._work.get_future()
            if self._future is None:
                self._future = torch.futures.Future()
                if self._event.is_set():  # failed before launch
                    self._future.set_exception(_copy(self._error or RuntimeError("not issued")))
            return self._future


def _copy(error: BaseException) -> BaseException:
    """A fresh exception like ``error``: each waiting collective raises its own."""
    try:
        return type(error)(*error.args)
    except Exception:  # an exception type with another constructor
        return RuntimeError(str(error))


class _Lane:
    """The fingerprint group, data group and issue-order queue of one caller group."""

    def __init__(self, group: dist.ProcessGroup, name: str) -> None:
        self.ranks = dist.get_process_group_ranks(group)
        self.size = group.size()
        timeout = timedelta(seconds=debug.process_group_timeout(group) or _DEFAULT_TIMEOUT_S)
        self.fingerprints = _private_gloo_group(group, f"{name}/fingerprints", timeout)
        self.data = _private_gloo_group(group, f"{name}/data", timeout)
        self.lock = threading.Lock()
        self.queue: collections.deque[GuardedCollective] = collections.deque()
        self.seq = 0
        self.outstanding = 0  # exchanges whose callback has not run yet
        self.failure: BaseException | None = None
        self.group_ref = weakref.ref(group)

    def retire(self) -> None:
        """After this lane's failure reached the caller: the group's next
        collective starts a fresh lane."""
        group = self.group_ref()
        if group is not None and _lanes.get(group) is self:
            del _lanes[group]
            # Destroying a gloo group waits for its pending work (fingerprints
            # that will only time out); keep it alive instead.
            _retired.append(self)

    def submit(
        self, call: _collective_hooks.CollectiveCall, issue: _collectives.Issue
    ) -> GuardedCollective:
        if self.failure is not None:
            self.retire()
            raise _copy(self.failure)
        seq = self.seq
        self.seq = seq + 1
        fields, words = _fingerprint_parts(call.kind, call.label, call.numel, call.dtype)
        mine = [*fields, call.step, seq, *words]
        entry = GuardedCollective(self, issue, mine)
        with self.lock:
            self.queue.append(entry)
            self.outstanding += 1
        try:
            work = self.fingerprints._allgather_base(
                entry.gathered, torch.tensor(mine, dtype=torch.int64)
            )
        except BaseException as exc:
            # Not issued: fail the lane rather than leave the queue blocked.
            with self.lock:
                self.outstanding -= 1
                entry.verdict = exc
                self._drain()
            self.retire()
            raise
        # Runs on gloo's thread when the exchange completes (or here, if it has).
        work.get_future().add_done_callback(functools.partial(self._on_fingerprint, entry))
        return entry

    def _on_fingerprint(self, entry: GuardedCollective, future: torch.futures.Future) -> None:
        # A callback must not raise: the waiting thread learns everything from
        # the entries' errors.
        try:
            future.value()
            verdict = _verdict(entry, self)
        except BaseException as exc:  # handed to the waiting thread
            verdict = exc
        with self.lock:
            self.outstanding -= 1
            entry.verdict = verdict
            self._drain()

    def _drain(self) -> None:
        """Issues the verified collectives at the head of the queue, in order;
        fails them all from the first that did not verify."""
        queue = self.queue
        # After a failure, every queued entry fails at once: their exchanges may
        # never complete (the peers stopped issuing), and must not be waited for.
        while queue and (queue[0].verdict is not None or self.failure is not None):
            entry = queue.popleft()
            if self.failure is None and entry.verdict is not _OK:
                self.failure = cast(BaseException, entry.verdict)
            if self.failure is None:
                try:
                    issue = cast(_collectives.Issue, entry._issue)
                    if entry.inference:
                        with torch.inference_mode():
                            entry._work = issue(self.data)
                    else:
                        entry._work = issue(self.data)
                    if launched is not None:
                        launched.append(_description(entry.mine))
                except BaseException as exc:  # raised at wait
                    self.failure = exc
            if self.failure is not None:
                entry._error = self.failure
            entry._issue = None  # drops the tensors the closure holds
            future = entry._future
            if future is not None:
                if entry._work is not None:
                    entry._work.get_future().add_done_callback(functools.partial(_complete, future))
                else:
                    future.set_exception(_copy(cast(BaseException, entry._error)))
            entry._event.set()


def _complete(future: torch.futures.Future, _done: torch.futures.Future) -> None:
    future.set_result(None)


def _verdict(entry: GuardedCollective, lane: _Lane) -> object:
    mine = entry.mine
    rows = entry.gathered.view(lane.size, _WORDS).tolist()
    if all(row == mine for row in rows):
        return _OK
    lines = [f"  rank {rank} issued {_description(row)}" for rank, row in zip(lane.ranks, rows)]
    seq = mine[_FIELDS - 1]
    return debug.CollectiveMismatchError(
        f"fsdp_compose collective mismatch on group {lane.ranks} (collective #{seq}), caught "
        "before any data moved:\n" + "\n".join(lines) + "\nThe ranks ran different units "
        "or a different number of steps (a data-dependent branch taken on some ranks only, a "
        "batch skipped on one rank, requires_grad or settings changed on one rank, unshard() "
        "called on one rank). Every rank must run the same fully_shard units in the same order."
    )


def _private_gloo_group(
    group: dist.ProcessGroup, name: str, timeout: timedelta
) -> dist.ProcessGroup:
    """A gloo process group over ``group``'s ranks that only this module uses,
    rendezvousing in the default store under ``name``: only the member ranks
    take part, and torch's group registry (and so the names of the groups the
    user creates later) is untouched."""
    store = dist.PrefixStore(f"fsdp_compose/guard/{name}/", debug.default_store())
    rank, size = group.rank(), group.size()
    backend = dist.ProcessGroupGloo(store, rank, size, timeout)
    private = dist.ProcessGroup(store, rank, size)
    private._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    private._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return private


_lanes: weakref.WeakKeyDictionary[dist.ProcessGroup, _Lane] = weakref.WeakKeyDictionary()
_unguarded: weakref.WeakKeyDictionary[dist.ProcessGroup, bool] = weakref.WeakKeyDictionary()
_built: dict[str, int] = {}  # group name -> lanes built for it (names fresh lanes)
_retired: list[_Lane] = []


def _lane_of(group: dist.ProcessGroup) -> _Lane | None:
    lane = _lanes.get(group)
    if lane is not None:
        return lane
    if _unguarded.get(group):
        return None
    if not _gloo.serves_cpu_with_gloo(group) or group.size() == 1:
        _unguarded[group] = True
        return None
    try:
        debug.default_store()
    except (RuntimeError, ValueError, AttributeError):
        # No default process group, so no store to meet in: unguarded.
        logger.debug("fsdp_compose: no default store; collective guard off for this group")
        _unguarded[group] = True
        return None
    base = getattr(group, "group_name", None) or "-".join(
        map(str, dist.get_process_group_ranks(group))
    )
    generation = _built.get(base, 0)
    _built[base] = generation + 1
    lane = _lanes[group] = _Lane(group, f"{base}/{generation}")
    if not _exit_hook_registered:
        _register_exit_hook()
    return lane


def _issue_nothing(group: dist.ProcessGroup) -> None:
    return None


def launch(call: _collective_hooks.CollectiveCall, issue: _collectives.Issue) -> dist.Work | None:
    """Issues ``issue`` (a CPU collective on ``call.group``) behind the guard:
    returns a work-like object at once; the collective itself is issued, on a
    private group with the same ranks, once every rank's fingerprint matched. See
    [Note: collective guard]. Groups the guard does not cover are issued directly.
    A collective that is not ``call.movable`` (a user-supplied comm) must run on
    ``call.group`` itself; it is issued on the calling thread after its
    fingerprint matched."""
    group = call.group
    lane = _lane_of(group)
    if lane is None:
        return issue(group)
    if not call.movable:
        # A user's comm gets the caller's group (it may ask it for ranks), so it is
        # issued here, once its fingerprint matched: synchronous, but ordered.
        lane.submit(call, _issue_nothing).settle()
        return issue(group)
    # A GuardedCollective has the part of Work's interface the collectives use.
    return cast(dist.Work, lane.submit(call, issue))


# [Note: guard at interpreter exit]
# An exchange still pending at exit calls back into Python from gloo's thread
# when it ends (the peer exits and closes the connection), which during
# interpreter finalization aborts the process. After a mismatch a rank may hold
# such exchanges: fingerprints it issued that its peers never will. At exit, wait
# (bounded) while the interpreter is alive for every exchange to end: the peers
# without pending exchanges exit at once, which ends ours.
_exit_hook_registered = False
_EXIT_WAIT_S = 10.0


def _settle_at_exit() -> None:
    deadline = time.monotonic() + _EXIT_WAIT_S
    lanes = [*_lanes.values(), *_retired]
    while any(lane.outstanding for lane in lanes) and time.monotonic() < deadline:
        time.sleep(0.01)


def _register_exit_hook() -> None:
    global _exit_hook_registered
    _exit_hook_registered = True
    atexit.register(_settle_at_exit)


def set_enabled(on: bool) -> None:
    """Attaches the guard to (or detaches it from) the collectives' launch, see
    [Note: collective extensions] in ``_collectives.py``."""
    global enabled
    enabled = on
    if on:
        _collective_hooks.add_launch_wrapper(_guard_launch)
    else:
        _collective_hooks.remove_launch_wrapper(_guard_launch)


def _guard_launch(
    call: _collective_hooks.CollectiveCall, issue: _collectives.Issue
) -> dist.Work | None:
    # The debug mode's own check replaces the guard; accelerator collectives are
    # not guarded (see [Note: collective guard]).
    if call.device.type != "cpu" or debug.collective_checks_enabled():
        return issue(call.group)
    return launch(call, issue)


set_enabled(_env.flag("FSDP_COMPOSE_COLLECTIVE_GUARD", False))
