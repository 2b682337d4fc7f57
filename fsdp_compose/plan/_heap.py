"""The resident memory of a training step under glibc's default ``malloc``.

[Note: resident memory under glibc's default allocator]
On CPU, torch allocates tensors with ``posix_memalign``. With glibc's default
settings a freed tensor does not necessarily leave the resident set:

* An allocation is served from the heap (the arena) when a free chunk or the
  top of the heap can hold it; only when neither can and it is at least the
  *mmap threshold* does it get its own mapping, which ``free`` returns to the
  kernel at once.
* The threshold starts at 128 KiB and is *dynamic*: freeing a mapped chunk
  larger than the threshold (up to 32 MiB on 64-bit Linux) raises the
  threshold to that chunk's size and the trim threshold to twice that. After
  the first step of a small model almost every tensor is below it, so the whole
  step runs in the heap.
* Freed heap chunks are coalesced with free neighbours and stay mapped and
  resident; only a free top of the heap larger than the trim threshold is given
  back. ``posix_memalign`` (torch aligns CPU tensors to 64 bytes) over-allocates
  and frees the unaligned lead and the tail; those pieces (32-112 bytes) go to
  the thread's tcache, where they stay allocated as far as coalescing goes
  (``posix_memalign`` never takes from the tcache before glibc 2.38), so freed
  tensor chunks next to them cannot merge, and a later, larger allocation that
  fits no hole extends the heap.

So the resident peak of a step is not the largest sum of live tensors but the
number of heap pages the step touched (plus its live mappings), which depends on
the order and sizes of every allocation.

This module replays one step's allocation sequence through a small model of
that policy:

* the sequence (``_events.step_events``): every storage the model's forward
  and backward allocate and free, traced on the meta device at tensor
  granularity (``[Note: the allocation trace]``), with fsdp_compose's own
  buffers inserted at the unit boundaries (all-gather output, then the unsharded
  storage it is copied into; the post-forward shard of an int
  ``reshard_after_forward``; unsharded gradients freed at the unit's
  post-backward; the reduce-scatter's packed input and gloo receive buffer,
  freed when the next reduction starts, and its output, kept to the end of
  backward), and AdamW's two temporaries per parameter in the optimizer step.
  fsdp_compose's own buffers from 128 KiB on are not in the heap
  (``[Note: per-step host buffers outside the heap]`` in
  ``fsdp_compose/_host_memory.py``) unless in the heap mode: in the pooled mode, replayed
  through the pool's policy (a freed buffer stays resident for the next request
  of its size, across steps; a resharded unit's pages are parked for the next
  refill of its size, one slot per size; above ``MAX_CACHED`` neither, a
  mapping each), in the mapped mode as mappings,
  resident exactly while alive; gloo's reduce-scatter receive buffer is pooled
  in the pooled mode and in the heap otherwise; autograd's gradients are in the
  heap;
* the allocator: ``posix_memalign(64)`` as glibc 2.36 serves it (request plus
  64 + 32 bytes, lead and tail split off to the tcache, 7 per size, then to
  fastbins, consolidated by the next large request or large free); best fit
  among free chunks (glibc's large bins are best fit), else the top, else a
  mapping when at or above the dynamic threshold, else the heap grows; freed
  chunks coalesce with free neighbours. A free top above the trim threshold is
  *not* given back during the step (``replay(trim_top=False)``), see below;
* resident = heap pages touched since the last ``malloc_trim(0)``, plus live
  mappings. The step is replayed twice: the first replay is
  the warm-up that raises the threshold and lays out the heap; then
  ``malloc_trim(0)`` (as the benchmark's reset does) releases every free page,
  and the peak is taken over the second replay.

On the estimator's own sequences this model (with top trimming) and glibc
itself (the same sequence replayed with ``posix_memalign``/``memset``/``free``
and mappings in a fresh process) agree within 10%
(``tests/test_plan.py::test_glibc_model_matches_glibc``: GPT at W=1 and 4, the
tied GPT at W=2); the estimator's sequence has the tensor allocations of a real
step (count and bytes, W=1 and 4).

Small allocations that are not tensors (C++ tensor and autograd bookkeeping,
collectives' work objects, Python objects over 512 bytes; about 13,000 and
1.4 MiB per step at W=2) are not replayed one by one, but two of their effects
decide the resident peak, and the model takes both into account:

* They are carved out of freed tensor chunks and keep them from coalescing,
  so a later buffer that no longer fits extends the heap. When fsdp_compose's
  per-unit buffers were in the heap this added 15-58% at W >= 2, varying from
  run to run (a rank's full ``malloc`` log replayed through glibc: 215 MiB above
  the reset, its tensor allocations alone 151 MiB; benchmarks/HISTORY.md). With those
  buffers on mappings of their own no freed chunk of theirs is left to carve.
* They are allocated from the top of the heap between the tensors, so the top
  is never free above the trim threshold while a step runs: a rank's resident
  set, sampled at every unit boundary of a step (benchmark GPT, W=4), only
  dropped when fsdp_compose unmapped a buffer, never by a heap trim. Replaying
  the tensors alone, glibc would trim the top after the logits and their
  gradients are freed, and the model would miss the backward's peak (14% low
  for that case); so the estimator replays with ``trim_top=False``.
  ``tests/test_plan.py::test_glibc_model_matches_glibc`` compares the model
  with trimming against glibc on the tensor sequence alone.

Not modelled: the sharded state's placement (allocated before the step and live
throughout; counted separately), threads other than the training thread (gloo's
use their own arenas).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._host_memory import MAX_CACHED, PARKED_PER_SIZE

PAGE = 4096
MMAP_THRESHOLD_START = 128 * 1024
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD_START = 128 * 1024
TOP_PAD = 128 * 1024  # M_TOP_PAD's default: kept when the top is trimmed
ALIGNMENT = 64  # c10's alignment for CPU tensors
MINSIZE = 32
MAX_FAST = 128  # default M_MXFAST on 64-bit
TCACHE_COUNT = 7
TCACHE_MAX = 1032  # the largest chunk the tcache takes (64 bins)
FASTBIN_CONSOLIDATION_THRESHOLD = 64 * 1024

OWN_MAPPING = -2  # address of a buffer mapped by fsdp_compose itself (-1: by glibc)
POOLED = -3  # address of a buffer from fsdp_compose's host-buffer pool
PAGES = -4  # address of a unit's unsharded storage whose pages the pool parks

#: Allocator modes :func:`~fsdp_compose.plan.estimate` knows (``host_allocator``).
HOST_ALLOCATORS = ("glibc", "glibc+pooled", "glibc+mapped", "mmap")


def _chunk(nbytes: int) -> int:
    """glibc's chunk size for a request: header + data rounded to 16, at least 32."""
    return max(32, (nbytes + 8 + 15) & ~15)


