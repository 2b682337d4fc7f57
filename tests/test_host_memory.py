"""Per-step host buffers outside glibc's heap ([Note: per-step host buffers outside
the heap] in ``fsdp_compose/_host_memory.py``): resident while alive, gone from the
resident set when freed (or released), whatever the heap's state."""

from __future__ import annotations

import sys

import pytest
import torch

from fsdp_compose import _host_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")

MIB = 2**20
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _mapped() -> object:
    """These tests are about the opt-in mapped buffers (``set_host_buffers("mapped")``)."""
    previous = _host_memory.enabled()
    _host_memory.set_enabled(True)
    yield
    _host_memory.set_enabled(previous)


def test_heap_by_default() -> None:
    _host_memory.set_enabled(False)
    assert not _host_memory.PageBackedBuffer.wanted(2**30, torch.uint8, CPU)
    assert _host_memory.empty(2**20, torch.uint8, CPU)._base is None


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


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


def _parity_job() -> dict:
    import copy

    from gpt import GPT, GPTConfig, loss_fn
    from helpers import gpt_batches, train_side_by_side

    from fsdp_compose import fully_shard
    from fsdp_compose.plan import set_host_buffers

    set_host_buffers("mapped")
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=128)
    ref = GPT(cfg)
    model = copy.deepcopy(ref)
    fully_shard(model.blocks[0])  # resharded after forward: released and refilled
    fully_shard(model.blocks[1], reshard_after_forward=False)
    fully_shard(model)
    parity = train_side_by_side(model, ref, 3, gpt_batches(cfg), loss_fn)
    units = model._fsdp_state().scheduler.units
    set_host_buffers("heap")
    return {
        **parity,
        "page_backed": [u.name for u in units if u._pages is not None],
    }


def test_training_parity_with_page_backed_units() -> None:
    """Units whose buffers are on mappings of their own train as one process does."""
    from dist_utils import run_distributed

    for r in run_distributed(_parity_job, 2):
        assert r["page_backed"] == ["blocks.0", "blocks.1"], r["page_backed"]
        assert max(r["loss_diffs"]) <= 1e-5, r["loss_diffs"]
        assert r["param_diff"] <= 1e-4, (r["param_diff"], r["where"])
