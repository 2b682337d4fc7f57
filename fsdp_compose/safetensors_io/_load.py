"""Loading a safetensors checkpoint into a (sharded) module.

[Note: what DCP's HuggingFaceStorageReader does and what is kept here]
The reading is ``torch.distributed.checkpoint.load`` with its
``HuggingFaceStorageReader``, with ``no_dist=True`` (no collective): DCP's planner
computes each rank's part of every ``DTensor`` (``Shard``, ``_StridedShard``, HSDP
replicas, uneven and empty shards) and the reader copies that slice of the
memory-mapped file into the local shard, casting to its dtype. Kept here is what
DCP lacks:

* the files: the reader takes every ``*.safetensors`` of a directory; a single
  file, or the files an index names (not a stale shard beside them), is served by
  giving it the headers :func:`read_headers` read and checked (``_reader``);
* the key map (model key -> file key) and tied weights (loaded once);
* one error naming every missing, unexpected and mis-shaped tensor, before
  anything changes (DCP stops at the first, after reading earlier tensors);
* meta parameters materialized in place (DCP's meta handling makes new tensor
  objects, which an optimizer already holding the parameters would not see);
* the memory bound: DCP's reader keeps a file open while it reads all of that
  file's tensors, and the mapped pages it touched stay resident until then (a
  rank's peak: its shards plus its part of a whole file). ``_reader`` hands it one
  tensor at a time: the shards plus one tensor's slice (BENCHMARKS.md).

[Note: a load failing on one rank]
Every rank reads its own files, so one rank may fail alone (its copy of the file
unreadable, truncated or replaced). Were it to raise alone, the others would
return and wait in their next collective until the process group's timeout.
So, when the module holds ``DTensor``s and a process group exists, the ranks of
``process_group`` agree twice, with one all-reduce of one integer each: after
every header was checked (before any tensor is modified) and after the copies.
Where one rank failed, it raises its own error and every other rank a
``RuntimeError`` quoting it; the process group stays usable. A module of plain
tensors (e.g. loaded on rank 0 alone) communicates nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import warnings
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .._runtime import ToolCollectives, invalidate_unsharded
from ._format import DTYPES, Entry, KeyMap, names_of, read_headers, safe_open_fn
from ._ranks import raise_if_any_failed

logger = logging.getLogger("fsdp_compose")


@dataclass
class LoadResult:
    """What :func:`load_safetensors` did.

    Attributes:
        loaded: model state-dict keys that were loaded.
        missing: model keys that the checkpoint does not have (only with ``strict=False``).
        unexpected: checkpoint tensors no model key maps to (only with ``strict=False``).
        bytes_read: bytes this rank read from the files (its own slices only).
    """

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    bytes_read: int = 0


@dataclass
class Target:
    keys: list[str]  # tied keys share one tensor
    tensor: torch.Tensor
    is_param: bool
    file_key: str | None = None

    @property
    def local(self) -> torch.Tensor:
        return self.tensor.to_local() if isinstance(self.tensor, DTensor) else self.tensor


def targets_of(module: nn.Module) -> list[Target]:
    """The module's state-dict tensors, tied keys grouped (by tensor identity)."""
    # state_dict(keep_vars=True) also reshards fsdp_compose units, so the sharded
    # parameters are the registered ones.
    state = module.state_dict(keep_vars=True)
    params = {id(p) for p in module.parameters()}
    groups: dict[int, Target] = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        target = groups.get(id(value))
        if target is None:
            groups[id(value)] = Target([key], value, id(value) in params)
        else:
            target.keys.append(key)
    return list(groups.values())


