"""Stalled gloo exchanges: telling a desync from a slow peer, and ending it with a
Python exception on every rank.

[Note: stalled exchanges]
With collectives matched by what they are ([Note: collectives matched by what they
are] in ``_gloo.py``), ranks that issued different collectives wait for each other
instead of exchanging the wrong data. A watchdog thread turns that wait into an
error:

* The training thread marks the exchange it waits on (two attribute writes per
  wait: the only cost while nothing stalls). Every ``_TICK_S`` the watchdog looks
  at it; once a wait is older than ``FSDP_COMPOSE_STALL_CHECK_S`` seconds (default
  1), the rank publishes in the job's store what it waits for and the tags it
  issued recently on that group, and reads what the other ranks of the group
  published.
* A desync is certain, not guessed from time, when this rank waits for a
  collective that a peer never issued, and that peer waits (on the same group) for
  one this rank never issued: neither can move on. ("Never issued" counts
  occurrences: a unit's forward and backward all-gathers of one step share a tag.) A slow peer (still computing,
  saving a checkpoint) publishes nothing, and a peer whose data is still in flight
  waits for a collective this rank did issue: both keep waiting, for as long as the
  process group's timeout allows.
* On a desync the watchdog records in the store that the group is closed and why,
  and closes this rank's connections on the group (a receive that times out at
  once makes gloo close its pair), which wakes the waiting threads here and on the
  peers with an error. A rank whose wait fails, and a stalled rank that finds the
  record, close their connections in turn, so the closing reaches every rank of
  the group; :func:`explain` turns it into a
  :class:`~fsdp_compose.debug.CollectiveMismatchError` naming, on every rank, the
  unit, kind, size and step each side waits for. The group cannot be used after
  that (other groups, such as the default one, are unaffected). To stop before any
  data moves and keep the group usable, use the collective guard
  (``debug.enable_collective_guard()``).
* A receive that times out closes every connection of the rank, but a receive on
  a connection the peer already closed fails at once and closes nothing else:
  :func:`break_group` tries the peers in turn until one times out. (Trying only
  the first let a rank outside the mismatch, on four ranks, keep its connection
  to a rank that had stopped, and wait on it until the group's timeout: the CI
  failure of stop 15.)
* Closing must not cut off a transfer under way: gloo wakes a receive that is
  still waiting for its message when the connection closes, but not one whose
  message had begun to arrive, which then waits until the group's timeout (30
  minutes for a group made without one). A rank therefore closes its connections
  :data:`CLOSE_GRACE_S` after it decided to (on whichever thread decided first),
  so that the transfers already under way, all of them between ranks that agree,
  finish first.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from . import _env
from ._errors import CollectiveMismatchError

if TYPE_CHECKING:
    from ._gloo import Exchange, _Peers

logger = logging.getLogger("fsdp_compose")

_TICK_S = 0.2
_KEY = "fsdp_compose/stall"
# Exchange tags are 31-bit and never this one (see break_group).
BREAK_TAG = 0x7FFFFFFF
#: Seconds a rank lets the transfers under way finish before it closes its
#: connections on a group (see the Note).
CLOSE_GRACE_S = 0.5


class _Watch:
    """What the training thread waits on (``current``, since ``since``), what this
    rank published about it, and the watchdog's verdict."""

    __slots__ = ("current", "published", "since", "verdict")

    def __init__(self) -> None:
        self.current: Exchange | None = None
        self.since = 0.0
        self.published: tuple[Exchange, Any, str] | None = None  # (wait, store, key)
        self.verdict: tuple[Exchange, str] | None = None


watch = _Watch()
_thread: threading.Thread | None = None
_lock = threading.Lock()


def start() -> None:
    """Starts the watchdog thread once per process (with the first gloo route)."""
    global _thread
    if _thread is None:
        stall_s = _env.seconds("FSDP_COMPOSE_STALL_CHECK_S") or 1.0
        _thread = threading.Thread(
            target=_run, args=(stall_s,), name="fsdp_compose-stall-watchdog", daemon=True
        )
        _thread.start()


def _run(stall_s: float) -> None:
    while True:
        time.sleep(_TICK_S)
        current = watch.current
        if current is None or time.monotonic() - watch.since < stall_s:
            continue
        try:
            _check(current)
        except Exception as exc:  # the next tick tries again; never kill the thread
            logger.debug("fsdp_compose: stall check failed: %r", exc)


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def _key(peers: _Peers, group_rank: int) -> str:
    return f"{_KEY}/{peers.name}/{peers.global_ranks[group_rank]}"


def _occurrence(exchange: Exchange, issued: list[int]) -> int:
    """Which occurrence of its tag ``exchange`` is in its group's history
    ``issued`` (a unit's all-gathers of one step, forward and backward, share a tag)."""
    peers = exchange.peers
    position = exchange.seq - (peers.count - len(issued))
    return issued[: position + 1].count(exchange.tag)


def _what(exchange: Exchange) -> list[Any]:
    """``exchange``'s name as published: kind, unit, step, elements, dtype."""
    kind, label, step, numel, dtype = exchange.name
    return [kind, label, step, numel, str(dtype).removeprefix("torch.")]


def _record(exchange: Exchange) -> dict[str, Any]:
    issued = list(exchange.peers.issued)
    return {
        "wait": exchange.tag,
        "occurrence": _occurrence(exchange, issued),
        "what": _what(exchange),
        "issued": issued,
    }


