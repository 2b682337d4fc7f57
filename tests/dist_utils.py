"""Real multi-process gloo jobs for tests, with a pool of ranks per world size.

Starting W processes that import torch costs seconds, so each world size gets one
pool of ranks for the whole session (and every rank is forked from a server that
has imported torch once: see [Note: ranks forked from a server]): ``DistPool.run(fn, *args)`` runs the
module-level function ``fn(*args)`` on every rank (inside an initialised gloo
process group) and returns the per-rank results. Every job has a deadline: a job
that hangs or a rank that dies fails the test with each rank's traceback, and the
pool is torn down and rebuilt for the next test (its process group may be broken).
``run_distributed`` runs a job whose rank process died once more, on a fresh pool
([Note: a rank that dies]).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import runpy
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any, Callable

_PG_TIMEOUT_S = float(os.environ.get("FSDP_COMPOSE_TEST_PG_TIMEOUT", "60"))

# [Note: ranks forked from a server]
# A spawned rank imports torch and fsdp_compose itself: seconds of CPU per rank,
# paid again at every pool start (a new world size or process-group timeout, and
# a rebuild after every failing job). multiprocessing's forkserver imports them
# once, in a server process that has run nothing else (no thread, no process
# group), and forks each rank from it. A rank is then the same fresh process a
# spawned one is: it still unpickles its target and the job's test module, joins
# a new gloo group, and gets the environment the test process has when the pool
# starts (the server's is the one it had when the server started).
_PRELOAD = ["torch", "torch.distributed", "fsdp_compose"]


def _worker(
    rank: int, world_size: int, init_file: str, conn: Any, pg_timeout: float, env: dict[str, str]
) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=pg_timeout),
    )
    conn.send(("ready", None))
    while True:
        message = conn.recv()
        if message is None:
            break
        fn, args, kwargs = pickle.loads(message)
        try:
            result = fn(*args, **kwargs)
            conn.send(("ok", result))
        except BaseException as exc:  # noqa: BLE001 - report everything to the parent
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    dist.destroy_process_group()
    # gloo's workers release their last tensors a moment after a collective completes;
    # let them, before the interpreter finalizes (a rare abort at exit otherwise).
    import gc

    gc.collect()
    time.sleep(0.1)


class JobFailed(AssertionError):
    """A distributed job raised on some rank (message holds every rank's error)."""


class RankDied(JobFailed):
    """A rank's process ended without reporting: a crash, not an exception."""


class DistPool:
    """``world_size`` spawned ranks sharing a gloo process group."""

    def __init__(self, world_size: int, pg_timeout: float = _PG_TIMEOUT_S) -> None:
        self.world_size = world_size
        self.pg_timeout = pg_timeout
        self._procs: list[mp.Process] = []
        self._conns: list[Any] = []
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)  # only read when the server starts
        fd, init_file = tempfile.mkstemp(prefix="fsdp_compose_pg_")
        os.close(fd)
        os.unlink(init_file)  # the file store creates it
        self._init_file = init_file
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker,
                args=(rank, self.world_size, init_file, child, self.pg_timeout, dict(os.environ)),
                daemon=True,
            )
            proc.start()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect(timeout=120.0, what="process group start-up")

    def _collect(self, timeout: float, what: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        errors: dict[int, str] = {}
        died = False  # a rank's process ended without reporting
        while pending:
            for rank in sorted(pending):
                conn = self._conns[rank]
                if conn.poll(0.01):
                    try:
                        status, value = conn.recv()
                    except EOFError:
                        status, value, died = "error", "rank process exited unexpectedly", True
                    pending.discard(rank)
                    if status == "error":
                        errors[rank] = value
                    else:
                        results[rank] = value
                elif not self._procs[rank].is_alive():
                    pending.discard(rank)
                    errors[rank] = f"rank process died (exit code {self._procs[rank].exitcode})"
                    died = True
            if errors and pending:
                # Other ranks may be stuck in a collective with the failed one; give
                # them a moment to fail on their own, then stop waiting.
                deadline = min(deadline, time.monotonic() + 10.0)
            if time.monotonic() > deadline:
                for rank in pending:
                    errors[rank] = f"no result within {timeout:.0f}s (hang?)"
                break
        if errors:
            self.close()
            detail = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
            raise (RankDied if died else JobFailed)(f"{what} failed on ranks {sorted(errors)}:\n{detail}")
        return results

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any
    ) -> list[Any]:
        """Runs ``fn(*args, **kwargs)`` on every rank; returns the per-rank results."""
        if not self._procs:
            self._start()
        payload = pickle.dumps((fn, args, kwargs))
        for conn in self._conns:
            conn.send(payload)
        return self._collect(
            timeout, f"{getattr(fn, '__name__', fn)} (world size {self.world_size})"
        )

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2)
        self._procs, self._conns = [], []
        try:
            os.unlink(self._init_file)
        except OSError:
            pass


