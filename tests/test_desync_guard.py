"""Desyncs end as Python exceptions on every rank: no rank is aborted inside
gloo, and no rank consumes another unit's data.

* Default mode: fsdp_compose's gloo collectives are exchanges matched by what
  they are ([Note: collectives matched by what they are]), so mismatched ranks
  wait instead of mis-pairing, and the stall watchdog ends the wait with a
  ``CollectiveMismatchError`` on every rank ([Note: stalled exchanges]); the
  group is closed, so each case runs on a group of its own.
* With the collective guard on (``debug.enable_collective_guard()``): the error
  is raised before the mismatched collective is issued, so the process group
  stays usable and the next case reuses it (the guard starts a fresh lane, see
  [Note: collective guard]); each case catches the error inside the job and
  returns it, then both ranks call ``reset_iter_state()``.
* The structure check at the first forward catches settings that differ.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from gpt import GPT, GPTConfig, loss_fn, make_batch
from helpers import GUARDED, rank_world
from models import TINY_GPT
from torch import nn

from fsdp_compose import MixedPrecisionPolicy, _guard, _stall, fully_shard
from fsdp_compose.debug import CollectiveMismatchError, enable_collective_guard

TINY = TINY_GPT


class _Net(nn.Module):
    """GPT whose forward may skip a block or run the blocks in another order."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(GPTConfig(**TINY))

    def forward(self, x: torch.Tensor, order: tuple[int, ...] = (0, 1, 2)) -> torch.Tensor:
        g = self.gpt
        h = g.tok_emb(x) + g.pos_emb(torch.arange(x.size(1)))
        for i in order:
            h = g.blocks[i](h)
        return g.lm_head(g.ln_f(h))


def _net(block_policy_on_rank1: MixedPrecisionPolicy | None = None, **kwargs) -> _Net:
    rank, _ = rank_world()
    torch.manual_seed(0)
    model = _Net()
    for i, block in enumerate(model.gpt.blocks):
        mp = (
            block_policy_on_rank1
            if (rank == 1 and i == 0 and block_policy_on_rank1)
            else MixedPrecisionPolicy()
        )
        fully_shard(block, mp_policy=mp, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _bad_batch(*_: object) -> None:
    raise ValueError("bad batch")


def _desync_case(case: str, recover: bool = False) -> tuple[str, list[str], float | None]:
    """Runs 3 steps with a desync on rank 1 (or 0) at step 1; returns the error,
    the data collectives this rank really issued, and (``recover``) the loss of
    one more step that every rank runs alike after the error."""
    previous = _guard.enabled
    enable_collective_guard()
    _guard.launched = []
    try:
        message, model = _desync_steps(case)
        launched = list(_guard.launched)
        loss = None
        if recover:
            x, y = make_batch(GPTConfig(**TINY), 2, 5)
            loss_t = loss_fn(model(x), y)
            loss_t.backward()
            loss = loss_t.item()
        return message, launched, loss
    finally:
        _guard.launched = None
        enable_collective_guard(previous)


def _desync_steps(case: str, **kwargs: Any) -> tuple[str, nn.Module]:
    rank, _ = rank_world()
    cfg = GPTConfig(**TINY)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if case == "mp_policy" else None
    model = _net(mp, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if case == "same_size_reduce_scatter":
        # No all-gather after the first step: only the reduce-scatters (all of
        # blocks' the same size) can go out of order.
        model.set_reshard_after_forward(False)
        model.set_reshard_after_backward(False)
    try:
        for step in range(3):
            x, y = make_batch(cfg, 2, step)
            odd = step == 1 and rank == 1
            if case == "requires_grad" and odd:
                model.gpt.blocks[1].attn.q.bias.requires_grad_(False)
            if case == "unshard_one_rank" and odd:
                model.gpt.blocks[2].unshard()
            if case == "skip_batch" and step == 1 and rank == 0:
                # A batch that fails inside forward on one rank, recovered and
                # skipped there only.
                handle = model.gpt.blocks[1].register_forward_pre_hook(_bad_batch)
                try:
                    model(x)
                except ValueError:
                    model.reset_iter_state()
                    continue
                finally:
                    handle.remove()
            order = (0, 1, 2)
            if case == "skip_block" and odd:
                order = (0, 2)
            elif case == "same_size_reduce_scatter" and odd:
                order = (0, 2, 1)  # the same units, another order
            logits = model(x, order)
            loss_fn(logits, y).backward()
            if case != "same_size_reduce_scatter":
                opt.step()
            opt.zero_grad()
    except (CollectiveMismatchError, RuntimeError) as exc:
        message = f"{type(exc).__name__}: {exc}"
        model.reset_iter_state()
        dist.barrier()
        return message, model
    return "no error", model


CASES = [
    "skip_block",
    "requires_grad",
    "skip_batch",
    "unshard_one_rank",
    "mp_policy",
    "same_size_reduce_scatter",
]


@pytest.mark.parametrize("case", CASES)
def test_desync_raises_on_every_rank(case: str) -> None:
    results = run_distributed(_desync_case, 2, case, timeout=90)
    messages = [message for message, _, _ in results]
    # No rank consumed another unit's data: the data collectives the ranks really
    # issued pair one to one (same unit, kind, size, dtype and step).
    launched = [issued for _, issued, _ in results]
    assert launched[0] == launched[1], launched
    # (mp_policy is caught at the first forward, before any collective)
    assert bool(launched[0]) == (case != "mp_policy"), launched
    for rank, message in enumerate(messages):
        if case == "mp_policy":  # caught at the first forward, naming the unit's setting
            assert "built different models" in message, message
            assert "unit 'gpt.blocks.0': mp_policy.param_dtype=" in message, message
        else:
            assert message.startswith(
                "CollectiveMismatchError: fsdp_compose collective mismatch"
            ), (
                rank,
                message,
            )
            assert "caught before any data moved" in message, message
    if case == "same_size_reduce_scatter":
        assert "reduce_scatter for gpt.blocks." in messages[0], messages[0]


def _transfer_under_way() -> str:
    """Rank 0 closes its connections right after it began sending 64 MiB to rank
    1, whose receive was already posted. gloo does not wake a receive whose
    message was cut off part-way (it waits for the group's timeout, here 5 s): the
    grace before closing lets the transfer finish. Returns how rank 1's wait ended
    (rank 0's own wait fails: its group is closed)."""
    from datetime import timedelta

    from fsdp_compose import _gloo

    rank, _ = rank_world()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=5))
    peers = _gloo.GlooRoute(group).peers
    numel = 16 * 2**20
    tag = peers.tag("all_gather", "cut", numel, torch.float32, 0)
    received = torch.zeros(numel)
    recvs = [group.recv([received], 0, tag)] if rank == 1 else []
    dist.barrier()
    time.sleep(0.2)  # rank 1's receive is known to rank 0: the send starts at once
    sends = [group.send([torch.ones(numel)], 1, tag)] if rank == 0 else []
    if rank == 0:
        _stall.break_group(peers)
    name = ("all_gather", "cut", 0, numel, torch.float32)
    exchange = _gloo.Exchange(peers, tag, name, recvs, sends)
    try:
        exchange.wait()
    except RuntimeError:
        return "raised"
    return f"received {int(received.sum())} of {numel}"


