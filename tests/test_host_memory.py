"""Per-step host buffers outside glibc's heap ([Note: per-step host buffers outside
the heap] in ``fsdp_compose/_host_memory.py``): resident while alive, gone from the
resident set when freed (or released), whatever the heap's state; in the pooled
mode (the default) reused, never while in use, and unmapped on release."""

from __future__ import annotations

import itertools
import os
import sys
import time

import pytest
import torch
from helpers import GUARDED

import fsdp_compose  # noqa: F401  (sets the host buffers from FSDP_COMPOSE_HOST_BUFFERS)
from fsdp_compose import _flat_buffer, _host_memory

_MODE_AT_IMPORT, _SOURCE_AT_IMPORT = _host_memory.mode(), _flat_buffer.host_buffers

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")

MIB = 2**20
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _mapped() -> object:
    """Most tests here are about mappings of fsdp_compose's own (``"mapped"``; the
    pooled mode's buffers are those, reused)."""
    previous = _host_memory.mode()
    _host_memory.set_mode("mapped")
    yield
    _host_memory.set_mode(previous)


def test_pooled_by_default() -> None:
    # Bounded (MAX_CACHED, gradients in the heap), the pool's peak is not above the
    # heap's on the benchmark's large preset, and the estimate follows it (BENCHMARKS.md).
    if "FSDP_COMPOSE_HOST_BUFFERS" in os.environ:
        pytest.skip("FSDP_COMPOSE_HOST_BUFFERS is set")
    assert _MODE_AT_IMPORT == "pooled"
    assert _SOURCE_AT_IMPORT is _host_memory._POOLED


def test_heap_mode() -> None:
    _host_memory.set_mode("heap")
    assert not _host_memory.PageBackedBuffer.wanted(2**30, torch.uint8, CPU)
    assert _host_memory.empty(2**20, torch.uint8, CPU)._base is None
    with pytest.raises(ValueError, match="pooled"):
        _host_memory.set_mode("jemalloc")


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_pool_reuses_a_freed_buffer_of_the_same_size() -> None:
    pool = _host_memory.BufferPool()
    a = pool.empty(MIB, torch.float32)
    a.fill_(1.0)
    ptr = a.data_ptr()
    del a
    assert pool.cached_bytes() == 4 * MIB and pool.in_use_bytes() == 0
    b = pool.empty(MIB, torch.float32)  # the same pages, still written
    assert b.data_ptr() == ptr and pool.mappings == 1 and b[-1].item() == 1.0
    c = pool.empty(MIB - 1, torch.float32)  # another page-rounded size: its own mapping
    d = pool.empty(2 * MIB, torch.bfloat16)  # same bytes, other dtype: reused once b is freed
    assert pool.mappings == 3 and len({b.data_ptr(), c.data_ptr(), d.data_ptr()}) == 3
    del b
    e = pool.empty(2 * MIB, torch.bfloat16)
    assert e.data_ptr() == ptr and e.dtype == torch.bfloat16 and pool.mappings == 3
    del c, d, e


def test_pool_never_hands_out_a_buffer_in_use() -> None:
    """A buffer comes back only when the last view of its storage dies (a view
    kept by autograd or a collective keeps it out of the pool); buffers handed out
    at once never overlap; the pool holds at most as many as were in use at once."""
    pool = _host_memory.BufferPool()
    n = 64 * 1024
    live = [pool.empty(n, torch.float32) for _ in range(4)]
    spans = sorted((t.data_ptr(), t.data_ptr() + 4 * n) for t in live)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    kept = live[0][10:20].view(torch.int32)  # a view outlives its base tensor
    ptr0 = live[0].data_ptr()
    del live[0]
    fresh = pool.empty(n, torch.float32)
    assert fresh.data_ptr() != ptr0 and pool.mappings == 5
    fresh.fill_(7.0)
    assert kept.untyped_storage().data_ptr() == ptr0
    del kept
    again = pool.empty(n, torch.float32)
    assert again.data_ptr() == ptr0 and pool.mappings == 5
    live += [fresh, again]
    del fresh, again
    for _ in range(20):  # churn: no new mappings while at most 5 are in use
        live.pop(0)
        live.append(pool.empty(n, torch.float32))
    assert pool.mappings == 5
    del live
    assert pool.cached_bytes() == 5 * 4 * n