def _plan_load(
    targets: list[Target], entries: dict[str, Entry], key_map: KeyMap, strict: bool, source: str
) -> tuple[list[str], list[str]]:
    """Matches model keys to checkpoint tensors and checks shapes and dtypes;
    raises one error listing every problem."""
    problems: list[str] = []
    missing: list[str] = []
    used: set[str] = set()
    for t in targets:
        names = [name for name in map(key_map, t.keys) if name is not None]
        used.update(n for n in names if n in entries)
        if not names:  # the key map skips this tensor
            continue
        t.file_key = next((n for n in names if n in entries), None)
        if t.file_key is None:
            missing.append(t.keys[0])
            continue
        entry = entries[t.file_key]
        where = f"tensor {t.file_key!r} in {entry.file}"
        if entry.shape != tuple(t.tensor.shape):
            problems.append(
                f"{where} has shape {list(entry.shape)}, but the model's {t.keys[0]!r} has shape "
                f"{list(t.tensor.shape)}"
            )
            continue
        file_dtype = DTYPES.get(entry.dtype)
        if file_dtype is None:
            problems.append(f"{where} has dtype {entry.dtype}, which this torch cannot represent")
            continue
        if file_dtype.is_floating_point != t.tensor.dtype.is_floating_point:
            problems.append(
                f"{where} has dtype {entry.dtype}, which cannot be converted to the model's "
                f"{t.keys[0]!r} of dtype {t.tensor.dtype}"
            )
    unexpected = sorted(set(entries) - used)
    if strict and missing:
        problems.append(
            f"missing from the checkpoint {source}: {names_of(missing, 10)} (pass key_map to rename keys, or "
            "strict=False to leave them as they are)"
        )
    if strict and unexpected:
        detail = ", ".join(f"{n!r} in {entries[n].file}" for n in unexpected[:10])
        more = f" and {len(unexpected) - 10} more" if len(unexpected) > 10 else ""
        problems.append(
            f"tensors in the checkpoint that no model key maps to: {detail}{more} (pass key_map to "
            "rename or skip keys, or strict=False to ignore them)"
        )
    if problems:
        raise ValueError(
            "load_safetensors: nothing was loaded, the checkpoint does not match the model:\n  - "
            + "\n  - ".join(problems)
        )
    return missing, unexpected


