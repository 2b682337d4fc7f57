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
import json
import os
import re
import shutil
import zlib
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
from torch.utils._pytree import tree_map

__all__ = [
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "StrictLoadPlanner",
    "checkpoint_path",
    "latest_checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "resume",
    "verify_checkpoint",
]

_NAME = re.compile(r"^step_(\d{8})$")


class CheckpointCorruptError(RuntimeError):
    """A checkpoint file is missing, truncated or altered since it was saved.

    Raised before any tensor is read, so the model and optimizer are unchanged.
    """


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
# per-file checksums: written with the checkpoint, verified before a load
# ---------------------------------------------------------------------------

CHECKSUMS = "checksums.json"  # {file name: [size in bytes, crc32]}, written by rank 0


def _file_checksum(path: str) -> list[int]:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return [size, crc]


def _my_share(names: list[str]) -> list[str]:
    # Each rank hashes a share of the files, so saving and verifying read every
    # byte once in all, in parallel.
    rank, world = dist.get_rank(), dist.get_world_size()
    return [n for i, n in enumerate(sorted(names)) if i % world == rank]


def _write_checksums(path: str) -> None:
    """Records the size and CRC-32 of every file of a finished DCP save (collective)."""
    names = sorted(os.listdir(path)) if dist.get_rank() == 0 else []
    listing = [names]
    dist.broadcast_object_list(listing, src=0)
    mine = {n: _file_checksum(os.path.join(path, n)) for n in _my_share(listing[0])}
    shares: list[dict[str, list[int]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(shares, mine)
    if dist.get_rank() == 0:
        merged = {k: v for share in shares if share for k, v in share.items()}
        with open(os.path.join(path, CHECKSUMS), "w") as f:
            json.dump(merged, f, indent=0, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())


def verify_checkpoint(path: str) -> bool:
    """Checks every file of a checkpoint against the checksums recorded when it was
    saved (collective). Raises :class:`CheckpointCorruptError` on every rank,
    naming the first file that is missing or differs.

    Returns:
        ``False`` if the checkpoint has no checksums (saved by an older version,
        or by ``dcp.save`` directly), ``True`` once every file has been verified.
    """
    recorded_path = os.path.join(path, CHECKSUMS)
    found = [os.path.isfile(recorded_path)]
    dist.broadcast_object_list(found, src=0)  # rank 0 decides, so all ranks agree
    if not found[0]:
        return False
    with open(recorded_path) as f:
        recorded: dict[str, list[int]] = json.load(f)
    problems = {}
    for name in _my_share(list(recorded)):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            problems[name] = "is missing"
            continue
        size, crc = _file_checksum(file)
        want_size, want_crc = recorded[name]
        if size != want_size:
            problems[name] = f"has {size} bytes, {want_size} were saved (truncated or appended to)"
        elif crc != want_crc:
            problems[name] = "does not match its checksum (its content changed since it was saved)"
    everyone: list[dict[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    merged = {k: v for share in everyone if share for k, v in share.items()}
    if merged:
        name = min(merged)
        more = f" (and {len(merged) - 1} more file(s): {sorted(merged)[1:]})" if len(merged) > 1 else ""
        raise CheckpointCorruptError(
            f"{path}: checkpoint file {name!r} {merged[name]}{more}. Nothing was loaded; "
            "load an older checkpoint (see latest_checkpoint) or restore the file."
        )
    return True


def _staging_copy(state: Any) -> Any:
    """Tensors of the same type, shape and layout (DTensors stay DTensors) that a
    load fills instead of the live model and optimizer state."""
    return tree_map(lambda v: torch.empty_like(v) if isinstance(v, torch.Tensor) else v, state)


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
    # has written .metadata: record their checksums, then publish the checkpoint.
    _write_checksums(tmp)
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

    The load is all or nothing: the files are first verified against the
    checksums recorded at save time, then read into staging tensors (one extra
    copy of this rank's shards while loading), and the model and optimizer are
    updated only once everything was read.

    Raises:
        CheckpointMismatchError: the checkpoint's keys or shapes differ from the
            model's (or optimizer's); names the first mismatching key.
        CheckpointCorruptError: a checkpoint file is missing, truncated or
            altered; names the file.
        Any error DCP raises while reading. In every case nothing was loaded:
        the model and optimizer are as they were.

    Returns:
        The step count stored in the checkpoint.
    """
    verify_checkpoint(path)
    if optim is None:
        state: dict[str, Any] = {"model": get_model_state_dict(model), "step": -1}
    else:
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd, "step": -1}
    # DCP writes into the tensors it is given, the live parameters included: a
    # read that fails half-way must not leave the model half overwritten.
    state = _staging_copy(state)
    try:
        dcp.load(state, checkpoint_id=path, planner=StrictLoadPlanner())
    except dcp.CheckpointException as exc:
        # DCP wraps each rank's error; a mismatch is the same on every rank and
        # reads better unwrapped.
        for error, _trace in exc.failures.values():
            if isinstance(error, CheckpointMismatchError):
                raise CheckpointMismatchError(f"{path}: {error}") from None
        raise
    # dcp.load filled the staging tensors; set_state_dict copies them into the
    # model's sharded parameters and hands the optimizer its state.
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
    from launch import finish, init_distributed

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
    finish()


if __name__ == "__main__":
    main()
