"""Failures surface as clear errors within a bounded time, never as hangs or
silently wrong training; a failed step can be recovered from."""

from __future__ import annotations

import os
import signal
import time
import warnings

import pytest
import torch
import torch.nn as nn
from dist_utils import JobFailed, RankDied, get_pool, run_distributed
from gpt import GPT, GPTConfig, loss_fn, make_batch
from helpers import local_slice, rank_world, tensor_diff
from models import TINY_GPT

from fsdp_compose import debug, fully_shard
from fsdp_compose._runtime._unit import ShardState

TINY = TINY_GPT


def _sharded_gpt(cfg: GPTConfig | None = None, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(cfg or GPTConfig(**TINY))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


class _SkipOnRank(nn.Module):
    """Rank ``rank`` skips the middle block at ``step`` (a data-dependent branch)."""

    def __init__(self, gpt: GPT, rank: int, step: int) -> None:
        super().__init__()
        self.gpt, self.skip_rank, self.skip_step, self.step = gpt, rank, step, 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        g = self.gpt
        x = g.tok_emb(idx) + g.pos_emb(torch.arange(idx.size(1)))
        skip = self.step == self.skip_step and torch.distributed.get_rank() == self.skip_rank
        for i, block in enumerate(g.blocks):
            if not (i == 1 and skip):
                x = block(x)
        self.step += 1
        return g.lm_head(g.ln_f(x))


def _desync_job(debug_on: bool, uneven_batches: bool, debug_timeout: float | None = 5.0) -> None:
    rank, world = rank_world()
    torch.manual_seed(0)
    cfg = GPTConfig(**TINY)
    model = _SkipOnRank(GPT(cfg), rank=0, step=1 if not uneven_batches else -1)
    for block in model.gpt.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = 3 if rank == 0 or not uneven_batches else 4  # rank 1 has one batch more
    context = debug.collective_checks(model, timeout=debug_timeout) if debug_on else _nullcontext()
    with context:
        for step in range(steps):
            x, y = make_batch(cfg, 2, step)
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


def _run_expecting_failure(fn, *args, pg_timeout: float) -> tuple[str, float]:
    pool = get_pool(2, pg_timeout=pg_timeout)
    start = time.monotonic()
    with pytest.raises(JobFailed) as info:
        pool.run(fn, *args, timeout=120)
    return str(info.value), time.monotonic() - start


def test_desync_debug_mode_names_both_sides() -> None:
    message, elapsed = _run_expecting_failure(_desync_job, True, False, pg_timeout=30.0)
    assert "failed on ranks [0, 1]" in message, message
    for rank in (0, 1):
        section = message.split(f"--- rank {rank} ---")[1].split("--- rank")[0]
        assert "CollectiveMismatchError: fsdp_compose collective mismatch" in section, message
    # each rank's error names what every rank issued
    assert "rank 0 issued all_gather for gpt.blocks.0" in message
    assert "rank 1 issued all_gather for gpt.blocks.1" in message
    assert "float32, step 2)" in message
    assert elapsed < 15, elapsed


def test_uneven_batches_debug_mode_times_out_clearly() -> None:
    message, elapsed = _run_expecting_failure(_desync_job, True, True, pg_timeout=30.0)
    assert "ranks [0] issued no collective" in message and "uneven number of batches" in message, message
    assert elapsed < 25, elapsed


def test_debug_mode_waits_the_process_group_timeout_by_default() -> None:
    message, elapsed = _run_expecting_failure(_desync_job, True, True, None, pg_timeout=4.0)
    assert "ranks [0] issued no collective #" in message and "within 4s" in message, message
    assert elapsed < 4.0 + 20, elapsed


def test_uneven_batches_without_debug_fails_within_pg_timeout() -> None:
    """A rank that stops issuing collectives: the others' next collective fails
    within the process-group timeout, with a note naming the unit and step."""
    message, elapsed = _run_expecting_failure(_desync_job, False, True, 5.0, pg_timeout=5.0)
    assert "failed on ranks [1]" in message, message
    assert "fsdp_compose: all_gather for root (step 4) failed on rank 1" in message, message
    assert elapsed < 5.0 + 20, elapsed  # the process-group timeout, plus start-up slack


def _killed_rank_job() -> None:
    rank, world = rank_world()
    model = _sharded_gpt()
    cfg = GPTConfig(**TINY)
    if rank == 1:
        model.blocks[1].register_forward_pre_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL))
    for step in range(2):
        x, y = make_batch(cfg, 2, step)
        loss_fn(model(x), y).backward()