def _close_after_a_peer_closed() -> str:
    """On three ranks, rank 0 closes its connections first; then rank 1 closes its
    own while it waits for a message from rank 2. Its connection to rank 0 is
    already closed, and a receive on a closed connection fails at once without
    closing any other: before ``break_group`` tried every peer, rank 1's wait on
    rank 2 stayed open until the group's timeout (here 20 s). Returns how rank 1's
    wait ended, and when."""
    from datetime import timedelta

    from fsdp_compose import _gloo

    rank, _ = rank_world()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=20))
    peers = _gloo.GlooRoute(group).peers
    pending = group.recv([torch.empty(1)], 2, 12345) if rank == 1 else None
    default, _stall.CLOSE_GRACE_S = _stall.CLOSE_GRACE_S, 0.0
    try:
        dist.barrier()
        if rank == 0:
            _stall.break_group(peers)
        dist.barrier()
        time.sleep(0.5)  # rank 1 has seen its connection to rank 0 close
        if pending is None:
            return "not waiting"
        _stall.break_group(peers)
    finally:
        _stall.CLOSE_GRACE_S = default
    start = time.monotonic()
    try:
        pending.wait()
        ended = "completed"
    except RuntimeError:
        ended = "raised"
    return f"{ended} after {time.monotonic() - start:.1f} s"


def _default_mode_case(case: str) -> str:
    """The desync ``case`` with the guard off (the default): the exchanges are
    matched by what they are, so the ranks wait instead of mis-pairing, and the
    stall watchdog ends the wait ([Note: stalled exchanges]). On a group of its
    own: the watchdog closes it."""
    from torch.distributed.device_mesh import DeviceMesh

    assert not _guard.enabled
    if case == "close_after_a_peer_closed":
        return _close_after_a_peer_closed()
    if case == "transfer_under_way":
        return _transfer_under_way()
    group = dist.new_group(backend="gloo")
    start = time.monotonic()
    message, _ = _desync_steps(case, mesh=DeviceMesh.from_group(group, "cpu"))
    return f"{message}\n[{time.monotonic() - start:.1f} s]"


