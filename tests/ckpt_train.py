"""One rank of the training run used by the checkpoint crash test.

    python tests/ckpt_train.py --rank R --world-size W --init-file F --dir D --out OUT \
        --steps N --save-every K [--hang-in-save STEP --hang-rank R --marker PATH]

Trains the tiny example GPT with ``examples/checkpoint.py``'s helpers: resumes from
the newest complete checkpoint under ``--dir``, saves every K steps, and at the end
rank 0 writes the full parameters to ``--out``. With ``--hang-in-save``, rank
``--hang-rank`` stops inside DCP's write phase of that step's save (after writing
its shard file, before the save completes), touches ``--marker`` and waits there
to be killed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(os.path.dirname(_HERE), "examples")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from checkpoint import resume, save_checkpoint  # noqa: E402
from gpt import GPT, GPTConfig, loss_fn, make_batch  # noqa: E402
from models import TINY_GPT  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402

from fsdp_compose import fully_shard  # noqa: E402

TINY = GPTConfig(**{**TINY_GPT, "n_layer": 2})
GLOBAL_BATCH = 8


def _hang_inside_save(marker: str) -> None:
    """Makes this rank stop in the middle of the next save: its data is on disk,
    the other ranks wait for it, and no ``.metadata`` has been written."""
    write_data = FileSystemWriter.write_data

    def stalled_write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        future = write_data(self, plan, planner)
        future.wait()
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)  # the test kills this process with SIGKILL
        return future

    FileSystemWriter.write_data = stalled_write_data  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--init-file", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--hang-in-save", type=int, default=None)
    p.add_argument("--hang-rank", type=int, default=1)
    p.add_argument("--marker", default=None)
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{args.init_file}",
        rank=args.rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=30),
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.device("meta"):
        model = GPT(TINY)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)

    start = resume(args.dir, model, optim)
    if start == 0:
        model.init_weights(seed=0)
    print(f"start step {start}", flush=True)

    local = GLOBAL_BATCH // world
    for step in range(start, args.steps):
        x, y = make_batch(TINY, GLOBAL_BATCH, step)
        loss = loss_fn(model(x[rank * local : (rank + 1) * local]), y[rank * local : (rank + 1) * local])
        loss.backward()
        optim.step()
        optim.zero_grad()
        done = step + 1
        if done % args.save_every == 0:
            if done == args.hang_in_save and rank == args.hang_rank:
                _hang_inside_save(args.marker)
            save_checkpoint(args.dir, done, model, optim)
            print(f"saved step {done}", flush=True)

    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    if rank == 0:
        torch.save(full, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
