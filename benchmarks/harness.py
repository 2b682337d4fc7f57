"""Launches one benchmark job: one fresh process per rank, sharing a gloo group.

Fresh processes per job keep measurements independent: no allocator state, no
warm caches and no leftover threads from a previous implementation. Each rank
runs ``worker.py`` with ``OMP_NUM_THREADS=1`` (set before torch is imported),
writes its results as JSON, and the harness collects them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class JobFailed(RuntimeError):
    """A rank exited with an error or the job ran past its deadline."""


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


def run_job(config: dict[str, Any], timeout_s: float = 1800.0) -> list[dict[str, Any]]:
    """Runs ``config`` on ``config["world_size"]`` ranks; returns each rank's result."""
    world = config["world_size"]
    workdir = tempfile.mkdtemp(prefix="fsdp_compose_bench_")
    config = {**config, "store": os.path.join(workdir, "store"), "out_dir": workdir}
    config_path = os.path.join(workdir, "config.json")
    with open(config_path, "w") as f:
        json.dump(config, f)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH")) if p),
    }
    procs: list[subprocess.Popen[bytes]] = []
    logs = [os.path.join(workdir, f"rank{r}.log") for r in range(world)]
    try:
        for rank in range(world):
            with open(logs[rank], "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, _WORKER, config_path, str(rank)],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=_REPO,
                    )
                )
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                why = f"rank {failed[0]} failed" if failed else f"timed out after {timeout_s:.0f}s"
                raise JobFailed(
                    f"{_describe(config)}: {why}\n" + _tail(logs[failed[0] if failed else 0])
                )
            time.sleep(0.2)
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        if failed:
            raise JobFailed(
                f"{_describe(config)}: rank {failed[0]} failed\n" + _tail(logs[failed[0]])
            )
        results = []
        for rank in range(world):
            with open(os.path.join(workdir, f"rank{rank}.json")) as f:
                results.append(json.load(f))
        return results
    finally:
        for p in procs:  # only the processes this call started
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def _describe(config: dict[str, Any]) -> str:
    return f"{config['kind']} {config.get('preset', '')} {config['impl']} W={config['world_size']}"


def init_gloo(rank: int, world_size: int, init_file: str, timeout_s: float = 300.0) -> None:
    """Joins the gloo group of a :func:`spawn_ranks` job (one thread per rank)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def spawn_ranks(worker: Any, world_size: int, args: Any, prefix: str) -> Any:
    """Runs ``worker(rank, world_size, init_file, args, queue)`` on ``world_size``
    spawned processes (``OMP_NUM_THREADS=1``) and returns what rank 0 puts on
    ``queue``; the workers call :func:`init_gloo` with ``init_file``."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    fd, init_file = tempfile.mkstemp(prefix=prefix)
    os.close(fd)
    os.unlink(init_file)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(r, world_size, init_file, args, queue))
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    result = queue.get(timeout=1800)
    for proc in procs:
        proc.join()
    return result


def ab_parser(doc: str | None, warmup: int, steps: int, steps_help: str) -> argparse.ArgumentParser:
    """The options every same-process A/B benchmark takes (model preset, ranks,
    batch, warm-up and timed steps); the caller adds its own."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="small")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--steps", type=int, default=steps, help=steps_help)
    return p