def _check(current: Exchange) -> None:
    """One look at a stalled wait: publish it, compare with the peers', and on a
    desync close the group (see [Note: stalled exchanges])."""
    store = _store()
    if store is None:
        return
    peers = current.peers
    with _lock:
        if watch.current is not current:
            return  # the wait ended meanwhile
        if watch.published is None or watch.published[0] is not current:
            key = _key(peers, peers.rank)
            store.set(key, json.dumps(_record(current)))
            watch.published = (current, store, key)
    if watch.current is not current:
        # The wait ended while this was published; its thread may have looked for
        # a publication before there was one, so withdraw it here.
        unpublish(current)
        return
    sides = _closed_by(current, store) or _diagnose(current, store)
    if sides is not None and watch.current is current:
        _close(current, store, sides)


def _close(exchange: Exchange, store: Any, sides: list[Any]) -> None:
    """Ends the desync ``sides`` on this rank: records why the group is closed (for
    the ranks that were not part of it), keeps the verdict for :func:`explain`, and
    closes this rank's connections."""
    peers = exchange.peers
    closed = _closed_key(peers)
    if not store.check([closed]):
        store.set(closed, json.dumps(sides))
    watch.verdict = (exchange, _message(peers.global_ranks[peers.rank], sides))
    break_group(peers)


def _closed_key(peers: _Peers) -> str:
    return f"{_KEY}/{peers.name}/closed"


def _closed_by(exchange: Exchange, store: Any) -> list[Any] | None:
    """The desync another rank of the group found and closed the group for, if any."""
    key = _closed_key(exchange.peers)
    return json.loads(store.get(key)) if store.check([key]) else None


def _diagnose(exchange: Exchange, store: Any) -> list[Any] | None:
    """``[rank, what it waits for, peer, what the peer waits for]`` if a peer of
    ``exchange``'s group waits for a collective this rank never issued while this
    rank waits for one that peer never issued."""
    peers = exchange.peers
    mine = list(peers.issued)
    occurrence = _occurrence(exchange, mine)
    for peer in peers.others:
        key = _key(peers, peer)
        if not store.check([key]):
            continue
        theirs = json.loads(store.get(key))
        if (
            theirs["issued"].count(exchange.tag) < occurrence
            and mine.count(theirs["wait"]) < theirs["occurrence"]
        ):
            me = peers.global_ranks[peers.rank]
            return [me, _what(exchange), peers.global_ranks[peer], theirs["what"]]
    return None


def _describe(what: list[Any]) -> str:
    kind, label, step, numel, dtype = what
    return f"{kind} for {label} (step {step}, {numel:,} {dtype} elements)"


def _message(rank: int, sides: list[Any]) -> str:
    a, what_a, b, what_b = sides
    return (
        f"fsdp_compose collective mismatch on rank {rank}: the ranks issued different "
        f"collectives, and ranks {a} and {b} each wait for one the other never issued.\n"
        f"  rank {a} waits for {_describe(what_a)}\n"
        f"  rank {b} waits for {_describe(what_b)}\n"
        "Usual causes: control flow that differs between ranks (a module or a batch skipped "
        "on one rank), requires_grad or fsdp_compose settings changed on one rank only, or a "
        "different number of batches per rank. No data was exchanged between different "
        "collectives. The process group was closed to end the wait: restart the job. To stop "
        "before any data moves and keep the group usable, enable the collective guard "
        "(fsdp_compose.debug.enable_collective_guard())."
    )


def break_group(peers: _Peers) -> None:
    """Closes this rank's connections on ``peers``' group: a receive that times out
    makes gloo close all of them, which wakes the threads waiting on them here and
    on the peers with an error. A wait that began on a pair that was still open,
    for a peer that waits elsewhere, is not woken that way: every rank closes its
    own connections (see [Note: stalled exchanges]), and no later wait on a closed
    group blocks (:attr:`_Peers.closed`). The tag is never a collective's. The
    connections close :data:`CLOSE_GRACE_S` after the first call (on any thread)
    began: see the Note."""
    now = time.monotonic()
    if not peers.closed:
        peers.closed, peers.closed_at = True, now
    grace = peers.closed_at + CLOSE_GRACE_S - now
    if grace > 0:
        time.sleep(grace)
    # Only a receive that times out closes every connection: on a connection
    # the peer already closed the receive fails at once and closes nothing else,
    # so try each peer until one times out (after that every receive fails at once).
    for peer in peers.others:
        with contextlib.suppress(RuntimeError):
            work = peers.group.recv([torch.empty(1)], peer, BREAK_TAG)
            work.wait(datetime.timedelta(milliseconds=1))


def explain(exchange: Exchange) -> CollectiveMismatchError | None:
    """Called by the training thread when waiting on ``exchange`` failed: the
    mismatch error if this was a desync (decided by this rank's watchdog, or by a
    peer's that published its wait), else ``None`` (the failure is reported as is)."""
    verdict = watch.verdict
    if verdict is None or verdict[0] is not exchange:
        store = _store()
        if store is None:
            return None
        try:
            sides = _diagnose(exchange, store) or _closed_by(exchange, store)
            if sides is None:
                return None
            _close(exchange, store, sides)
        except (RuntimeError, ValueError, KeyError):
            return None
    assert watch.verdict is not None
    return CollectiveMismatchError(watch.verdict[1])


def unpublish(exchange: Exchange) -> None:
    """Withdraws what this rank published about its wait on ``exchange``, which
    has completed. (What it published about a wait that failed stays: the peers'
    :func:`explain` reads it.)"""
    with _lock:
        published = watch.published
        if published is None or published[0] is not exchange:
            return
        watch.published = None
    _, store, key = published
    with contextlib.suppress(RuntimeError):
        store.delete_key(key)