_pools: dict[tuple[int, float], DistPool] = {}


def get_pool(world_size: int, pg_timeout: float = _PG_TIMEOUT_S) -> DistPool:
    """The session's pool of ``world_size`` ranks whose process group times out
    after ``pg_timeout`` seconds."""
    key = (world_size, pg_timeout)
    pool = _pools.get(key)
    if pool is None:
        pool = _pools[key] = DistPool(world_size, pg_timeout)
    return pool


# [Note: a rank that dies]
# About one full-suite run in six on a 2-core machine, a rank process dies inside a
# gloo collective (in torch's DTensor.full_tensor each time seen; dmesg showed a
# segfault in gloo's pt_gloo_runloop thread, in glibc's malloc: heap corruption), in a
# different test each time, each of which passed when run again. The cause is not
# found; an instrumented run of the suite found no fsdp_compose storage freed while a
# collective could still touch it. run_distributed runs such a job once more on a
# fresh pool, with a warning: a crash that happens twice fails the test, and any
# exception on a rank fails it at once. Tests that kill a rank on purpose call
# DistPool.run, which never retries.


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, **kwargs: Any
) -> list[Any]:
    """Runs ``fn`` on ``world_size`` gloo ranks (see :class:`DistPool`), once more on a
    fresh pool if a rank's process dies ([Note: a rank that dies])."""
    pool = get_pool(world_size)
    try:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
    except RankDied as exc:
        first_line = str(exc).splitlines()[0]
        warnings.warn(f"{first_line} (a rank process died); ran it once more", RuntimeWarning)
        return pool.run(fn, *args, timeout=timeout, **kwargs)


def _run_script(path: str, argv: list[str], env: dict[str, str], log: str) -> None:
    """``python path *argv`` in this forked process, output to ``log``."""
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))  # as the interpreter does for a script
    runpy.run_path(path, run_name="__main__")


class ScriptProcess:
    """A script started by :func:`start_script`, with the part of
    :class:`subprocess.Popen`'s interface the tests use (``returncode`` is
    negative for a signal, as Popen's)."""

    def __init__(self, proc: Any) -> None:
        self._proc = proc
        self.pid: int = proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(str(self._proc.name), timeout or 0.0)
        return self._proc.exitcode

    def kill(self) -> None:
        self._proc.kill()


def start_script(path: str, argv: list[str], *, env: dict[str, str], log: str) -> ScriptProcess:
    """Runs the script ``path`` with arguments ``argv`` and environment ``env`` in
    a new process, as ``python path *argv`` would, stdout and stderr to the file
    ``log``; the process is forked from the ranks' server, which has imported
    torch and fsdp_compose already (see [Note: ranks forked from a server]).

    A script that returns exits with 0, ``sys.exit(code)`` with ``code``, an
    exception with 1 (its traceback in the log), a signal with minus its number.
    The process waits for its non-daemon threads before it exits, as an
    interpreter does, but runs no ``atexit`` handler.
    """
    open(log, "w").close()  # the test may read it before the script writes anything
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    proc = ctx.Process(
        target=_run_script, args=(path, argv, env, log), name=os.path.basename(path), daemon=True
    )
    proc.start()
    return ScriptProcess(proc)


@atexit.register
def _close_pools() -> None:
    for pool in _pools.values():
        pool.close()
    _pools.clear()