@dataclass
class GlibcHeap:
    """A best-fit heap with glibc's dynamic mmap threshold and top trimming.

    Addresses are offsets from the heap start. ``resident`` is the touched heap
    bytes (whole pages) plus the live mapped bytes. ``trim_top=False``: a free
    top is never given back between ``malloc_trim`` calls (see ``replay``).
    """

    trim_top: bool = True

    mmap_threshold: int = MMAP_THRESHOLD_START
    trim_threshold: int = TRIM_THRESHOLD_START
    top: int = 0  # end of the used heap (chunks above are the free top)
    brk: int = 0  # end of the heap as mapped (top chunk end)
    free_addrs: list[int] = field(default_factory=list)  # sorted starts of free chunks below top
    free_size: dict[int, int] = field(default_factory=dict)
    used: dict[int, tuple[int, int]] = field(
        default_factory=dict
    )  # key -> (addr, size); addr -1: mapped
    mapped: int = 0
    pages: bytearray = field(default_factory=bytearray)
    touched: int = 0  # bytes of touched heap pages
    tcache: dict[int, list[int]] = field(default_factory=dict)
    fastbins: list[tuple[int, int]] = field(default_factory=list)
    pool_free: dict[int, int] = field(default_factory=dict)  # page-rounded size -> cached
    parked: dict[int, int] = field(default_factory=dict)  # size -> slots holding pages

    @property
    def resident(self) -> int:
        return self.touched + self.mapped

    def _touch(self, start: int, end: int) -> None:
        first, last = start // PAGE, (end + PAGE - 1) // PAGE
        if last > len(self.pages):
            self.pages.extend(bytes(last - len(self.pages)))
        fresh = (last - first) - self.pages.count(1, first, last)
        if fresh:
            self.pages[first:last] = b"\x01" * (last - first)
            self.touched += fresh * PAGE

    def _release(self, start: int, end: int) -> None:
        """Gives whole pages inside ``[start, end)`` back (madvise / trim)."""
        first, last = (start + PAGE - 1) // PAGE, min(end // PAGE, len(self.pages))
        if last > first:
            self.touched -= self.pages.count(1, first, last) * PAGE
            self.pages[first:last] = bytes(last - first)

    def malloc(self, key: Any, nbytes: int) -> None:
        """``posix_memalign(64, nbytes)`` as torch's CPU allocator calls it."""
        if nbytes <= 0:
            return
        nb = _chunk(nbytes)
        size = _chunk(nb + ALIGNMENT + MINSIZE)  # _int_memalign over-allocates, then splits
        self._consolidate()  # a large request first consolidates the fastbins
        taken = self._take(size)
        if taken is not None:
            addr, size = taken
        else:
            if size >= self.mmap_threshold and self.brk - self.top < size + MINSIZE:
                mapped = (size + PAGE - 1) // PAGE * PAGE
                self.used[key] = (-1, mapped)
                self.mapped += mapped
                return
            addr = self.top
            self.top += size
            self.brk = max(self.brk, self.top)
        # the aligned chunk inside; the lead and tail pieces are freed at once
        lead = 0
        if (addr + 16) % ALIGNMENT:
            lead = (addr + 16 + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT - 16 - addr
            if lead < MINSIZE:
                lead += ALIGNMENT
        tail = size - lead - nb
        if tail < MINSIZE:
            nb, tail = nb + tail, 0
        self.used[key] = (addr + lead, nb)
        self._touch(addr + lead, addr + lead + nb)
        if lead:
            self._free_small(addr, lead)
        if tail:
            self._free_small(addr + lead + nb, tail)

    def map(self, key: Any, nbytes: int) -> None:
        """A buffer on an anonymous mapping of its own (not glibc's): resident
        while alive (its pages are all written), gone when freed."""
        pages = (nbytes + PAGE - 1) // PAGE * PAGE
        self.used[key] = (OWN_MAPPING, pages)
        self.mapped += pages

    def pooled(self, key: Any, nbytes: int) -> None:
        """A buffer from fsdp_compose's pool (``_host_memory.BufferPool``): a cached
        buffer of the same page-rounded size if there is one (already resident),
        else a new mapping. Freed, it stays resident in the pool, also across
        ``malloc_trim``, up to ``MAX_CACHED`` bytes (a larger one is unmapped)."""
        self._reuse_or_map(key, nbytes, POOLED, self.pool_free)

    def unsharded(self, key: Any, nbytes: int) -> None:
        """A unit's unsharded storage refilled in the pooled mode: pages parked by
        an earlier reshard of the same size move in (already resident), else they
        fault in. Freed (resharded), its pages are parked while fewer than
        ``PARKED_PER_SIZE`` slots of the size hold some, else given back."""
        self._reuse_or_map(key, nbytes, PAGES, self.parked)

    def _reuse_or_map(self, key: Any, nbytes: int, kind: int, cached: dict[int, int]) -> None:
        """Takes one of ``cached``'s resident sets of the page-rounded size, else maps
        (and touches) a new one; above ``MAX_CACHED`` a mapping that leaves when
        freed, as in the mapped mode."""
        pages = (nbytes + PAGE - 1) // PAGE * PAGE
        if pages > MAX_CACHED:  # the pool keeps none of this size: a mapping of its own
            self.map(key, nbytes)
            return
        self.used[key] = (kind, pages)
        if cached.get(pages, 0):
            cached[pages] -= 1
        else:
            self.mapped += pages

    def _take(self, size: int) -> tuple[int, int] | None:
        """Best fit among the free chunks below the top (glibc's bins)."""
        best = -1
        for addr in self.free_addrs:
            s = self.free_size[addr]
            if s >= size and (best < 0 or s < self.free_size[best]):
                best = addr
                if s == size:
                    break
        if best < 0:
            return None
        s = self.free_size.pop(best)
        self.free_addrs.remove(best)
        if s - size >= MINSIZE:
            self._add_free(best + size, s - size)
        else:
            size = s  # too small a remainder to split: it stays with the chunk
        return best, size

    def _free_small(self, addr: int, size: int) -> None:
        """A piece ``posix_memalign`` split off (at most 112 bytes): the thread's
        tcache (7 per size) keeps it, in use as far as coalescing goes; beyond
        that a fastbin holds it until the next consolidation. ``posix_memalign``
        never takes from the tcache (glibc < 2.38), so for tensors these stay."""
        bin_ = self.tcache.setdefault(size, [])
        if len(bin_) < TCACHE_COUNT:
            bin_.append(addr)
        else:
            self.fastbins.append((addr, size))

    def _consolidate(self) -> None:
        fast, self.fastbins = self.fastbins, []
        for addr, size in fast:
            self._release_chunk(addr, size)

    def free(self, key: Any) -> None:
        entry = self.used.pop(key, None)
        if entry is None:
            return
        addr, size = entry
        if addr == POOLED:
            self.pool_free[size] = self.pool_free.get(size, 0) + 1
            return
        if addr == PAGES:
            if self.parked.get(size, 0) < PARKED_PER_SIZE:
                self.parked[size] = self.parked.get(size, 0) + 1
            else:
                self.mapped -= size
            return
        if addr == OWN_MAPPING:
            self.mapped -= size
            return
        if addr < 0:
            self.mapped -= size
            if self.mmap_threshold < size <= MMAP_THRESHOLD_MAX:
                self.mmap_threshold = size
                self.trim_threshold = 2 * size
            return
        if size <= TCACHE_MAX and len(self.tcache.get(size, ())) < TCACHE_COUNT:
            self.tcache.setdefault(size, []).append(addr)
            return
        if size <= MAX_FAST:
            self.fastbins.append((addr, size))
            return
        self._release_chunk(addr, size)
        if size >= FASTBIN_CONSOLIDATION_THRESHOLD:
            self._consolidate()
            if self.trim_top and self.brk - self.top > self.trim_threshold:
                self._release(self.top + TOP_PAD, self.brk)
                self.brk = self.top + TOP_PAD

    def _release_chunk(self, addr: int, size: int) -> None:
        """Coalesces a freed chunk with its free neighbours (or the top)."""
        # coalesce with the free chunk before and after
        i = bisect.bisect_left(self.free_addrs, addr)
        if i > 0:
            prev = self.free_addrs[i - 1]
            if prev + self.free_size[prev] == addr:
                addr, size = prev, size + self.free_size.pop(prev)
                self.free_addrs.pop(i - 1)
                i -= 1
        if i < len(self.free_addrs) and self.free_addrs[i] == addr + size:
            nxt = self.free_addrs.pop(i)
            size += self.free_size.pop(nxt)
        if addr + size == self.top:  # joins the top chunk
            self.top = addr
            return
        self._add_free(addr, size)

    def _add_free(self, addr: int, size: int) -> None:
        bisect.insort(self.free_addrs, addr)
        self.free_size[addr] = size

    def malloc_trim(self) -> None:
        """``malloc_trim(0)``: every whole free page leaves the resident set."""
        self._consolidate()
        for addr in self.free_addrs:
            self._release(addr, addr + self.free_size[addr])
        self._release(self.top, self.brk)
        self.brk = self.top


def replay(
    events: Sequence[tuple[Any, ...]], passes: int = 2, *, trim_top: bool = False
) -> tuple[int, str]:
    """Replays ``events`` (``("a", key, nbytes)``: ``posix_memalign``; ``("map", key,
    nbytes)``: a mapping of fsdp_compose's own; ``("pool", key, nbytes)``: a buffer
    from its pool, ``("pages", key, nbytes)``: a unit's unsharded storage whose
    pages the pool parks (the pool keeps what the first pass left in it);
    ``("f", key)``, ``("m", where)``)
    ``passes`` times, with ``malloc_trim(0)`` before the last pass.

    ``trim_top``: whether a free top above the trim threshold is given back
    during the step, as glibc does for a sequence of tensors alone. The
    estimator replays without it: in a real step, objects too small to trace
    are allocated from the top between the tensors and keep it from shrinking
    (``[Note: resident memory under glibc's default allocator]``).

    Returns:
        (the largest resident bytes of the last pass, the last mark before it).
    """
    heap = GlibcHeap(trim_top=trim_top)
    peak, at, where = -1, "", ""
    for n in range(passes):
        last = n == passes - 1
        if last:
            heap.malloc_trim()
        for ev in events:
            kind = ev[0]
            if kind in ("a", "map", "pool", "pages"):
                if kind == "a":
                    heap.malloc((n, ev[1]), ev[2])
                elif kind == "map":
                    heap.map((n, ev[1]), ev[2])
                elif kind == "pool":
                    heap.pooled((n, ev[1]), ev[2])
                else:
                    heap.unsharded((n, ev[1]), ev[2])
                if last and heap.resident > peak:
                    peak, at = heap.resident, where
            elif kind == "f":
                heap.free((n, ev[1]))
            else:
                where = ev[1]
        left = [k for k in heap.used if isinstance(k, tuple) and k[0] == n]
        for key in left:  # whatever the step left behind
            heap.free(key)
    return max(peak, 0), at