def test_pool_takes_back_buffers_freed_on_another_thread() -> None:
    import threading

    pool = _host_memory.BufferPool()
    box = [pool.empty(MIB, torch.uint8)]
    ptr = box[0].data_ptr()
    thread = threading.Thread(target=box.clear)
    thread.start()
    thread.join()
    assert pool.cached_bytes() == MIB and pool.empty(MIB, torch.uint8).data_ptr() == ptr


def test_release_unmaps_the_cached_buffers() -> None:
    from fsdp_compose.plan import release_host_buffers

    _host_memory.set_mode("pooled")
    bufs = [_host_memory._SOURCES["pooled"].empty(8 * MIB, torch.uint8, CPU) for _ in range(4)]  # type: ignore[union-attr]
    for b in bufs:
        assert b is not None
        b.fill_(1)
    del b
    before = _rss()
    bufs.clear()  # back to the pool: still resident
    assert _host_memory.POOL.cached_bytes() >= 32 * MIB
    assert _rss() > before - 8 * MIB
    assert release_host_buffers() >= 32 * MIB
    assert _host_memory.POOL.cached_bytes() == 0 and _rss() < before - 24 * MIB


def test_small_buffers_stay_ordinary_tensors() -> None:
    small = _host_memory.empty(16, torch.float32, CPU)
    assert small.shape == (16,) and small.dtype == torch.float32
    assert not _host_memory.PageBackedBuffer.wanted(16, torch.float32, CPU)
    assert _host_memory.PageBackedBuffer.wanted(_host_memory.MIN_BYTES, torch.uint8, CPU)
    assert not _host_memory.PageBackedBuffer.wanted(2**30, torch.uint8, torch.device("meta"))