def test_killed_rank_surfaces_on_survivors() -> None:
    message, elapsed = _run_expecting_failure(_killed_rank_job, pg_timeout=20.0)
    assert "--- rank 1 ---\nrank process exited unexpectedly" in message or "rank process died" in message, message
    assert "fsdp_compose: all_gather for blocks.2 (step 1) failed on rank 0" in message, message
    assert elapsed < 20.0 + 10, elapsed


def _expect_message(fn, pattern: str) -> str:
    try:
        fn()
    except RuntimeError as exc:
        return "ok" if pattern in str(exc) else f"wrong message: {exc}"
    return "no error"


def _misuse_job() -> dict[str, str]:
    rank, world = rank_world()
    cfg = GPTConfig(**TINY)
    x, y = make_batch(cfg, 2, 0)
    out: dict[str, str] = {}

    def backward_after_step() -> None:
        model = _sharded_gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = loss_fn(model(x), y)
        loss.backward(retain_graph=True)
        opt.step()
        loss.backward()  # the graph's activations belong to the old parameters

    out["backward_after_step"] = _expect_message(
        backward_after_step, "modified (e.g. by optimizer.step()) after the forward"
    )

    def forward_after_failed_backward() -> None:
        model = _sharded_gpt()

        class _Boom(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):  # type: ignore[override]
                return t.view_as(t)

            @staticmethod
            def backward(ctx, g):  # type: ignore[override]
                raise RuntimeError("boom")

        handle = model.blocks[1].register_forward_pre_hook(lambda m, a: (_Boom.apply(a[0]),))
        loss = loss_fn(model(x), y)
        try:
            loss.backward()  # raises inside the unit's backward, after our hooks ran
        except RuntimeError as exc:
            assert "boom" in str(exc)
        handle.remove()
        loss_fn(model(x), y)  # without reset_iter_state()

    out["forward_after_failed_backward"] = _expect_message(
        forward_after_failed_backward, "Call reset_iter_state() on the root module"
    )

    # A second backward without retain_graph fails inside torch before any hook
    # runs: nothing to recover, the next step simply works.
    model = _sharded_gpt()
    loss = loss_fn(model(x), y)
    loss.backward()
    try:
        loss.backward()
    except RuntimeError as exc:
        assert "second time" in str(exc)
    loss_fn(model(x), y).backward()
    out["second_backward_then_step"] = "ok" if all(p.grad is not None for p in model.parameters()) else "no grads"

    def moved_to_meta() -> None:
        model = _sharded_gpt()
        model.to("meta")
        model(x)

    out["moved_to_meta"] = _expect_message(moved_to_meta, "moved there after fully_shard")

    model = _sharded_gpt()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.blocks[0].unshard()
        with torch.no_grad():
            model.blocks[0].mlp.fc.weight.mul_(2.0)
        model.blocks[0].reshard()
    out["inplace_warning"] = (
        "ok" if any("modified in place while unsharded" in str(w.message) for w in caught) else "no warning"
    )

    # retain_graph without an optimizer step in between is legitimate: gradients
    # accumulate exactly as in plain PyTorch
    model = _sharded_gpt()
    ref = GPT(GPTConfig(**TINY))
    torch.manual_seed(0)
    ref = GPT(GPTConfig(**TINY))
    loss = loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world))
    loss.backward(retain_graph=True)
    loss.backward()
    ref_loss = loss_fn(ref(x), y)
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    diff = max((p.grad.full_tensor() - r.grad).abs().max().item()
               for p, r in zip(model.parameters(), ref.parameters()))
    out["double_backward_accumulates"] = "ok" if diff < 1e-6 else f"grad diff {diff}"
    return out


def test_misuse_messages() -> None:
    for r in run_distributed(_misuse_job, 2):
        bad = {k: v for k, v in r.items() if v != "ok"}
        assert not bad, bad


def _structure_mismatch_job() -> None:
    rank, _ = rank_world()
    cfg = GPTConfig(**{**TINY, "n_embd": 32 if rank == 0 else 48})
    model = _sharded_gpt(cfg)
    x, _ = make_batch(cfg, 2, 0)
    model(x)


def _reshard_setting_job() -> str:
    rank, _ = rank_world()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=rank == 0)
    fully_shard(model)
    x, _ = make_batch(GPTConfig(**TINY), 2, 0)
    try:
        model(x)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_reshard_setting_differing_between_ranks_is_caught_at_first_forward() -> None:
    """Checked through the store at the root's lazy init: no collective is issued."""
    for message in run_distributed(_reshard_setting_job, 2):
        assert "built different models" in message and "reshard_after_forward" in message, message