_FRESH_RANKS = """
import json, os, sys, tempfile
from datetime import timedelta
import torch.distributed as dist, torch.multiprocessing as mp

def rank_main(rank, world, init_file, cases, out):
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    import test_desync_guard
    messages = [test_desync_guard._default_mode_case(case) for case in cases]
    with open(f"{out}.{rank}", "w") as f:
        json.dump(messages, f)
    dist.barrier()

if __name__ == "__main__":
    world, cases, out = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
    mp.spawn(rank_main, args=(world, tempfile.mktemp(), cases, out), nprocs=world)
"""


def _in_fresh_ranks(tmp_path: Path, world: int, cases: list[str]) -> list[list[str]]:
    """Runs the default-mode ``cases`` on ``world`` fresh processes: a closed group
    must not reach the test pool's later jobs (torch may hand a closed group's
    connections to a later mesh of the same ranks)."""
    tests = Path(__file__).resolve().parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tests), str(tests.parent / "examples"), *sys.path])
    script, out = tmp_path / "fresh_ranks.py", tmp_path / "messages"
    script.write_text(_FRESH_RANKS)
    result = subprocess.run(
        [sys.executable, str(script), str(world), ",".join(cases), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(world)]


@pytest.mark.skipif(GUARDED, reason="the default (unguarded) mode")
def test_desync_in_default_mode_raises_on_every_rank(tmp_path: Path) -> None:
    """Without the guard: every rank raises a CollectiveMismatchError that names
    what each side waits for (unit, kind and step), within seconds; no rank is
    aborted inside gloo."""
    cases = [c for c in CASES if c != "mp_policy"]
    per_rank = _in_fresh_ranks(tmp_path, 2, cases)
    for rank, messages in enumerate(per_rank):
        for case, message in zip(cases, messages):
            assert message.startswith(
                "CollectiveMismatchError: fsdp_compose collective mismatch"
            ), (case, rank, message)
            # names both sides: what (kind, unit, step) each rank waits for
            for side in (0, 1):
                pattern = rf"rank {side} waits for (all_gather|reduce_scatter) for \S+ \(step \d+, "
                assert re.search(pattern, message), (case, message)
            assert "The process group was closed" in message, (case, message)


@pytest.mark.skipif(GUARDED, reason="the default (unguarded) mode")
def test_desync_in_default_mode_at_four_ranks(tmp_path: Path) -> None:
    """At W=4 the ranks that were not part of the mismatch learn of it from the
    record the finder leaves, and end their waits too: every rank raises."""
    for rank, (message,) in enumerate(_in_fresh_ranks(tmp_path, 4, ["skip_block"])):
        assert message.startswith("CollectiveMismatchError: fsdp_compose collective mismatch"), (
            rank,
            message,
        )
        assert len(re.findall(r"rank \d waits for (all_gather|reduce_scatter) for ", message)) == 2


@pytest.mark.skipif(GUARDED, reason="the default (unguarded) mode")
def test_closing_lets_a_transfer_under_way_finish(tmp_path: Path) -> None:
    """A rank that closes its connections after a desync first lets the transfers
    already under way finish: the peer receives all of it instead of waiting for
    the group's timeout ([Note: stalled exchanges])."""
    cases = ["transfer_under_way"]
    (_, (message,)) = _in_fresh_ranks(tmp_path, 2, cases)
    assert message == f"received {16 * 2**20} of {16 * 2**20}", message


@pytest.mark.skipif(GUARDED, reason="the default (unguarded) mode")
def test_closing_reaches_every_connection_when_a_peer_closed_first(tmp_path: Path) -> None:
    """A rank closing its connections after a peer closed its own still closes all
    of them: its wait on a third rank ends at once, not at the group's timeout."""
    _, (message,), _ = _in_fresh_ranks(tmp_path, 3, ["close_after_a_peer_closed"])
    ended, seconds = re.fullmatch(r"(\w+) after ([\d.]+) s", message).groups()
    assert ended == "raised" and float(seconds) < 5, message


def _slow_peer_job() -> tuple[list[float], bool]:
    """Rank 1 is 2.5 s late for step 1 (well past the 1 s stall check): rank 0's
    wait is published and compared, but a late peer publishes nothing, so the step
    completes; what rank 0 published is withdrawn."""
    from torch.distributed.device_mesh import DeviceMesh

    from fsdp_compose import _stall

    rank, _ = rank_world()
    group = dist.new_group(backend="gloo")
    model = _net(mesh=DeviceMesh.from_group(group, "cpu"))
    losses = []
    for step in range(2):
        x, y = make_batch(GPTConfig(**TINY), 2, step)
        if step == 1 and rank == 1:
            time.sleep(2.5)
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.item())
    return losses, _stall.watch.published is None or _stall.watch.published[
        0
    ].peers.group is not group