def test_dispatch_modes_see_the_allocation() -> None:
    """Under fake tensors (or any dispatch mode) the buffers stay torch.empty's."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        assert isinstance(_host_memory.empty(2**20, torch.float32, CPU), FakeTensor)
        assert not _host_memory.PageBackedBuffer.wanted(2**20, torch.float32, CPU)


def test_large_buffer_leaves_the_resident_set_when_freed() -> None:
    numel = 64 * MIB // 2
    before = _rss()
    buf = _host_memory.empty(numel, torch.bfloat16, CPU)
    assert buf.shape == (numel,) and buf.dtype == torch.bfloat16 and buf.is_contiguous()
    assert _rss() - before < 8 * MIB  # nothing resident before it is written
    buf.fill_(1.5)
    view = buf[numel // 2 :]
    assert _rss() - before > 60 * MIB
    assert view.float().sum().item() == 1.5 * (numel - numel // 2)
    del buf
    assert _rss() - before > 60 * MIB  # a view keeps the storage (as torch.empty's)
    del view
    assert _rss() - before < 8 * MIB


def test_page_backed_buffer_releases_pages_and_keeps_views_valid() -> None:
    numel = 64 * MIB // 4
    pages = _host_memory.PageBackedBuffer(numel, torch.float32)
    flat = pages.tensor
    view = flat[1:].view(-1)  # what autograd may have saved
    before = _rss()
    flat.fill_(2.0)
    assert _rss() - before > 60 * MIB
    pages.release()
    assert _rss() - before < 8 * MIB
    assert view.untyped_storage().size() == numel * 4  # same storage, same size
    assert flat.abs().sum().item() == 0  # released pages read as zeros
    flat.fill_(3.0)  # and fault in again
    assert view[-1].item() == 3.0 and _rss() - before > 60 * MIB
    pages.release()


def test_comm_buffer_uses_a_custom_comms_allocate() -> None:
    calls: list[tuple[int, ...]] = []

    class Custom:
        def allocate(self, size, *, dtype, device):  # type: ignore[no-untyped-def]
            calls.append(tuple(size))
            return torch.zeros(size, dtype=dtype, device=device)

        def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise AssertionError("not called here")

    n = _host_memory.MIN_BYTES  # large enough for a mapping of fsdp_compose's own
    out = _host_memory.comm_buffer(Custom(), n, torch.uint8, CPU, "blocks.0", "all_gather")  # type: ignore[arg-type]
    assert calls == [(n,)] and out.numel() == n and out.abs().sum().item() == 0


def _let_gloo_workers_release() -> None:
    """With the collective guard on, the collectives are gloo's own: its worker
    thread drops its references to a collective's tensors a moment after the
    wait returns ([Note: gloo work at interpreter exit]), so a pooled buffer
    comes back a moment later."""
    if GUARDED:
        time.sleep(0.05)


def _parity_job(mode: str) -> dict:
    import copy

    from gpt import GPT, GPTConfig, loss_fn
    from helpers import gpt_batches, train_side_by_side

    from fsdp_compose import fully_shard
    from fsdp_compose.plan import set_host_buffers

    set_host_buffers(mode)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=128)
    ref = GPT(cfg)
    model = copy.deepcopy(ref)
    fully_shard(model.blocks[0])  # resharded after forward: released and refilled
    fully_shard(model.blocks[1], reshard_after_forward=False)
    fully_shard(model)
    mappings: list[int] = []  # the pool's mappings made so far, at each step's start
    parity = train_side_by_side(
        model,
        ref,
        3,
        gpt_batches(cfg),
        loss_fn,
        before_model=lambda step: (
            _let_gloo_workers_release(),
            mappings.append(_host_memory.POOL.mappings),
        ),
    )
    units = model._fsdp_state().scheduler.units
    mappings.append(_host_memory.POOL.mappings)
    set_host_buffers("pooled")
    return {
        "mappings": mappings,
        **parity,
        "page_backed": [u.name for u in units if u._pages is not None],
    }


@pytest.mark.parametrize("mode", ["pooled", "mapped"])
def test_training_parity_with_page_backed_units(mode: str) -> None:
    """Units whose buffers are on mappings of their own train as one process does;
    pooled, the buffers of a step are the first step's (no new mappings)."""
    from dist_utils import run_distributed

    for r in run_distributed(_parity_job, 2, mode):
        assert r["page_backed"] == ["blocks.0", "blocks.1"], r["page_backed"]
        made = r["mappings"]
        if mode == "pooled":
            assert made[1] > made[0] and made[1] == made[-1], made
        else:
            assert made[0] == made[-1], made
        assert max(r["loss_diffs"]) <= 1e-5, r["loss_diffs"]
        assert r["param_diff"] <= 1e-4, (r["param_diff"], r["where"])


