"""One rank of one replica group of the torchft test's training run.

    python tests/ft_train.py --group G --groups NG --rank R --group-size S \
        --store-port P --lighthouse ADDR --steps N --out FILE \
        [--min-together M] [--kill-at STEP] [--alone-file PATH]

Shards the tiny example GPT over the replica group's own gloo process group (rank
R of S, through the group's TCPStore on port P), joins the torchft job through the
lighthouse with ``fsdp_compose.ft.enable_torchft`` and trains with AdamW on this
rank's slice of a deterministic global batch (chosen by the manager's step, so a
healed replica picks up the right data). It stops once the step is at least N and
the last M committed steps had every group taking part. After each committed
step it records the full parameters, this rank's optimizer shards and the number
of participating groups; the records go to ``--out`` at the end. With
``--kill-at``, the process SIGKILLs itself in the middle of that step (or the first
step past it). With ``--alone-file``, every step committed while some group is
missing appends its number to that file (the test waits for one before it
restarts a killed group). While some group is missing, each step waits 0.2 s, so that a group
running alone does not race far ahead (and its records stay small). The output also
names the threads that issued the model's collectives (an observer) and the threads
on which torchft asked for and applied the recovery state (a second state-dict
entry, ``probe``, registered next to fsdp_compose's). With ``--sharded-step`` the
optimizer gets ``enable_sharded_step`` before torchft's ``OptimizerWrapper`` wraps
it; in both modes a step pre-hook registered last counts the parameters that still
hold a gradient when it runs (the sharded step has already updated and hidden
them: [Note: sharded steps run inside step hooks]), so the test sees which path
each committed step took.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from datetime import timedelta

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(os.path.dirname(_HERE), "examples")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from gpt import GPT, GPTConfig, loss_fn, make_batch  # noqa: E402
from models import TINY_GPT  # noqa: E402
from torchft import Manager, ProcessGroupGloo  # noqa: E402

from fsdp_compose import Observer, enable_sharded_step, fully_shard  # noqa: E402
from fsdp_compose.ft import enable_torchft, shard_state_dict, torchft_timeouts  # noqa: E402

TINY = GPTConfig(**{**TINY_GPT, "n_layer": 2})
GLOBAL_BATCH = 8
LR = 1e-2


class _CollectiveThreads(Observer):
    """Names the threads that issue the model's collectives."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def on_collective(self, event, info) -> None:  # type: ignore[no-untyped-def]
        if event == "issue":
            self.names.add(threading.current_thread().name)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--groups", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--group-size", type=int, required=True)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--min-together", type=int, default=0)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--alone-file", default=None, help="append steps committed without a group")
    p.add_argument("--sharded-step", action="store_true", help="enable_sharded_step(optim)")
    args = p.parse_args()

    torch.set_num_threads(1)
    timeouts = torchft_timeouts(timedelta(seconds=10), quorum=timedelta(seconds=60))
    store = dist.TCPStore(
        "localhost",
        args.store_port,
        is_master=False,
        wait_for_workers=False,
        timeout=timeouts.replica_group,
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("replica_group", store),
        rank=args.rank,
        world_size=args.group_size,
        timeout=timeouts.replica_group,
    )
    with torch.device("meta"):
        model = GPT(TINY)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    if args.sharded_step:  # under torchft's OptimizerWrapper, which calls optim.step()
        enable_sharded_step(optim)

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeouts.process_group),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        use_async_quorum=False,
        timeout=timeouts.manager,
        quorum_timeout=timeouts.quorum,
        connect_timeout=timedelta(seconds=10),
        rank=args.rank,
        world_size=args.group_size,
        store_addr="localhost",
        store_port=args.store_port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"group{args.group}",
    )
    ft = enable_torchft(
        model, optim, manager, replica_group=args.group, num_replica_groups=args.groups
    )
    threads = {"collectives": _CollectiveThreads(), "sent": [], "loaded": []}
    grads_left: list[int] = []  # per optimizer step, by a pre-hook registered last
    optim.register_step_pre_hook(
        lambda o, args, kwargs: grads_left.append(
            sum(q.grad is not None for g in o.param_groups for q in g["params"])
        )
    )
    model.register_observer(threads["collectives"])
    manager.register_state_dict_fn(
        "probe",
        lambda _: threads["loaded"].append(threading.current_thread().name),
        lambda: threads["sent"].append(threading.current_thread().name),
    )
    local = GLOBAL_BATCH // ft.dp_size
    records: list[dict[str, object]] = []
    together = 0  # committed steps in a row with every group taking part
    while True:
        ft.optimizer.zero_grad()  # the quorum; a replica that is behind heals here
        step, participants = manager.current_step(), manager.num_participants()
        if 0 <= args.kill_at <= step:
            os.kill(os.getpid(), signal.SIGKILL)
        if participants < args.groups:
            time.sleep(0.2)  # alone: pace the steps while the other groups (re)join
        x, y = make_batch(TINY, GLOBAL_BATCH, step)
        rows = slice(ft.dp_rank * local, (ft.dp_rank + 1) * local)
        loss_fn(model(x[rows]), y[rows]).backward()
        steps_taken = len(grads_left)
        ft.optimizer.step()  # torchft's OptimizerWrapper: optim.step() only if committed
        if manager.current_step() == step:  # not committed: try the step again
            together = 0
            continue
        together = together + 1 if participants == args.groups else 0
        if args.alone_file and participants < args.groups:
            with open(args.alone_file, "a") as f:
                f.write(f"{manager.current_step()}\n")
        records.append(
            {
                "step": manager.current_step(),
                "participants": participants,
                # grads seen by the last pre-hook, None if optim.step() did not run
                "grads_left": grads_left[-1] if len(grads_left) > steps_taken else None,
                "params": {n: q.full_tensor() for n, q in model.named_parameters()},
                "optim": shard_state_dict(model, optim)["optim"],
            }
        )
        if manager.current_step() >= args.steps and together >= args.min_together:
            break
    threads["collectives"] = sorted(threads["collectives"].names)
    torch.save({"records": records, "threads": threads}, args.out)
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
