"""How the examples start: under ``torchrun``, or as one process without it."""

from __future__ import annotations

import gc
import os
import sys
import time

import torch
import torch.distributed as dist


def init_distributed(backend: str | None = None) -> tuple[int, int, torch.device]:
    """Initialises the default process group and returns ``(rank, world size, device)``.

    Under ``torchrun`` (which sets ``RANK`` and ``WORLD_SIZE``) this is
    ``dist.init_process_group(backend)``. Started as ``python examples/<script>.py``,
    the script runs as a single process (world size 1) after saying how to start
    several, instead of failing with torch's "RANK expected, but not set".

    Args:
        backend: the process-group backend; defaults to NCCL with CUDA, else gloo.
    """
    use_cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if use_cuda else "gloo")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        script = sys.argv[0] if sys.argv and sys.argv[0] else "<script>"
        print(
            f"{script}: not started by torchrun, so running as one process; for N processes "
            f"run: torchrun --nproc-per-node N {script}",
            file=sys.stderr,
        )
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if use_cuda
        else torch.device("cpu")
    )
    if use_cuda:
        torch.cuda.set_device(device)
    return rank, world, device


def finish() -> None:
    """Ends the default process group, then gives gloo's worker threads a moment to
    drop their last references before the interpreter exits.

    A gloo worker marks a collective complete a moment before it releases the tensors
    it held; if it releases the last reference to a Python-owned tensor while the
    interpreter is already finalizing, the process aborts with "terminate called
    without an active exception" (a torch/gloo teardown race any gloo program can hit,
    rarely). Collecting garbage and yielding the GIL briefly lets such a worker finish
    while the interpreter is still alive.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    time.sleep(0.1)
