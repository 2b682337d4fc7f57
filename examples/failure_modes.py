"""Trigger each failure fsdp_compose diagnoses and report how long it took to surface.

    python examples/failure_modes.py              # all scenarios, 2 CPU ranks
    python examples/failure_modes.py desync_debug # one scenario

Each scenario runs in fresh processes (a failed collective leaves a process group
unusable). For every rank it prints the first line of the error and the seconds
between the moment the ranks diverged (or the rank died) and the error.
"""

from __future__ import annotations

import os
import signal
import sys
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTConfig, loss_fn, make_batch  # noqa: E402

from fsdp_compose import debug, fully_shard  # noqa: E402

CFG = GPTConfig(vocab_size=97, block_size=16, n_layer=3, n_head=2, n_embd=32)
PG_TIMEOUT_S = 5.0
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
        debug.enable_collective_checks(timeout=PG_TIMEOUT_S)
    return train(model, 5, 2)


def uneven_batches(rank: int, use_debug: bool) -> float:
    if use_debug:
        debug.enable_collective_checks(timeout=PG_TIMEOUT_S)
    model = sharded_gpt()
    # rank 1 has one more batch than rank 0; rank 0 then waits in a barrier-free exit
    began = train(model, 3 if rank == 0 else 4, 3)
    if rank == 0:
        time.sleep(PG_TIMEOUT_S * 3)  # stay alive so rank 1 sees a timeout, not a crash
    return began


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
    "desync_debug": (desync, True),
    "desync_no_debug": (desync, False),
    "uneven_batches_debug": (uneven_batches, True),
    "uneven_batches_no_debug": (uneven_batches, False),
    "killed_rank": (killed_rank, False),
    "different_models": (different_models, False),
    "optimizer_before_fully_shard": (optimizer_before_shard, False),
}


def _rank_main(rank: int, world: int, port: int, name: str, queue: mp.Queue) -> None:
    # A TCP store, as under torchrun (the debug checks exchange fingerprints through it).
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=PG_TIMEOUT_S),
    )
    fn, use_debug = SCENARIOS[name]
    began = time.monotonic()
    try:
        began = fn(rank, use_debug)
        queue.put((rank, "finished without error", time.monotonic() - began))
    except Exception as exc:  # noqa: BLE001 - report whatever surfaced
        first = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        if _diverged_at:  # the scenario raised: count from the divergence, not its start
            began = _diverged_at[0]
        queue.put((rank, first, time.monotonic() - began))
    queue.close()
    queue.join_thread()  # flush before exiting without teardown
    os._exit(0)  # skip process-group teardown, which would wait on broken peers


def run(name: str, world: int = 2) -> list[tuple[int, str, float]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, name, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = []
    deadline = time.monotonic() + 120
    while len(results) < world and time.monotonic() < deadline:
        try:
            results.append(queue.get(timeout=1))
        except Exception:  # noqa: BLE001 - queue.Empty; check for dead ranks
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if len(results) + len(dead) >= world:
                results += [(i, f"process died (exit code {procs[i].exitcode})", 0.0) for i in dead
                            if all(r[0] != i for r in results)]
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    return sorted(results)


def main() -> None:
    names = sys.argv[1:] or list(SCENARIOS)
    for name in names:
        print(f"== {name}")
        for rank, message, seconds in run(name):
            print(f"  rank {rank}: after {seconds:5.2f}s  {message[:160]}")


if __name__ == "__main__":
    main()
