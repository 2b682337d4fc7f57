"""Fault tolerance with torchft: the quorum's per-step cost, and how long a failure costs.

    python benchmarks/torchft_recovery.py [--steps 60] [--kill-at 20]

Everything runs on CPU gloo with W=4: 2 replica groups x 2 ranks, the example GPT
(``GPTConfig()`` defaults, about 1M parameters) sharded with ``fully_shard`` inside
each group, AdamW, 4 sequences of 64 tokens per rank. A real torchft lighthouse runs
in this process; every rank is a process running this file with ``--worker``.

1. **Per-step overhead.** Three runs of ``--steps`` steps each, one after the other:

   * ``no torchft``: the same groups, the cross-group average done by a plain gloo
     ``all_reduce`` in the all-reduce hook (HSDP by hand, nothing can fail over);
   * ``torchft sync``: ``fsdp_compose.ft.enable_torchft``, ``Manager(use_async_quorum=False)``;
   * ``torchft async``: the same with ``use_async_quorum=True`` (the quorum overlaps
     the forward).

   Per-step wall time is measured on every rank from the start of one step (before
   ``zero_grad``, where torchft's quorum runs) to the next, the first 5 steps left
   out; the table gives the median over steps of the slowest rank, and its ratio to
   ``no torchft``.
2. **Recovery** (``torchft sync``): rank 1 of group 1 SIGKILLs itself at step
   ``--kill-at``; this script then kills group 1's other rank and restarts the
   group (as an elastic launcher would). Reported: from the kill to group 0's next
   committed step; from the restart to group 1's state loaded (healed); from the
   restart to its first committed step; that step's own time (quorum, state
   transfer, forward, backward). Group 0 goes on until 3 steps in a row had both
   groups again.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_ROOT), str(_ROOT / "examples")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from gpt import GPT, GPTConfig, loss_fn, make_batch  # noqa: E402

from fsdp_compose import fully_shard  # noqa: E402

CFG = GPTConfig()
PER_RANK, GROUPS, GROUP_SIZE, WARMUP = 4, 2, 2, 5


def _worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    from fsdp_compose.ft import torchft_timeouts

    timeouts = torchft_timeouts(timedelta(seconds=10), quorum=timedelta(seconds=60))
    store = dist.TCPStore(
        "localhost",
        args.store_port,
        is_master=False,
        wait_for_workers=False,
        timeout=timeouts.replica_group,
    )
    if args.mode == "plain":  # one job of 4 ranks: groups and cross-group pairs by hand
        rank = args.group * GROUP_SIZE + args.rank
        world = GROUPS * GROUP_SIZE
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timeouts.replica_group
        )
        groups = [
            dist.new_group([g * GROUP_SIZE + r for r in range(GROUP_SIZE)]) for g in range(GROUPS)
        ]
        pairs = [
            dist.new_group([g * GROUP_SIZE + r for g in range(GROUPS)]) for r in range(GROUP_SIZE)
        ]
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(groups[args.group], "cpu")
    else:
        dist.init_process_group(
            "gloo", store=dist.PrefixStore("replica_group", store), rank=args.rank,
            world_size=GROUP_SIZE, timeout=timeouts.replica_group,
        )  # fmt: skip
        mesh = None
    started = time.time()
    with torch.device("meta"):
        model = GPT(CFG)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out: dict[str, Any] = {"started": started, "steps": [], "loaded": None}
    if args.mode == "plain":
        _train_plain(args, model, optim, pairs[args.rank], out)
    else:
        _train_torchft(args, model, optim, timeouts, out)
    Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def _train_plain(
    args: argparse.Namespace, model: Any, optim: Any, pair: Any, out: dict[str, Any]
) -> None:
    def across_groups(output: torch.Tensor) -> None:
        dist.all_reduce(output, group=pair)
        output.div_(GROUPS)

    for module in [model, *model.blocks]:
        module.set_all_reduce_hook(across_groups)
    dp_rank = args.group * GROUP_SIZE + args.rank
    for step in range(args.steps):
        begin = time.time()
        optim.zero_grad()
        x, y = make_batch(CFG, PER_RANK * GROUPS * GROUP_SIZE, step)
        rows = slice(dp_rank * PER_RANK, (dp_rank + 1) * PER_RANK)
        loss_fn(model(x[rows]), y[rows]).backward()
        optim.step()
        out["steps"].append(
            {"step": step + 1, "begin": begin, "end": time.time(), "participants": GROUPS}
        )


def _train_torchft(
    args: argparse.Namespace, model: Any, optim: Any, timeouts: Any, out: dict[str, Any]
) -> None:
    from torchft import Manager, ProcessGroupGloo

    from fsdp_compose.ft import enable_torchft

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeouts.process_group),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        use_async_quorum=args.mode == "async",
        init_sync=False,  # every group initialises the same weights from the same seed
        timeout=timeouts.manager,
        quorum_timeout=timeouts.quorum,
        connect_timeout=timedelta(seconds=10),
        rank=args.rank,
        world_size=GROUP_SIZE,
        store_addr="localhost",
        store_port=args.store_port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"group{args.group}",
    )
    ft = enable_torchft(model, optim, manager, replica_group=args.group, num_replica_groups=GROUPS)
    loads: list[tuple[float, float]] = []
    # registered after fsdp_compose's entry, so applied right after it: the end of the load
    manager.register_state_dict_fn(
        "timing", lambda _: loads.append((time.time(), 0.0)), lambda: None
    )
    together = 0  # committed steps in a row with every group
    # Past --steps, go on until --min-together steps in a row had every group (a
    # group that lost a peer waits for it to heal), at most 4x --steps in all.
    while manager.current_step() < args.steps or (
        together < args.min_together and manager.current_step() < 4 * args.steps
    ):
        begin = time.time()
        ft.optimizer.zero_grad()  # the quorum (sync mode: and the heal)
        step = manager.current_step()
        if 0 <= args.kill_at <= step:
            Path(args.out + ".killed").write_text(json.dumps(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = make_batch(CFG, PER_RANK * ft.dp_size, step)
        rows = slice(ft.dp_rank * PER_RANK, (ft.dp_rank + 1) * PER_RANK)
        loss_fn(model(x[rows]), y[rows]).backward()
        ft.optimizer.step()
        if manager.current_step() == step:
            continue  # not committed
        if loads and out["loaded"] is None:
            out["loaded"] = loads[0][0]
        participants = manager.num_participants()
        together = together + 1 if participants == GROUPS else 0
        entry = {"step": manager.current_step(), "begin": begin, "end": time.time()}
        out["steps"].append({**entry, "participants": participants})
    manager.shutdown(wait=False)


class _Job:
    def __init__(
        self, tmp: Path, mode: str, steps: int, lighthouse: str, min_together: int = 0
    ) -> None:
        self.tmp, self.mode, self.steps, self.lighthouse = tmp, mode, steps, lighthouse
        self.min_together = min_together
        self.procs: dict[tuple[int, int, int], subprocess.Popen[bytes]] = {}
        self.stores: list[dist.TCPStore] = []
        self.restarted_at = 0.0

    def out(self, group: int, life: int, rank: int) -> str:
        return str(self.tmp / f"{self.mode}_g{group}_l{life}_r{rank}.json")

    def start(self, groups: list[int], life: int, kill: dict[int, int] | None = None) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(_ROOT)}
        store = None
        for group in groups:
            if self.mode != "plain" or store is None:  # plain: one store for the 4 ranks
                store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
                self.stores.append(store)
            for rank in range(GROUP_SIZE):
                cmd = [
                    sys.executable, __file__, "--worker", "--mode", self.mode,
                    "--group", str(group), "--rank", str(rank), "--steps", str(self.steps),
                    "--store-port", str(store.port), "--lighthouse", self.lighthouse,
                    "--kill-at", str((kill or {}).get(group * GROUP_SIZE + rank, -1)),
                    "--min-together", str(self.min_together),
                    "--out", self.out(group, life, rank),
                ]  # fmt: skip
                log = open(self.tmp / f"{self.mode}_g{group}_l{life}_r{rank}.log", "wb")  # noqa: SIM115
                self.procs[group, life, rank] = subprocess.Popen(
                    cmd, env=env, stdout=log, stderr=log
                )
                log.close()

    def result(self, group: int, life: int, rank: int, timeout: float = 600) -> dict[str, Any]:
        code = self.procs[group, life, rank].wait(timeout=timeout)
        if code != 0:
            log = Path(self.out(group, life, rank)[: -len(".json")] + ".log").read_text()
            raise RuntimeError(
                f"{self.mode} rank {(group, life, rank)} exited with {code}:\n{log[-3000:]}"
            )
        return json.loads(Path(self.out(group, life, rank)).read_text())

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _step_times(results: list[dict[str, Any]]) -> list[float]:
    """Per step, the slowest rank's time from its step's start to the next's."""
    per_rank = []
    for r in results:
        begins = [s["begin"] for s in r["steps"]] + [r["steps"][-1]["end"]]
        per_rank.append([b - a for a, b in itertools.pairwise(begins)][WARMUP:])
    return [max(ts) for ts in zip(*per_rank)]