def _reader(entries: dict[str, Entry]) -> Any:
    """DCP's ``HuggingFaceStorageReader`` over the checked headers (see [Note: what
    DCP's HuggingFaceStorageReader does and what is kept here])."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    # The reader's per-tensor record is private to DCP; its own read_metadata
    # builds the same one per header entry.
    from torch.distributed.checkpoint._hf_utils import _HFStorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.futures import Future

    class _Reader(HuggingFaceStorageReader):
        bytes_read = 0

        def read_metadata(self) -> Metadata:
            tensors, storage = {}, {}
            for key, e in entries.items():
                size = torch.Size(e.shape)
                offsets = torch.Size([0] * len(size))
                tensors[key] = TensorStorageMetadata(
                    TensorProperties(dtype=DTYPES[e.dtype]),
                    size,
                    [ChunkStorageMetadata(offsets, size)],
                )
                storage[MetadataIndex(key, offsets)] = _HFStorageInfo(e.file, size, DTYPES[e.dtype])
            return Metadata(state_dict_metadata=tensors, storage_data=storage)  # type: ignore[arg-type]

        def read_data(self, plan: Any, planner: Any) -> Any:
            # One safe_open per tensor, not per file: the mapped pages of a tensor
            # are released before the next is read (the memory bound).
            for fqn, group in groupby(plan.items, key=lambda item: item.storage_index.fqn):
                items = list(group)
                super().read_data(dataclasses.replace(plan, items=items), planner)
                size = DTYPES[entries[fqn].dtype].itemsize
                self.bytes_read += sum(math.prod(item.lengths) * size for item in items)
            done: Future[None] = Future()
            done.set_result(None)
            return done

    return _Reader(os.path.dirname(next(iter(entries.values())).file))


def _replaced_error(path: str, entries: dict[str, Entry]) -> Exception | None:
    """The error for a read that failed after the headers were checked: names the
    tensors whose header changed (the file was replaced while loading), else ``None``."""
    try:
        now = read_headers(path)
    except (OSError, ValueError) as reread:
        return reread
    changed = [
        f"tensor {k!r} in {e.file} now has shape {list(now[k].shape)}, dtype {now[k].dtype}, but had "
        f"shape {list(e.shape)}, dtype {e.dtype}"
        for k, e in entries.items()
        if k in now and now[k] != e
    ]
    return (
        ValueError(
            f"load_safetensors: {'; '.join(changed)}: the file was replaced while loading. Some tensors "
            "hold the new values, the others their previous ones: load again once it is complete."
        )
        if changed
        else None
    )


def _owners(module: nn.Module, tensor: torch.Tensor, is_param: bool) -> list[tuple[nn.Module, str]]:
    owners: list[tuple[nn.Module, str]] = []
    for m in module.modules():
        slots = m._parameters if is_param else m._buffers
        owners.extend((m, name) for name, v in slots.items() if v is tensor)
    return owners


def _materialize(module: nn.Module, t: Target, device: torch.device) -> None:
    """Gives a meta tensor uninitialized storage with the same layout (only the
    local shard is allocated).

    The tensor object stays the same (``torch.utils.swap_tensors``, as
    ``nn.Module._apply`` does with swapping enabled), so an optimizer created on
    the meta parameters and every module a tied weight is registered on see the
    data. Where swapping is refused, the new tensor is registered wherever the
    meta one was instead.
    """
    old = t.tensor
    local = torch.empty(t.local.shape, dtype=old.dtype, device=device)
    new: torch.Tensor = local
    if isinstance(old, DTensor):
        new = DTensor.from_local(
            local,
            old.device_mesh,
            old.placements,
            run_check=False,
            shape=old.shape,
            stride=old.stride(),
        )
    if t.is_param:
        new = nn.Parameter(new, requires_grad=old.requires_grad)
    attributes = dict(old.__dict__)  # e.g. fsdp_compose's ownership mark
    try:
        torch.utils.swap_tensors(old, new)
    except RuntimeError as exc:  # e.g. weak references to the meta tensor
        logger.debug(
            "load_safetensors: cannot swap %s in place (%s); re-registering", t.keys[0], exc
        )
    else:
        old.__dict__.update(attributes)
        return
    for owner, name in _owners(module, old, t.is_param):
        if t.is_param:
            owner._parameters[name] = new  # type: ignore[assignment]
        else:
            owner._buffers[name] = new
    t.tensor = new


def _default_device(targets: list[Target]) -> torch.device:
    for t in targets:
        if isinstance(t.tensor, DTensor):
            mesh = t.tensor.device_mesh
            if mesh.device_type == "cuda":
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device(mesh.device_type)
    return torch.device("cpu")


@torch.no_grad()
def load_safetensors(
    module: nn.Module,
    path: str | os.PathLike[str],
    *,
    key_map: KeyMap | None = None,
    strict: bool = True,
    device: torch.device | str | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> LoadResult:
    """Loads a safetensors checkpoint into a (sharded) module, each rank reading
    only its own part of each tensor.

    ``module``'s parameters may be fsdp_compose's sharded ``DTensor``s (on a 1-D
    mesh, an HSDP mesh, or a ``dp x tp`` mesh with tensor parallel), other
    ``DTensor``s, or plain tensors; on the meta device (built under
    ``torch.device("meta")`` and annotated with ``fully_shard``) or materialized.
    Meta tensors are materialized on ``device``, in place (the same
    ``Parameter`` objects, so an optimizer may already hold them): only the local shard
    is allocated.
    Values are cast to each tensor's dtype (e.g. a bfloat16 file into float32
    parameters). Tied parameters (one tensor under several names) are loaded once,
    from whichever of their names the checkpoint has.

    Every rank reads its own slices through DCP's ``HuggingFaceStorageReader``
    (see [Note: what DCP's HuggingFaceStorageReader does and what is kept here]). For a module holding ``DTensor``s, the ranks of ``process_group``
    agree on the outcome (two all-reduces of one integer), so that a failure on
    one rank raises on every rank (see [Note: a load failing on one rank]); a
    module of plain tensors communicates nothing. Non-persistent buffers are not
    part of a checkpoint: a module built on the meta device must initialize them
    itself (e.g. rotary embedding frequencies).

    Args:
        module: the model (the same on every rank).
        path: a ``.safetensors`` file, a Hugging Face ``model.safetensors.index.json``,
            or a directory holding either.
        key_map: maps a model state-dict key to the checkpoint's tensor name, or to
            ``None`` to skip it. Default: identity.
        strict: raise if a model key is missing from the checkpoint or a checkpoint
            tensor is not used; with ``False`` they are reported in the result.
        device: where meta tensors are materialized. Default: the mesh's device
            (the current CUDA device for a CUDA mesh), else the CPU.
        process_group: the ranks that load this module together (as in
            ``torch.distributed.checkpoint.load``; e.g. one pipeline stage's
            ranks). Default: every rank.

    Returns:
        A :class:`LoadResult`.

    Raises:
        ValueError, FileNotFoundError: a missing, truncated or mismatching
            checkpoint (key, shape, dtype kind), naming the tensor and the file.
            Every header is read and checked before any tensor is modified.
        RuntimeError: loading failed on another rank of ``process_group``
            (quoting its error).
    """
    key_map = key_map or (lambda k: k)
    targets = targets_of(module)
    agree = dist.is_available() and dist.is_initialized()
    agree = agree and any(isinstance(t.tensor, DTensor) for t in targets)
    error: BaseException | None = None
    try:
        safe_open_fn()  # the safetensors package: checked before anything changes
        entries = read_headers(path)
        missing, unexpected = _plan_load(targets, entries, key_map, strict, os.fspath(path))
    except Exception as exc:
        error = exc
    comms = ToolCollectives("safetensors.load", process_group, owner=module)
    _settle(error, agree, comms, "nothing was loaded")

    dev = torch.device(device) if device is not None else _default_device(targets)
    result = LoadResult(missing=missing, unexpected=unexpected)
    try:
        _copy(module, targets, entries, dev, result, os.fspath(path))
    except Exception as exc:
        error = exc
    outcome = "this rank loaded every tensor, the failing rank only some: load again"
    _settle(error, agree, comms, outcome)
    still_meta = [n for n, b in module.named_buffers() if b.is_meta]
    if still_meta:
        logger.warning(
            "load_safetensors: buffers not in the checkpoint are still on the meta device: %s; "
            "initialize them before the first forward",
            names_of(still_meta, 10),
        )
    return result


def _settle(error: BaseException | None, agree: bool, comms: ToolCollectives, outcome: str) -> None:
    """Raises ``error``; with ``agree``, every rank of ``comms``' group raises if
    any failed (see [Note: a load failing on one rank])."""
    if agree:
        raise_if_any_failed(error, "load_safetensors", comms, outcome)
    elif error is not None:
        raise error


def _copy(
    module: nn.Module,
    targets: list[Target],
    entries: dict[str, Entry],
    dev: torch.device,
    result: LoadResult,
    path: str,
) -> None:
    """Reads this rank's part of every matched tensor into its local shard through
    DCP, materializing meta tensors on ``dev``."""
    import torch.distributed.checkpoint as dcp

    to_load: dict[str, torch.Tensor] = {}
    materialized = False
    try:
        for t in [t for t in targets if t.file_key is not None]:
            if t.tensor.is_meta:
                _materialize(module, t, dev)
                materialized = True
            to_load[t.file_key] = t.tensor  # type: ignore[index]
            result.loaded.extend(t.keys)
    finally:  # also after a failure: units re-derive their buffers at their next use
        if materialized:
            invalidate_unsharded(module)
    if not to_load:
        return
    reader = _reader({key: entries[key] for key in to_load})
    try:
        with warnings.catch_warnings():  # no_dist is the intent (no collective)
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to load in a single process"
            )
            dcp.load(to_load, storage_reader=reader, no_dist=True)
    except (Exception, dcp.CheckpointException) as exc:  # the latter is a BaseException
        error = _replaced_error(path, entries)
        if error is not None:
            raise error from exc
        if isinstance(exc, Exception):
            raise
        raise RuntimeError(f"load_safetensors: reading {path} failed: {exc}") from exc
    result.bytes_read = reader.bytes_read
