"""Shared-memory rows for the whole-matrix exchange when every rank of the shard
group runs on one host (CPU tensors).

[Note: the exchange through shared memory]
On one host, gloo moves the exchange's rows through loopback TCP: the bytes are
copied into the kernel and out again by gloo's threads, which on the ``W=2``
benchmarks cost 1.5 ms (square stack) to 6.7 ms (GPT) of CPU per rank and step,
on the same cores as Newton–Schulz. Here every rank maps every other rank's
region of a shared-memory file instead: a rank writes its rows for the owners
into its own region (where it wrote the send buffer), the owner copies them
from there into its full matrices (where it copied from the receive buffer),
and each rank reads its rows of a result straight from the owner's region. A
one-element ``all_reduce`` per round and direction is the only collective: it
tells every rank that the writes before it are done (the collective's socket
round trip orders the memory accesses).

Each rank's region holds three slots for the gather and three for the return,
each the size of the largest round's part (the same on every rank). A slot is
written again three rounds later, and by then every reader has passed a
collective that follows its read: the rows a rank sent for round ``b`` are read
by their owner before it posts round ``b``'s return, which the sender waits for
before it posts the gather of round ``b+3``; a rank reads its rows of round
``b``'s results before it posts the gather of round ``b+3``, which the owner
waits for before it writes the return of round ``b+3``. A step starts only
after the previous step's last return, so slots are also safe across steps.

The file is created in ``/dev/shm`` with its pages reserved
(``posix_fallocate``: a full ``/dev/shm``, 64 MiB by default in a container,
means gloo, not a crash at a later write), mapped by every rank of the group
and unlinked as soon as all have mapped it (nothing is left behind if a process
dies). Memory: each rank's region is ``3·(G + T)`` elements, ``G`` and ``T``
the largest round's gather and return parts (each at most ``R`` of [Note: owner
compute for whole-matrix optimizers]): at ``W=2`` in bfloat16, 6 MiB for the
square stack and 11.8 MiB for the benchmark GPT, kept while the optimizer
lives, in place of the send, receive and return buffers (the buffer pool then
keeps only the full matrices and Newton–Schulz's temporaries: 3.5 and 12 MiB).

It is used only when every rank of the group reports the same host and boot and
could reserve and map every region; otherwise every rank keeps the exchange on
gloo. ``FSDP_COMPOSE_SHARED_MEMORY_EXCHANGE=0`` turns it off (read when a plan
first runs).
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import _env

logger = logging.getLogger("fsdp_compose")

SLOTS = 3
_ALIGN = 64


def _host() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass
class SharedRegions:
    """Every rank's region of the group, as byte tensors, and the slot sizes:
    gather slots (``gather_numel`` elements of ``comm_dtype``) then return slots
    (``return_numel`` elements of ``result_dtype``)."""

    regions: list[torch.Tensor]
    maps: list[mmap.mmap]
    comm_dtype: torch.dtype
    result_dtype: torch.dtype
    gather_bytes: int
    return_bytes: int

    def gather(self, rank: int, slot: int, numel: int) -> torch.Tensor:
        """Rank ``rank``'s gather slot ``slot`` (its first ``numel`` elements)."""
        start = slot * self.gather_bytes
        size = numel * self.comm_dtype.itemsize
        return self.regions[rank][start : start + size].view(self.comm_dtype)

    def result(self, rank: int, slot: int, numel: int) -> torch.Tensor:
        """Rank ``rank``'s return slot ``slot`` (its first ``numel`` elements)."""
        start = SLOTS * self.gather_bytes + slot * self.return_bytes
        size = numel * self.result_dtype.itemsize
        return self.regions[rank][start : start + size].view(self.result_dtype)


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def open_regions(
    group: dist.ProcessGroup,
    rank: int,
    world: int,
    gather_numel: int,
    return_numel: int,
    comm_dtype: torch.dtype,
    result_dtype: torch.dtype,
) -> SharedRegions | None:
    """Maps one region per rank of ``group`` (a collective: every rank of the
    group calls it with the same sizes), or returns ``None`` on every rank where
    shared memory cannot be used."""
    if not _env.flag("FSDP_COMPOSE_SHARED_MEMORY_EXCHANGE", True):
        return None
    gather_bytes = _round_up(max(1, gather_numel * comm_dtype.itemsize))
    return_bytes = _round_up(max(1, return_numel * result_dtype.itemsize))
    size = SLOTS * (gather_bytes + return_bytes)
    path: str | None = f"/dev/shm/fsdp_compose_exchange_{os.getpid()}_{uuid.uuid4().hex}"
    assert path is not None
    try:
        if not hasattr(os, "posix_fallocate"):  # not Linux: no /dev/shm to reserve in
            raise OSError("os.posix_fallocate is not available")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # Reserve the pages now: on a full /dev/shm this fails here (and the
            # exchange stays on gloo) instead of raising SIGBUS at a later write.
            os.posix_fallocate(fd, 0, size)
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        else:
            os.close(fd)
    except OSError as e:
        logger.debug("shared-memory exchange off: cannot create %s (%s)", path, e)
        path = None
    seen: list[tuple[str, str | None] | None] = [None] * world
    dist.all_gather_object(seen, (_host(), path), group=group)
    maps: list[mmap.mmap] = []
    ok = all(s is not None and s[0] == seen[rank][0] and s[1] for s in seen)  # type: ignore[index]
    if ok:
        try:
            for s in seen:
                assert s is not None and s[1] is not None
                fd = os.open(s[1], os.O_RDWR)
                try:
                    maps.append(mmap.mmap(fd, size))
                finally:
                    os.close(fd)
        except (OSError, ValueError) as e:
            logger.debug("shared-memory exchange off: cannot map a region (%s)", e)
            ok = False
    every: list[bool | None] = [None] * world
    dist.all_gather_object(every, ok, group=group)  # every rank has mapped (or failed)
    if path is not None:
        os.unlink(path)
    if not all(every):
        return None
    regions = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
    return SharedRegions(regions, maps, comm_dtype, result_dtype, gather_bytes, return_bytes)


def signal(group: dist.ProcessGroup) -> dist.Work:
    """A one-element all-reduce: when it completes, every rank's writes before it
    are done."""
    work = dist.all_reduce(torch.zeros(1), group=group, async_op=True)
    assert work is not None
    return work