def _lighthouse(min_replicas: int) -> Any:
    from torchft._torchft import LighthouseServer

    return LighthouseServer(
        bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=500, heartbeat_timeout_ms=2000
    )


def _overhead(tmp: Path, steps: int, rounds: int) -> dict[str, float]:
    """Median step time per mode, the modes interleaved over ``rounds`` rounds (the
    order rotating each round) so that a change of load hits every mode alike."""
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i in range(rounds):
        for mode in MODES[i % len(MODES) :] + MODES[: i % len(MODES)]:
            lighthouse = _lighthouse(GROUPS)
            job = _Job(tmp, mode, steps, lighthouse.address())
            try:
                job.start(list(range(GROUPS)), 0)
                results = [job.result(g, 0, r) for g in range(GROUPS) for r in range(GROUP_SIZE)]
            finally:
                job.kill_all()
                lighthouse.shutdown()
            assert all(s["participants"] == GROUPS for r in results for s in r["steps"]), mode
            times[mode] += _step_times(results)
    return {mode: statistics.median(ts) for mode, ts in times.items()}


MODES = ("plain", "sync", "async")


def _recovery(tmp: Path, steps: int, kill_at: int) -> dict[str, float]:
    lighthouse = _lighthouse(1)
    job = _Job(tmp, "sync", steps, lighthouse.address(), min_together=3)
    try:
        job.start(list(range(GROUPS)), 0, kill={GROUP_SIZE + 1: kill_at})
        job.procs[1, 0, 1].wait(timeout=600)
        job.procs[1, 0, 0].kill()  # stuck in the group's collectives with the dead rank
        job.procs[1, 0, 0].wait()
        restarted = time.time()
        job.start([1], 1)
        group0 = job.result(0, 0, 0)
        group1 = job.result(1, 1, 0)
    finally:
        job.kill_all()
        lighthouse.shutdown()
    if group1["loaded"] is None:
        raise RuntimeError("the restarted group 1 committed steps without healing from group 0")
    killed = json.loads(Path(job.out(1, 0, 1) + ".killed").read_text())
    next_commit = min(s["end"] for s in group0["steps"] if s["end"] > killed)
    first_commit = group1["steps"][0]["end"]
    transfer = next(s for s in group1["steps"] if s["end"] >= group1["loaded"])
    return {
        "kill -> group 0's next committed step (s)": next_commit - killed,
        "restart -> group 1 healed, state loaded (s)": group1["loaded"] - restarted,
        "restart -> group 1's first committed step (s)": first_commit - restarted,
        "group 1's first step, quorum + transfer + step (s)": transfer["end"] - transfer["begin"],
        "restart -> group 1's process group ready (imports, rendezvous) (s)": group1["started"]
        - restarted,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--mode", default="sync", choices=["plain", "sync", "async"])
    p.add_argument("--group", type=int, default=0)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-at", type=int, default=20)
    p.add_argument("--min-together", type=int, default=0)
    p.add_argument("--store-port", type=int, default=0)
    p.add_argument("--lighthouse", default="")
    p.add_argument("--out", default="")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the 3 modes")
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        medians = _overhead(Path(tmp), args.steps, args.rounds)
        recovery = _recovery(Path(tmp), args.steps, args.kill_at)
    print(f"W=4 (2 groups x 2 ranks), CPU gloo, GPTConfig() ~1M params, {PER_RANK} seq/rank, "
          f"{args.steps} steps ({WARMUP} warm-up left out), {args.rounds} interleaved rounds\n")  # fmt: skip
    print("| run | median step (ms) | added per step (ms) | vs no torchft |")
    print("|---|---|---|---|")
    for mode, label in (
        ("plain", "no torchft"),
        ("sync", "torchft sync quorum"),
        ("async", "torchft async quorum"),
    ):
        added = (medians[mode] - medians["plain"]) * 1e3
        ratio = medians[mode] / medians["plain"]
        print(f"| {label} | {medians[mode] * 1e3:.1f} | {added:+.1f} | {ratio:.3f} |")
    print(
        f"\nRecovery (torchft sync quorum, rank 1 of group 1 SIGKILLed at step {args.kill_at}):\n"
    )
    print("| interval | seconds |")
    print("|---|---|")
    for name, value in recovery.items():
        print(f"| {name[: -len(' (s)')]} | {value:.2f} |")


if __name__ == "__main__":
    main()