def test_a_slow_peer_is_not_a_desync() -> None:
    (losses0, clean0), (losses1, clean1) = run_distributed(_slow_peer_job, 2, timeout=90)
    assert len(losses0) == len(losses1) == 2, (losses0, losses1)
    assert clean0 and clean1


def test_training_goes_on_after_a_desync_on_every_rank() -> None:
    """After the error and reset_iter_state() on every rank, the next step runs
    on a fresh guard lane and gives every rank the same loss."""
    results = run_distributed(_desync_case, 2, "skip_block", True, timeout=90)
    (message0, _, loss0), (message1, _, loss1) = results
    assert "collective mismatch" in message0 and "collective mismatch" in message1
    assert loss0 is not None and loss0 == loss1, (loss0, loss1)


def _reshard_setting_job() -> str:
    rank, _ = rank_world()
    try:
        model = _net(reshard_after_forward=rank == 0)
        x, _ = make_batch(GPTConfig(**TINY), 2, 0)
        model(x)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_reshard_setting_differing_between_ranks_is_caught_at_first_forward() -> None:
    for message in run_distributed(_reshard_setting_job, 2):
        assert "built different models" in message and "reshard_after_forward=" in message, message


def _replicas_job(same_seed: bool) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    rank, _ = rank_world()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0 if same_seed else rank)
    model = GPT(GPTConfig(**TINY))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x, _ = make_batch(GPTConfig(**TINY), 2, 0)
    try:
        model(x)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_hsdp_replicas_with_different_values_are_reported() -> None:
    for message in run_distributed(_replicas_job, 4, False):
        assert "HSDP replicas" in message and "hold different parameter values" in message, message
        assert "'blocks.0'" in message, message  # GPT is the root here
    assert run_distributed(_replicas_job, 4, True) == ["no error"] * 4


_EXIT_SCRIPT = """
import os, sys, tempfile, time
from datetime import timedelta
import torch.distributed as dist, torch.multiprocessing as mp

def rank_main(rank, init_file):
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=2, timeout=timedelta(seconds=300))
    import test_desync_guard
    from fsdp_compose import debug
    debug.enable_collective_guard()
    message, _ = test_desync_guard._desync_steps("skip_block")
    # one write per line: the ranks share the pipe, unbuffered under PYTHONUNBUFFERED
    os.write(1, f"{rank} {message.splitlines()[0]}\\n".encode())
    # exits with the guard's lanes (and maybe a fingerprint only this rank
    # issued) still alive: no destroy_process_group()

if __name__ == "__main__":
    mp.spawn(rank_main, args=(tempfile.mktemp(),), nprocs=2)
    print("clean exit", flush=True)
"""


def test_ranks_exit_promptly_after_a_desync(tmp_path: Path) -> None:
    """[Note: guard at interpreter exit]: processes that end right after the
    guard raised exit cleanly (no abort inside gloo), long before the process
    group's 300 s timeout (normally in seconds; the bound leaves room for load)."""
    tests = Path(__file__).resolve().parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tests), str(tests.parent / "examples"), *sys.path])
    script = tmp_path / "desync_then_exit.py"
    script.write_text(_EXIT_SCRIPT)
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=250,
        check=False,
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert f"{rank} CollectiveMismatchError: fsdp_compose collective mismatch" in result.stdout
    assert "clean exit" in result.stdout, result.stdout
    assert elapsed < 150, elapsed


def _train_job(guard: bool) -> tuple[list[float], list[torch.Tensor]]:
    previous = _guard.enabled
    enable_collective_guard(guard)
    try:
        model = _net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            x, y = make_batch(GPTConfig(**TINY), 2, step)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, [p.detach().full_tensor() for p in model.parameters()]
    finally:
        enable_collective_guard(previous)


def test_guarded_training_is_bit_identical_to_unguarded() -> None:
    """The guard only delays collectives (issued on a private group with the same
    ranks): training results do not change by a bit."""
    guarded = run_distributed(_train_job, 2, True)
    plain = run_distributed(_train_job, 2, False)
    for (losses_g, params_g), (losses_p, params_p) in zip(guarded, plain):
        assert losses_g == losses_p, (losses_g, losses_p)
        assert all(torch.equal(a, b) for a, b in zip(params_g, params_p))
