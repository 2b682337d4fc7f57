"""Per-step host buffers on mappings of their own, outside glibc's heap (opt-in).

An extension: while enabled it is the core's source of large per-step CPU buffers
(``_flat_buffer.set_host_buffers``).

[Note: per-step host buffers outside the heap]
On CPU, every step allocates and frees fsdp_compose's large buffers once per unit:
the all-gather output, the unsharded parameters' storage, the reduce-scatter's
packed input and output. With glibc's default settings these land in the heap
(the dynamic mmap threshold rises to the largest freed tensor, up to 32 MiB), and
a freed buffer stays resident. Small objects the interpreter, autograd and the
collectives allocate meanwhile are carved out of such a freed chunk and keep it
from coalescing, so the next buffer, which no longer fits the hole, extends the
heap: the resident peak grows with every unit and depends on timing (the same
four-rank step measured 234-287 MiB). The CUDA caching allocator keeps FSDP2's
buffers out of such interleaving on GPU.

So buffers from :data:`MIN_BYTES` on get a private anonymous mapping each, as
glibc itself serves large requests before its threshold rises: resident while
alive and written, unmapped when the last reference goes, so they never share
pages with the interpreter's objects. The unsharded storage must keep its
identity (autograd saves views of it; see [Note: unsharded storage] in
``_flat_buffer.py``): it is one mapping per unit for the unit's life, whose pages
are given back (``MADV_DONTNEED``) when the unit reshards and fault in again when
the next all-gather is copied into it. The heap is then left to what a
one-rank step also allocates (activations, autograd's gradients), and
``fsdp_compose.plan.estimate`` replays these buffers as mappings.

The price is the first write to each page of a fresh mapping (the kernel zeroes
it): large buffers ask for transparent huge pages to keep that small, and buffers
below :data:`MIN_BYTES`, where the system call would show, stay in the heap. Even
so it measured 6.5% of the small benchmark preset's training step at W=2
(``benchmarks/exchange_cost.py``-style A/B in one process), so it is opt-in:
``fsdp_compose.plan.set_host_buffers("mapped")`` or
``FSDP_COMPOSE_HOST_BUFFERS=mapped`` (:func:`set_enabled`); by default the buffers
stay in the heap.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

from . import _flat_buffer

_enabled = False


def set_enabled(enabled: bool) -> None:
    """Puts later per-step host buffers on mappings of their own (see the Note)."""
    global _enabled
    _enabled = enabled
    _flat_buffer.set_host_buffers(_MAPPED if enabled else None)


def enabled() -> bool:
    return _enabled


#: Host buffers of at least this many bytes get their own mapping (glibc's own
#: initial mmap threshold).
MIN_BYTES = 128 * 1024
_HUGE_PAGE = 2 * 1024 * 1024  # x86-64's transparent huge page


def _outside_heap(nbytes: int, device: torch.device) -> bool:
    # Not under a dispatch mode (fake tensors, tracing, memory trackers): those must
    # see the allocation, and torch.frombuffer bypasses them.
    return (
        _enabled
        and device.type == "cpu"
        and nbytes >= MIN_BYTES
        and torch._C._len_torch_dispatch_stack() == 0
    )


def empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(numel)``; on CPU from :data:`MIN_BYTES` on a private
    anonymous mapping, unmapped when the tensor's storage is freed."""
    nbytes = numel * dtype.itemsize
    if not _outside_heap(nbytes, device):
        return torch.empty(numel, dtype=dtype, device=device)
    mapping, offset = _private_mapping(nbytes)
    return torch.frombuffer(mapping, dtype=dtype, count=numel, offset=offset)


def _private_mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping and the offset of the ``nbytes`` buffer in it.

    Private: Python's default for anonymous maps is MAP_SHARED, whose pages live
    on in shared memory after ``MADV_DONTNEED`` (and across fork). From 2 MiB on,
    the buffer starts on a 2 MiB boundary, the mapping ends where the buffer does,
    and it is marked for transparent huge pages: the kernel faults it in (and
    zeroes it) 2 MiB at a time instead of 4 KiB (a third of the CPU time per
    buffer here), and no huge page reaches past the buffer, so the resident
    bytes are still the bytes written.
    """
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < _HUGE_PAGE or advice is None:
        return mmap.mmap(-1, nbytes, flags=flags), 0
    mapping = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=flags)
    view = ctypes.c_char.from_buffer(mapping)
    offset = -ctypes.addressof(view) % _HUGE_PAGE
    del view  # an exported buffer forbids the resize
    try:
        mapping.resize(offset + nbytes)
        mapping.madvise(advice)
    except (OSError, SystemError):  # no mremap, or a kernel without huge pages
        pass  # 4 KiB pages: slower faults, the same resident bytes
    return mapping, offset


comm_buffer = _flat_buffer.comm_buffer


class PageBackedBuffer:
    """A flat CPU tensor on a mapping of its own whose pages :meth:`release`
    gives back to the kernel while the tensor (and every view of it) stays valid;
    the next writes fault fresh zeroed pages in."""

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        self._map, offset = _private_mapping(numel * dtype.itemsize)
        self.tensor = torch.frombuffer(self._map, dtype=dtype, count=numel, offset=offset)

    @staticmethod
    def wanted(numel: int, dtype: torch.dtype, device: torch.device) -> bool:
        return _outside_heap(numel * dtype.itemsize, device)

    def release(self) -> None:
        self._map.madvise(mmap.MADV_DONTNEED)


class _Mapped:
    """The core's host buffers (``_flat_buffer.HostBuffers``) while enabled."""

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        return (
            empty(numel, dtype, device) if _outside_heap(numel * dtype.itemsize, device) else None
        )

    def page_backed(
        self, numel: int, dtype: torch.dtype, device: torch.device
    ) -> PageBackedBuffer | None:
        return (
            PageBackedBuffer(numel, dtype)
            if PageBackedBuffer.wanted(numel, dtype, device)
            else None
        )


_MAPPED = _Mapped()
