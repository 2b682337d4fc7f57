"""Crash-safe periodic checkpoints with ``torch.distributed.checkpoint`` (DCP), and resume.

A few functions for a training loop, not a framework::

    torchrun --nproc-per-node 2 examples/checkpoint.py --dir /tmp/gpt_ckpt --steps 20 --save-every 5
    # stop it at any time (even kill -9 a rank) and run it again: it resumes from the
    # newest complete checkpoint; a different --nproc-per-node reshards on load
    torchrun --nproc-per-node 4 examples/checkpoint.py --dir /tmp/gpt_ckpt --steps 30 --save-every 5

Every checkpoint is one DCP directory holding the sharded model and optimizer
state (``get_state_dict``) and the step count::

    /tmp/gpt_ckpt/step_00000010/       complete: .metadata + one __<rank>_0.distcp per rank
    /tmp/gpt_ckpt/step_00000015.tmp/   a save in progress, or one a crash interrupted

A save writes into ``<name>.tmp`` and renames it to ``<name>`` only once every rank
has written its shard and rank 0 has written ``.metadata``. A rename within one
directory is atomic, so a crash at any moment leaves the previous checkpoints
intact and :func:`resume` never picks a partial one. All ranks must see the same
``--dir`` (a local disk on one machine, or a shared file system).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import DefaultLoadPlanner, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

__all__ = [
    "CheckpointMismatchError",
    "StrictLoadPlanner",
    "checkpoint_path",
    "latest_checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "resume",
]

_NAME = re.compile(r"^step_(\d{8})$")


class CheckpointMismatchError(ValueError):
    """A checkpoint's keys or shapes do not match the state it is loaded into.

    Raised before any tensor is read, so the model and optimizer are unchanged.
    """


# ---------------------------------------------------------------------------
# validation: the first mismatching key, before anything is read
# ---------------------------------------------------------------------------


def _in_sections(key: str, sections: Iterable[str]) -> bool:
    return any(key == s or key.startswith(s + ".") for s in sections)


def _first_mismatch(
    target: dict[str, Any], metadata: Metadata, sections: list[str]
) -> str | None:
    """Describes the first key where ``target`` (a flattened state dict) and the
    checkpoint disagree, or returns ``None`` if they match.

    Only checkpoint keys under the top-level ``sections`` being loaded count, so
    e.g. loading just ``{"model": ...}`` from a checkpoint that also holds
    ``"optim"`` is fine.
    """
    saved = metadata.state_dict_metadata
    for key, value in target.items():
        entry = saved.get(key)
        if entry is None:
            return f"{key!r} is in the state being loaded but not in the checkpoint"
        if isinstance(value, torch.Tensor):
            if not isinstance(entry, TensorStorageMetadata):
                return f"{key!r} is a tensor in the state being loaded but not in the checkpoint"
            if tuple(entry.size) != tuple(value.shape):
                return (
                    f"{key!r} has shape {tuple(entry.size)} in the checkpoint but "
                    f"{tuple(value.shape)} in the state being loaded"
                )
    extra = [k for k in saved if k not in target and _in_sections(k, sections)]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        return f"{extra[0]!r}{more} is in the checkpoint but not in the state being loaded"
    return None


class StrictLoadPlanner(DefaultLoadPlanner):
    """A :class:`DefaultLoadPlanner` that refuses a checkpoint whose keys or shapes
    differ from the state dict being loaded, in either direction.

    DCP's default planner already rejects keys missing from the checkpoint and
    shape mismatches, but it silently ignores keys the checkpoint has and the
    model lacks (e.g. a 4-layer checkpoint loaded into a 3-layer model). This
    check runs while DCP plans the load, before any rank reads a byte, so a
    mismatch leaves every rank's state untouched.

    Pass it as ``dcp.load(state, checkpoint_id=path, planner=StrictLoadPlanner())``;
    DCP then raises a ``CheckpointException`` carrying a
    :class:`CheckpointMismatchError` (:func:`load_checkpoint` unwraps it).
    """

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        assert metadata is not None
        problem = _first_mismatch(self.state_dict, metadata, list(state_dict))
        if problem is not None:
            raise CheckpointMismatchError(
                f"checkpoint does not match: {problem}. Nothing was loaded. Build the model "
                "with the configuration the checkpoint was saved from."
            )


# ---------------------------------------------------------------------------
# where checkpoints live
# ---------------------------------------------------------------------------


def checkpoint_path(root: str, step: int) -> str:
    """The directory of the checkpoint taken after ``step`` optimizer steps."""
    return os.path.join(root, f"step_{step:08d}")


def _complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every complete checkpoint under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _NAME.match(name)
        path = os.path.join(root, name)
        # The rename happens after .metadata is written; checking for it as well
        # also skips directories someone copied in by hand and left incomplete.
        if match and os.path.isfile(os.path.join(path, ".metadata")):
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(root: str) -> tuple[int, str] | None:
    """``(step, path)`` of the newest complete checkpoint under ``root``, if any.

    Reads the local directory listing; :func:`resume` makes the ranks agree on it.
    """
    found = _complete_checkpoints(root)
    return found[-1] if found else None


def _fsync_dir(path: str) -> None:
    # A rename is durable only once the directory entry itself is on disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------
# save / load / resume
# ---------------------------------------------------------------------------


def save_checkpoint(
    root: str, step: int, model: nn.Module, optim: torch.optim.Optimizer, *, keep: int = 2
) -> str:
    """Saves the sharded model and optimizer state after ``step`` steps, atomically.

    Every rank writes only its own shards (no gather, no copy). Collective: call on
    every rank. Keeps the ``keep`` newest complete checkpoints (``0`` keeps all) and
    deletes older ones and the leftovers of interrupted saves.

    Returns:
        The checkpoint's directory.
    """
    final = checkpoint_path(root, step)
    tmp = final + ".tmp"
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        # An interrupted earlier attempt at this step (maybe at another world size)
        # may have left shard files that this save would not overwrite.
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()

    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": step}, checkpoint_id=tmp)
    # dcp.save returns once every rank's files are written and synced and rank 0
    # has written .metadata: the checkpoint is complete, so publish it.
    if rank == 0:
        if os.path.exists(final):  # re-saving a step after resuming from an older one
            stale = final + ".old"
            shutil.rmtree(stale, ignore_errors=True)
            os.rename(final, stale)
            os.rename(tmp, final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
        if keep > 0:
            for _, old in _complete_checkpoints(root)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        for name in os.listdir(root):
            if name.endswith((".tmp", ".old")):  # interrupted saves (of other steps)
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(
    path: str, model: nn.Module, optim: torch.optim.Optimizer | None = None
) -> int:
    """Loads a checkpoint written by :func:`save_checkpoint` into ``model`` (and
    ``optim``), resharding to the current world size if it differs.

    ``model`` may have been built on the meta device and materialised with
    ``to_empty`` after ``fully_shard``: each rank reads only the saved shards that
    overlap its own, and the full model never exists anywhere. Collective: call on every rank.

    Raises:
        CheckpointMismatchError: the checkpoint's keys or shapes differ from the
            model's (or optimizer's); names the first mismatching key. Nothing is
            loaded in that case.

    Returns:
        The step count stored in the checkpoint.
    """
    if optim is None:
        state: dict[str, Any] = {"model": get_model_state_dict(model), "step": -1}
    else:
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd, "step": -1}
    try:
        dcp.load(state, checkpoint_id=path, planner=StrictLoadPlanner())
    except dcp.CheckpointException as exc:
        # DCP wraps each rank's error; a mismatch is the same on every rank and
        # reads better unwrapped.
        for error, _trace in exc.failures.values():
            if isinstance(error, CheckpointMismatchError):
                raise CheckpointMismatchError(f"{path}: {error}") from None
        raise
    # dcp.load filled the tensors in place; set_state_dict hands the optimizer its
    # state (keyed by parameter name) and loads the model's sharded tensors.
    if optim is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


def resume(root: str, model: nn.Module, optim: torch.optim.Optimizer) -> int:
    """Loads the newest complete checkpoint under ``root``, if there is one.

    Rank 0 chooses the checkpoint and tells the others, so all ranks load the same
    one even if their view of the directory differs. Collective.

    Returns:
        The step to continue from (0 when there is no checkpoint).
    """
    choice = [latest_checkpoint(root) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return 0
    _, path = choice[0]
    return load_checkpoint(path, model, optim)


# ---------------------------------------------------------------------------
# demo: train the example GPT with periodic checkpoints and resume
# ---------------------------------------------------------------------------


def _parse_args() -> argparse.Namespace:
    from gpt import PRESETS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="checkpoint root directory")
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=20, help="train until this many steps are done")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--keep", type=int, default=2, help="complete checkpoints to keep")
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args()


def main() -> None:
    from gpt import GPT, PRESETS, loss_fn, make_batch
    from parallelize import apply_fsdp
    from launch import init_distributed

    args = _parse_args()
    rank, world, device = init_distributed()
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the world size {world}")

    # Build on the meta device: each rank allocates only its shards, and a resumed
    # run never materialises the full model.
    cfg = PRESETS[args.preset]
    with torch.device("meta"):
        model = GPT(cfg)
    apply_fsdp(model)
    model.to_empty(device=device)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)

    start = resume(args.dir, model, optim)
    if start == 0:
        model.init_weights(seed=0)
    if rank == 0:
        print(f"{'resumed from step ' + str(start) if start else 'starting from scratch'} "
              f"on {world} ranks (checkpoints in {args.dir})", flush=True)

    local = args.batch_size // world
    for step in range(start, args.steps):
        x, y = make_batch(cfg, args.batch_size, step)  # the data depends only on the step
        x, y = x[rank * local : (rank + 1) * local].to(device), y[rank * local : (rank + 1) * local].to(device)
        loss = loss_fn(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        mean = loss.detach().float()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step:3d} | loss {mean.item() / world:.4f}", flush=True)
        done = step + 1
        if done % args.save_every == 0 or done == args.steps:
            path = save_checkpoint(args.dir, done, model, optim, keep=args.keep)
            if rank == 0:
                size = sum(e.stat().st_size for e in os.scandir(path))
                print(f"saved {path} ({size / 2**20:.2f} MiB)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
