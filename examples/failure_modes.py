"""Trigger each failure fsdp_compose diagnoses and report how long it took to surface.

    python examples/failure_modes.py              # all scenarios, 2 CPU ranks
    python examples/failure_modes.py desync_debug # one scenario

Each scenario runs in fresh processes (a failed collective leaves a process group
unusable; forked, so a scenario starts in well under a second). For every rank it
prints the whole error message (without torch's C++ backtrace) and the seconds
between the moment the ranks diverged (or the rank died) and the error. The
process group's timeout is 3 s; all seven scenarios took 31 s on a 2-core machine
shared with other jobs.

[Note: a store that outlives the ranks]
Debug mode compares the ranks' collectives through the process group's
key-value store. Under torchrun the store lives in the launcher's agent, so it
outlives every rank and, in debug mode, every rank raises
``CollectiveMismatchError``, deterministically. With ``init_method="tcp://..."``
the store lives in rank 0: if rank 0 raises first and its process exits, a rank
still reading the store fails with ``DistNetworkError: Broken pipe`` instead.
This script hosts the store in its own (parent) process, as torchrun does, and
keeps every rank alive until all have reported.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTConfig, loss_fn, make_batch  # noqa: E402

from fsdp_compose import debug, fully_shard  # noqa: E402

CFG = GPTConfig(vocab_size=97, block_size=16, n_layer=3, n_head=2, n_embd=32)
PG_TIMEOUT_S = 3.0  # the process group's timeout; debug mode waits as long
_DEADLINE_S = 60.0  # per scenario, in case a rank hangs
_diverged_at: list[float] = []  # when this rank's scenario diverged (set once)


def mark_divergence() -> float:
    """Records the moment the ranks diverge; the reported time counts from here."""
    _diverged_at.append(time.monotonic())
    return _diverged_at[-1]


def sharded_gpt() -> GPT:
    torch.manual_seed(0)
    model = GPT(CFG)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def train(model: nn.Module, steps: int, diverge_at: int, on_diverge=None) -> float:
    """Trains ``steps`` steps; returns the time step ``diverge_at`` began."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    began = time.monotonic()
    for step in range(steps):
        if step == diverge_at:
            began = mark_divergence()
            if on_diverge is not None:
                on_diverge()
        x, y = make_batch(CFG, 2, step)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return began


# --- scenarios: each runs on every rank and returns when the error was raised ---


