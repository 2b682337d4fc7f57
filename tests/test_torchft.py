"""fsdp_compose with torchft: 2 replica groups x 2 shard ranks on CPU gloo.

Each rank is a process running ``tests/ft_train.py``: a group shards the tiny GPT
over its own process group; the groups meet through a real torchft lighthouse
started here, a ``torchft.Manager`` per rank and torchft's reconfigurable
``ProcessGroupGloo`` (``fsdp_compose.ft.enable_torchft`` wires them).

* ``test_replicas_match_one_process``: no failure; at every step both groups
  take part, hold identical full parameters, and match one process training on
  the global batch.
* ``test_killed_group_heals``: one rank of group 1 SIGKILLs itself mid-step;
  group 0 keeps committing steps alone; group 1 is restarted (both ranks, as
  an elastic launcher would), heals from group 0, and from then on holds the
  same parameters and optimizer shards as group 0, bit for bit. Group 0 sends
  its state from torchft's quorum thread, which issues none of the model's
  collectives (only the training thread does).

Every process runs under a deadline and is killed at the end of the test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchft")
from torchft._torchft import LighthouseServer

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent
sys.path[:0] = [str(_ROOT / "examples"), str(_HERE)]

from dist_utils import ScriptProcess, start_script  # noqa: E402
from ft_train import GLOBAL_BATCH, LR, TINY  # noqa: E402
from gpt import GPT, loss_fn, make_batch  # noqa: E402

GROUPS, GROUP_SIZE = 2, 2
# A hang fails at this deadline. Each rank imports torch and torchft and builds
# the model before it joins; on a loaded 2-core machine the four ranks' start-up
# alone has taken over a minute, while a passing test takes about 30 s.
DEADLINE_S = 180.0


class _Job:
    """The rank processes of a test, started with a shared deadline."""

    def __init__(
        self, tmp: Path, lighthouse: str, steps: int, min_together: int, sharded_step: bool = False
    ) -> None:
        self.sharded_step = sharded_step
        self.tmp, self.lighthouse = tmp, lighthouse
        self.steps, self.min_together = steps, min_together
        self.deadline = time.monotonic() + DEADLINE_S
        self.procs: dict[tuple[int, int, int], ScriptProcess] = {}
        self.stores: list[dist.TCPStore] = []

    def start_group(self, group: int, incarnation: int, kill_at: dict[int, int]) -> None:
        # A fresh store per incarnation: a restarted group must not read the
        # manager address its previous life left there.
        store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        self.stores.append(store)
        env = {**os.environ, "PYTHONPATH": f"{_ROOT}{os.pathsep}{_HERE}", "OMP_NUM_THREADS": "1"}
        for rank in range(GROUP_SIZE):
            argv = [
                "--group", str(group), "--groups", str(GROUPS),
                "--rank", str(rank), "--group-size", str(GROUP_SIZE),
                "--store-port", str(store.port), "--lighthouse", self.lighthouse,
                "--steps", str(self.steps), "--min-together", str(self.min_together),
                "--kill-at", str(kill_at.get(rank, -1)),
                "--alone-file", str(self.alone_file(group)),
                *(["--sharded-step"] if self.sharded_step else []),
                "--out", str(self.out(group, incarnation, rank)),
            ]  # fmt: skip
            # ``python ft_train.py ...``, forked from a process that has imported
            # torch already (the imports were most of a rank's start-up)
            self.procs[group, incarnation, rank] = start_script(
                str(_HERE / "ft_train.py"),
                argv,
                env=env,
                log=str(self.tmp / f"log_g{group}_i{incarnation}_r{rank}.txt"),
            )

    def alone_file(self, group: int) -> Path:
        return self.tmp / f"alone_g{group}.txt"

    def committed_alone_after(self, group: int, step: int) -> None:
        """Waits until ``group`` has committed a step after ``step`` without the others."""
        path = self.alone_file(group)
        while not (path.exists() and any(int(s) > step for s in path.read_text().split())):
            if time.monotonic() > self.deadline:
                pytest.fail(
                    f"group {group} committed no step alone after step {step}\n{self.logs()}"
                )
            time.sleep(0.05)

    def out(self, group: int, incarnation: int, rank: int) -> Path:
        return self.tmp / f"records_g{group}_i{incarnation}_r{rank}.pt"

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.tmp.glob("log_*.txt"))
        )

    def wait(self, key: tuple[int, int, int]) -> int:
        proc = self.procs[key]
        try:
            return proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {key} (group, incarnation, rank) hung\n{self.logs()}")

    def output(self, group: int, incarnation: int, rank: int) -> dict[str, Any]:
        code = self.wait((group, incarnation, rank))
        assert code == 0, f"rank {(group, incarnation, rank)} exited with {code}\n{self.logs()}"
        return torch.load(self.out(group, incarnation, rank), weights_only=False)

    def records(self, group: int, incarnation: int, rank: int) -> list[dict[str, Any]]:
        return self.output(group, incarnation, rank)["records"]

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@contextmanager
def _job(
    tmp: Path, *, min_replicas: int, steps: int, min_together: int, sharded_step: bool = False
) -> Iterator[_Job]:
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=500, heartbeat_timeout_ms=2000
    )
    job = _Job(tmp, lighthouse.address(), steps, min_together, sharded_step)
    try:
        yield job
    finally:
        job.kill_all()
        lighthouse.shutdown()


def _reference(steps: int) -> list[dict[str, torch.Tensor]]:
    """Full parameters after each step of one process training on the global batch."""
    torch.manual_seed(0)
    model = GPT(TINY)
    model.init_weights(seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    out = []
    for step in range(steps):
        x, y = make_batch(TINY, GLOBAL_BATCH, step)
        loss_fn(model(x), y).backward()
        optim.step()
        optim.zero_grad()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _assert_same_tree(a: Any, b: Any, where: str) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _assert_same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_tree(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where} differs: max |diff| {(a - b).abs().max()}"
    else:
        assert a == b, f"{where}: {a} != {b}"


@pytest.mark.parametrize("sharded_step", [False, True], ids=["dtensor_step", "sharded_step"])
def test_replicas_match_one_process(tmp_path: Path, sharded_step: bool) -> None:
    """torchft's OptimizerWrapper steps the optimizer: with and without
    ``enable_sharded_step`` on it."""
    steps = 5
    with _job(
        tmp_path, min_replicas=GROUPS, steps=steps, min_together=0, sharded_step=sharded_step
    ) as job:
        for group in range(GROUPS):
            job.start_group(group, 0, kill_at={})
        records = {(g, r): job.records(g, 0, r) for g in range(GROUPS) for r in range(GROUP_SIZE)}
    reference = _reference(steps)
    n_params = len(reference[0])
    for (g, r), recs in records.items():
        assert [rec["step"] for rec in recs] == list(range(1, steps + 1)), (g, r)
        assert all(rec["participants"] == GROUPS for rec in recs), (g, r)
        # Every committed step ran optim.step() through the OptimizerWrapper; with
        # enable_sharded_step the sharded update took every parameter from the
        # first step on (a hook registered after it sees no gradient left).
        left = [rec["grads_left"] for rec in recs]
        assert left == [0 if sharded_step else n_params] * steps, (g, r, left)
    for i in range(steps):
        group0 = records[0, 0][i]
        for (g, r), recs in records.items():
            _assert_same_tree(
                group0["params"], recs[i]["params"], f"step {i + 1} group {g} rank {r}"
            )
        for name, ref in reference[i].items():
            torch.testing.assert_close(
                group0["params"][name], ref, atol=1e-5, rtol=0, msg=f"step {i + 1} {name}"
            )
        for r in range(GROUP_SIZE):
            _assert_same_tree(
                records[0, r][i]["optim"], records[1, r][i]["optim"], f"optim {i} r{r}"
            )


def test_killed_group_heals(tmp_path: Path) -> None:
    kill_step, steps, together = 3, 8, 3
    with _job(tmp_path, min_replicas=1, steps=steps, min_together=together) as job:
        job.start_group(0, 0, kill_at={})
        job.start_group(1, 0, kill_at={1: kill_step})
        code = job.wait((1, 0, 1))
        assert code == -signal.SIGKILL, f"the killed rank exited with {code}\n{job.logs()}"
        # An elastic launcher restarts the whole group: its other rank is stuck in
        # the group's collectives with the dead one.
        job.procs[1, 0, 0].kill()
        job.wait((1, 0, 0))
        # A restarted rank starts in a fraction of a second (start_script): let group 0
        # commit a step alone first, as it would while a launcher restarts the group.
        job.committed_alone_after(0, kill_step)
        job.start_group(1, 1, kill_at={})
        # group 0's first life, group 1's second
        outputs = {(g, r): job.output(g, g, r) for g in range(GROUPS) for r in range(GROUP_SIZE)}
    group0 = [outputs[0, r]["records"] for r in range(GROUP_SIZE)]
    group1 = [outputs[1, r]["records"] for r in range(GROUP_SIZE)]
    for (g, r), out in outputs.items():
        threads = out["threads"]
        # Recovery issues no collective of the model: only the training thread does,
        # while torchft asks for the state on its quorum thread.
        assert threads["collectives"] == ["MainThread"], (g, r, threads)
        if g == 1:  # the restarted group heals, on the training thread
            assert threads["loaded"] == ["MainThread"], (g, r, threads)
    sent = [name for r in range(GROUP_SIZE) for name in outputs[0, r]["threads"]["sent"]]
    assert sent and "MainThread" not in sent, sent
    for r in range(GROUP_SIZE):
        steps0 = [rec["step"] for rec in group0[r]]
        # At the first quorum both groups are at step 0 and torchft may let either
        # heal from the other (its first commit is then step 2); after that, group 0
        # commits every step, through the other group's death and return.
        assert steps0[0] <= 2, f"group 0 rank {r} started at step {steps0[0]}"
        assert steps0 == list(range(steps0[0], steps0[-1] + 1)), f"group 0 rank {r} skipped steps"
        alone = [rec["step"] for rec in group0[r] if rec["participants"] == 1]
        assert any(s > kill_step for s in alone), (
            f"group 0 committed no step alone after the failure\n{job.logs()}"
        )
        by_step = {rec["step"]: rec for rec in group0[r]}
        healed = group1[r]
        assert healed[0]["step"] > kill_step, healed[0]["step"]
        assert healed[-1]["step"] == steps0[-1], (healed[-1]["step"], steps0[-1])
        assert all(rec["participants"] == GROUPS for rec in healed[-together:])
        for rec in healed:
            ref = by_step[rec["step"]]
            where = f"step {rec['step']} rank {r}"
            _assert_same_tree(ref["params"], rec["params"], f"params at {where}")
            _assert_same_tree(ref["optim"], rec["optim"], f"optimizer at {where}")