def _exchange_job() -> tuple[int, int, bool]:
    import torch.distributed as dist

    from fsdp_compose import _collectives

    previous = _host_memory.mode()
    _host_memory.set_mode("pooled")
    try:
        pool = _host_memory.POOL
        route = _collectives.route_of(dist.group.WORLD)
        numel = 2**18  # 1 MiB of float32: from the pool
        base = pool.in_use_bytes()  # other tests' buffers in this reused rank process
        inp = pool.empty(numel, torch.float32).fill_(dist.get_rank() + 1.0)
        out = torch.empty(numel // 2)
        work = route.reduce_scatter(out, inp, dist.group.WORLD, "test", 0)
        work.wait()
        correct = bool((out == 3.0).all())
        del inp
        # The exchange object is still alive: it must not keep the input or its
        # receive buffer from going back to the pool.
        in_use = pool.in_use_bytes() - base
        del work
        return in_use, pool.in_use_bytes() - base, correct
    finally:
        _host_memory.set_mode(previous)


def test_waited_exchange_gives_its_buffers_back_to_the_pool() -> None:
    """gloo's exchanges drop the buffers they sent and received once waited, so a
    pooled buffer comes back when fsdp_compose drops it (the pool's contents are
    then the same every step), not when the exchange object is collected."""
    from dist_utils import run_distributed

    for in_use, after, correct in run_distributed(_exchange_job, 2):
        assert correct
        assert (in_use, after) == (0, 0), (in_use, after)


def test_pool_keeps_no_buffer_above_max_cached() -> None:
    """Above ``max_cached`` (by default glibc's largest mmap threshold, where the
    heap maps afresh too) a buffer is a mapping of its own, unmapped when freed,
    and its pages are never parked: the pool's cached bytes are all of sizes up
    to the bound."""
    assert _host_memory.BufferPool().max_cached == _host_memory.MAX_CACHED == 32 * MIB
    pool = _host_memory.BufferPool(max_cached=2 * MIB)
    big = pool.empty(16 * MIB // 4, torch.float32).fill_(1.0)  # 16 MiB: above the bound
    kept = pool.empty(2 * MIB // 4, torch.float32).fill_(1.0)  # 2 MiB: at the bound
    before = _rss()
    del big
    assert _rss() < before - 12 * MIB  # unmapped, not cached
    del kept
    assert pool.cached_bytes() == 2 * MIB and pool.in_use_bytes() == 0
    again = pool.empty(16 * MIB // 4, torch.float32)
    assert pool.mappings == 3 and pool.cached_bytes() == 2 * MIB
    del again
    pages = _host_memory.PageBackedBuffer(4 * MIB // 4, torch.float32)
    pages.tensor.fill_(1.0)
    assert not pool.park(pages.tensor.data_ptr(), 4 * MIB)  # the caller gives them back
    assert pool.cached_bytes() == 2 * MIB
    pages.release()


def test_replay_follows_the_pools_bound() -> None:
    """The estimate's replay of the pool (``plan/_heap.py``) keeps what the pool
    keeps: buffers and parked pages up to ``MAX_CACHED``, nothing above it."""
    from fsdp_compose.plan._heap import GlibcHeap

    heap = GlibcHeap()
    small, large = MIB, _host_memory.MAX_CACHED + MIB
    for kind in ("pooled", "unsharded"):
        for n, size in enumerate((small, large)):
            getattr(heap, kind)((kind, n), size)
    assert heap.resident == 2 * (small + large)
    for kind in ("pooled", "unsharded"):
        for n in range(2):
            heap.free((kind, n))
    assert heap.resident == 2 * small  # the small ones stay cached (parked)
    heap.pooled("again", large)
    assert heap.resident == 2 * small + large


def _gradients_job() -> tuple[int, int, float]:
    import torch.distributed as dist
    from gpt import GPT, GPTConfig, loss_fn
    from helpers import gpt_batches

    from fsdp_compose import fully_shard

    previous = _host_memory.mode()
    _host_memory.set_mode("pooled")
    try:
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=128)
        model = GPT(cfg)
        for block in model.blocks:  # 0.75 MiB each: reduce-scatter rows from the pool
            fully_shard(block)
        fully_shard(model)
        pool = _host_memory.POOL
        base = pool.in_use_bytes()  # other tests' buffers in this reused rank process
        x, y = gpt_batches(cfg)(0)
        x, y = x[dist.get_rank() :: 2], y[dist.get_rank() :: 2]
        loss_fn(model(x), y).backward()
        _let_gloo_workers_release()
        fresh = pool.in_use_bytes() - base  # the outputs became the gradients
        first = model.blocks[0].mlp.fc.weight.grad.to_local().clone()
        loss_fn(model(x), y).backward()  # accumulates: outputs from the pool, given back
        _let_gloo_workers_release()
        accumulated = pool.in_use_bytes() - base
        second = model.blocks[0].mlp.fc.weight.grad.to_local()
        return fresh, accumulated, float((second - 2 * first).abs().max())
    finally:
        _host_memory.set_mode(previous)


def test_reduce_scatter_output_that_becomes_the_gradient_is_not_pooled() -> None:
    """A reduce-scatter output that becomes the sharded ``.grad`` lives until
    ``zero_grad``: it comes from the heap, as autograd's gradients do, so the
    pool holds only per-step buffers (a pooled gradient kept the pool's buffers
    of its size unused from one backward to the next: 360 MiB per rank on the
    large benchmark preset at W=2). Accumulating steps take the output from the
    pool and give it back."""
    from dist_utils import run_distributed

    for fresh, accumulated, diff in run_distributed(_gradients_job, 2):
        assert (fresh, accumulated) == (0, 0), (fresh, accumulated)
        assert diff < 1e-5, diff