class SkipOnRank0(nn.Module):
    """A data-dependent branch: at step 2, rank 0 skips the middle block."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt, self.step = gpt, 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        g = self.gpt
        x = g.tok_emb(idx) + g.pos_emb(torch.arange(idx.size(1)))
        for i, block in enumerate(g.blocks):
            if not (i == 1 and self.step == 2 and dist.get_rank() == 0):
                x = block(x)
        self.step += 1
        return g.lm_head(g.ln_f(x))


def desync(rank: int, use_debug: bool) -> float:
    torch.manual_seed(0)
    model = SkipOnRank0(GPT(CFG))
    for block in model.gpt.blocks:
        fully_shard(block)
    fully_shard(model)
    if use_debug:
        model.register_observer(debug.CollectiveChecks(timeout=PG_TIMEOUT_S))
    return train(model, 5, 2)


def uneven_batches(rank: int, use_debug: bool) -> float:
    model = sharded_gpt()
    if use_debug:
        model.register_observer(debug.CollectiveChecks(timeout=PG_TIMEOUT_S))
    # rank 1 has one more batch than rank 0; rank 0 then waits in a barrier-free exit
    # rank 0 then reports "finished" and stays alive (see _rank_main), so rank 1
    # sees a timeout, not a crash
    return train(model, 3 if rank == 0 else 4, 3)


def killed_rank(rank: int, use_debug: bool) -> float:
    model = sharded_gpt()
    if rank == 1:
        model.blocks[1].register_forward_pre_hook(
            lambda *_: os.kill(os.getpid(), signal.SIGKILL) if model.training_step == 1 else None
        )
    model.training_step = 0

    def diverge() -> None:
        model.training_step = 1

    return train(model, 3, 1, diverge)


def different_models(rank: int, use_debug: bool) -> float:
    cfg = GPTConfig(**{**CFG.__dict__, "n_embd": 32 if rank == 0 else 48})
    torch.manual_seed(0)
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    began = mark_divergence()
    model(make_batch(cfg, 2, 0)[0])
    return began


def optimizer_before_shard(rank: int, use_debug: bool) -> float:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters())
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    x, y = make_batch(CFG, 2, 0)
    loss_fn(model(x), y).backward()
    began = mark_divergence()
    opt.step()
    return began


SCENARIOS = {
    # name: (function, debug mode on, what happens)
    "desync_debug": (desync, True, "rank 0 skips a block at step 2; debug mode on"),
    "desync_no_debug": (desync, False, "rank 0 skips a block at step 2; debug mode off"),
    "uneven_batches_debug": (uneven_batches, True, "rank 1 runs one batch more; debug mode on"),
    "uneven_batches_no_debug": (uneven_batches, False, "rank 1 runs one batch more; debug mode off"),
    "killed_rank": (killed_rank, False, "rank 1 is killed (SIGKILL) in its second forward"),
    "different_models": (different_models, False, "the ranks build models of different widths"),
    "optimizer_before_fully_shard": (
        optimizer_before_shard, False, "the optimizer is created before fully_shard"
    ),
}


def _message(exc: BaseException) -> str:
    """The whole message, without the C++ backtrace torch appends to some errors."""
    lines = []
    for line in str(exc).splitlines():
        if line.startswith(("Exception raised from", "frame #")):
            lines.append("(C++ backtrace omitted)")
            break
        lines.append(line)
    return "\n".join(lines)


def _rank_main(
    rank: int, world: int, port: int, name: str, queue: mp.Queue, release: Any, log_path: str
) -> None:
    # torch's and gloo's own logging of a failing collective goes to this rank's log
    # file, not the terminal; the exception itself is reported through the queue.
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 2)
    # The store lives in the parent process, as under torchrun (whose agent hosts
    # it), so it outlives every rank: a rank that raises first and exits cannot
    # break the others' store reads (see [Note: a store that outlives the ranks]).
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=PG_TIMEOUT_S)
    )
    fn, use_debug, _ = SCENARIOS[name]
    began = time.monotonic()
    try:
        began = fn(rank, use_debug)
        queue.put((rank, "finished without error", "", time.monotonic() - began))
    except Exception as exc:  # noqa: BLE001 - report whatever surfaced
        if _diverged_at:  # the scenario raised: count from the divergence, not its start
            began = _diverged_at[0]
        queue.put((rank, type(exc).__name__, _message(exc), time.monotonic() - began))
    queue.close()
    queue.join_thread()  # flush before exiting without teardown
    # Stay until every rank has reported: an exit would look like a crash to the
    # ranks still waiting in a collective, and change what they report.
    release.wait(_DEADLINE_S)
    os._exit(0)  # skip process-group teardown, which would wait on broken peers


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(name: str, world: int = 2) -> list[tuple[int, str, str, float]]:
    """Runs scenario ``name`` on ``world`` fresh ranks; returns per rank
    ``(rank, outcome, message, seconds from divergence to error)``."""
    # fork: the ranks start in a fraction of a second (torch is already imported);
    # spawn where fork does not exist.
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    queue, release = ctx.Queue(), ctx.Event()
    port = _free_port()
    logs = tempfile.mkdtemp(prefix="fsdp_compose_failure_modes_")
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, world, port, name, queue, release, os.path.join(logs, f"rank{r}.log")),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False)
    results: list[tuple[int, str, str, float]] = []
    deadline = time.monotonic() + _DEADLINE_S
    while len(results) < world and time.monotonic() < deadline:
        try:
            results.append(queue.get(timeout=0.2))
        except Exception:  # noqa: BLE001 - queue.Empty; check for dead ranks
            reported = {r[0] for r in results}
            dead = [i for i, p in enumerate(procs) if p.exitcode is not None and i not in reported]
            for i in dead:
                results.append((i, "process died", _death(procs[i].exitcode, logs, i), math.nan))
    release.set()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    del store
    shutil.rmtree(logs, ignore_errors=True)
    return sorted(results)


def _death(exitcode: int | None, logs: str, rank: int) -> str:
    """How a rank died: its signal and the last lines it logged (gloo's abort message)."""
    code = exitcode or 0
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    try:
        with open(os.path.join(logs, f"rank{rank}.log")) as f:
            tail = [line.rstrip() for line in f if line.strip()][-3:]
    except OSError:
        tail = []
    return "\n".join([how, *(f"log: {line}" for line in tail)])


def main() -> None:
    names = sys.argv[1:] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")
    total = time.monotonic()
    for name in names:
        print(f"== {name}: {SCENARIOS[name][2]}", flush=True)
        for rank, outcome, message, seconds in run(name):
            when = "" if math.isnan(seconds) else f" after {seconds:.2f}s"
            print(f"  rank {rank}: {outcome}{when}")
            for line in message.splitlines():
                print(f"      {line}")
        print(flush=True)
    print(f"{len(names)} scenarios in {time.monotonic() - total:.0f}s")


if __name__ == "__main__":
    main()