def test_different_models_on_ranks() -> None:
    with pytest.raises(JobFailed) as info:
        run_distributed(_structure_mismatch_job, 2, timeout=60)
    message = str(info.value)
    for rank in (0, 1):
        section = message.split(f"--- rank {rank} ---")[1].split("--- rank")[0]
        assert "built different models" in section, message
    assert "parameter 'tok_emb.weight': shape (97, 32) torch.float32 vs 'tok_emb.weight' shape (97, 48)" in message


def _reset_job(fail_in: str | None) -> dict:
    """Trains 5 steps; with ``fail_in``, step 1 raises (on every rank) in forward or
    backward, is recovered with reset_iter_state(), and its batch is skipped."""
    rank, world = rank_world()
    cfg = GPTConfig(**TINY)
    model = _sharded_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    class _Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):  # type: ignore[override]
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            raise RuntimeError("boom in backward")

    state = {"armed": False}

    def hook(module, args):
        if not state["armed"]:
            return None
        state["armed"] = False
        if fail_in == "forward":
            raise RuntimeError("boom in forward")
        return (_Boom.apply(args[0]),)

    model.blocks[1].register_forward_pre_hook(hook)
    losses = []
    for step in range(5):  # 3 steps after the failed one
        x, y = make_batch(cfg, 2 * world, step)
        x, y = local_slice(x, rank, world), local_slice(y, rank, world)
        if step == 1:
            if fail_in is None:
                continue  # the reference run skips the failed batch
            state["armed"] = True
            try:
                loss_fn(model(x), y).backward()
            except RuntimeError as exc:
                assert "boom" in str(exc)
            opt.zero_grad()  # gradients of the failed step may be partly written
            model.reset_iter_state()
            scheduler = model._fsdp_state().scheduler
            units = scheduler.units
            assert all(u.state is ShardState.SHARDED and not u.gather_in_flight for u in units)
            assert all(
                u.buffer is None or u.buffer.unsharded is None or u.buffer.unsharded.untyped_storage().size() == 0
                for u in units
            )
            assert scheduler.memory.holding_bytes == 0 and not scheduler._reductions
            continue
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": [p.detach().full_tensor() for p in model.parameters()]}


@pytest.mark.parametrize("fail_in", ["forward", "backward"])
def test_reset_after_exception(fail_in: str) -> None:
    clean = run_distributed(_reset_job, 2, None)
    recovered = run_distributed(_reset_job, 2, fail_in)
    for a, b in zip(clean, recovered):
        assert len(b["losses"]) == 4 and a["losses"] == b["losses"]  # bit-identical, 3 steps after
        assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"])), [
            tensor_diff(p, q) for p, q in zip(a["params"], b["params"]) if not torch.equal(p, q)
        ]


def _determinism_job() -> dict:
    rank, world = rank_world()
    cfg = GPTConfig(**TINY)
    model = _sharded_gpt(seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(4):
        x, y = make_batch(cfg, 2 * world, step)
        loss = loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": [p.detach().full_tensor() for p in model.parameters()],
    }


def test_bit_identical_repeat_runs() -> None:
    first = run_distributed(_determinism_job, 4)
    second = run_distributed(_determinism_job, 4)
    for a, b in zip(first, second):
        assert a["losses"] == b["losses"]
        assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"])), [
            tensor_diff(p, q) for p, q in zip(a["params"], b["params"]) if not torch.equal(p, q)
        ]


def _dies(mark: str, times: int) -> int:
    """Rank 0's process dies the first ``times`` runs (counted in the file ``mark``)."""
    import torch.distributed as dist

    runs = os.path.getsize(mark) if os.path.exists(mark) else 0
    if dist.get_rank() == 0 and runs < times:
        with open(mark, "a") as f:
            f.write("x")
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return dist.get_rank()


def test_a_job_whose_rank_dies_runs_once_more_and_twice_fails(tmp_path) -> None:
    """The test harness's answer to a crashed rank ([Note: a rank that dies] in
    tests/dist_utils.py): one more run on a fresh pool, with a warning; a second
    crash fails the test."""
    with pytest.warns(RuntimeWarning, match="ran it once more"):
        assert run_distributed(_dies, 2, str(tmp_path / "once"), 1, timeout=60) == [0, 1]
    with pytest.raises(RankDied), pytest.warns(RuntimeWarning):
        run_distributed(_dies, 2, str(tmp_path / "twice"), 2, timeout=60)
