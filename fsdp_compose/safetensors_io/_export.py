"""Writing safetensors in Hugging Face's layout, from a sharded module or a DCP checkpoint.

[Note: streaming export]
``safetensors.torch.save_file`` needs every tensor of a file in memory at once.
The export instead lays out every file first (the header only needs names,
dtypes and shapes, which every rank knows without communication), writes the
headers, then appends each tensor's bytes as soon as it is gathered. Files are
written under temporary names and renamed at the end, the index (or the single
``model.safetensors``) last, so an interrupted export never looks complete.

[Note: why not DCP's HuggingFaceStorageWriter]
It does not keep the memory bound or the layout. Without ``save_distributed`` it
writes *full* tensors held on one rank (the whole model), each file serialized
into one bytes object; with ``save_distributed=True, enable_consolidation=True``
each rank serializes all its shards into one bytes object under ``sharded/``
(left behind: every byte written and kept twice), then the coordinator rewrites
them one full tensor at a time into ``model-0000i-of-0000n.safetensors`` (never
``model.safetensors``), in place, so an older export is overwritten before the new
one is complete. Neither splits by ``max_shard_size``. The gather is not
``DTensor.full_tensor()`` either: its all-gather puts a padded output and the full
tensor on every rank (measured in BENCHMARKS.md), where :func:`_gather_to_rank0`
holds one full tensor on rank 0 only.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .._runtime import ToolCollectives
from ._format import (
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_FILE,
    SINGLE_FILE,
    KeyMap,
    OutFile,
    OutTensor,
    check_names,
    parse_size,
    split_files,
)
from ._load import targets_of
from ._ranks import agree_ok, dist_on, raise_if_any_failed

logger = logging.getLogger("fsdp_compose")


def _write_bytes(f: Any, tensor: torch.Tensor) -> None:
    data = tensor.detach().to("cpu").contiguous().reshape(-1)
    if data.numel():
        f.write(data.view(torch.uint8).numpy().data)


class _Export:
    """Writes planned files under temporary names, then publishes them."""

    def __init__(self, out_dir: str, files: list[OutFile], metadata: dict[str, str]) -> None:
        self.out_dir = out_dir
        self.files = files
        self.metadata = {"format": "pt", **metadata}
        self.tag = uuid.uuid4().hex[:8]

    def tmp(self, name: str) -> str:
        return os.path.join(self.out_dir, f".{name}.{self.tag}.tmp")

    def write_file(
        self, file: OutFile, produce: Callable[[OutTensor], torch.Tensor | None]
    ) -> None:
        with open(self.tmp(file.name), "wb") as f:
            f.write(file.header(self.metadata))
            for t in file.tensors:
                tensor = produce(t)
                if tensor is not None:
                    _write_bytes(f, tensor.to(t.dtype))
                del tensor  # before the next gather: one full tensor at a time
            f.flush()
            os.fsync(f.fileno())

    def publish(self) -> list[str]:
        """Renames the temporary files into place, the completeness marker (index
        or single file) last, and removes files of an older export."""
        names = [f.name for f in self.files]
        final = [os.path.join(self.out_dir, n) for n in names]
        marker_old = [os.path.join(self.out_dir, n) for n in (INDEX_FILE, SINGLE_FILE)]
        for old in marker_old:  # an older export stops looking complete first
            if os.path.exists(old):
                os.remove(old)
        if len(self.files) == 1:
            os.replace(self.tmp(names[0]), final[0])
        else:
            for name, path in zip(names, final):
                os.replace(self.tmp(name), path)
            index = {
                "metadata": {"total_size": sum(t.nbytes for f in self.files for t in f.tensors)},
                "weight_map": {t.name: f.name for f in self.files for t in f.tensors},
            }
            tmp = self.tmp(INDEX_FILE)
            with open(tmp, "w") as fh:
                json.dump(index, fh, indent=2)
                fh.write("\n")
            os.replace(tmp, os.path.join(self.out_dir, INDEX_FILE))
        for stale in os.listdir(self.out_dir):  # shards of an older, differently split export
            if stale.startswith("model-") and stale.endswith(".safetensors") and stale not in names:
                os.remove(os.path.join(self.out_dir, stale))
        return final

    def cleanup(self) -> None:
        # Best effort, and never the error the caller sees: that is the failure
        # that led here (out_dir may not even be a directory).
        for name in [f.name for f in self.files] + [INDEX_FILE]:
            with contextlib.suppress(OSError):
                os.remove(self.tmp(name))


def _gather_to_rank0(tensor: DTensor, comms: ToolCollectives) -> torch.Tensor | None:
    """The full tensor on global rank 0, ``None`` on the other ranks.

    The first rank holding each distinct part of the tensor sends it to rank 0
    (HSDP replicas send once), which receives it straight into its place in one
    full-size buffer (through a part-sized buffer when the part is not contiguous,
    e.g. a column block). Rank 0 thus holds one full tensor plus at most one part;
    the others allocate nothing. Every rank of ``comms``' group (the world) takes
    part in the one exchange, with nothing to send or receive where it holds no
    part to send (see [Note: tools' collectives]).
    """
    # Every rank's part, from its mesh coordinate: DTensor's own (private) layout
    # function, the one DCP's planner uses through its public wrapper.
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    grid = tensor.device_mesh.mesh  # global rank at each mesh coordinate
    me = dist.get_rank()
    numel, dtype = tensor.numel(), tensor.dtype
    if 0 not in grid.flatten().tolist():
        # A mesh without rank 0, e.g. the dp mesh of another TP rank: its tensor is
        # a replica of the one on rank 0's mesh, which rank 0 gathers from there.
        comms.send_recv([], [], total_numel=numel, dtype=dtype)
        return None
    local = tensor.to_local()
    senders: dict[tuple[tuple[int, int], ...], int] = {}  # [start, stop) per dim -> rank
    for coord in itertools.product(*(range(n) for n in grid.shape)):
        shape, offset = _compute_local_shape_and_global_offset(
            tensor.shape, grid.shape, list(coord), tensor.placements
        )
        if 0 not in shape:
            part = tuple((o, o + n) for o, n in zip(offset, shape))
            senders.setdefault(part, int(grid[coord]))
    if list(senders.values()) == [0]:  # rank 0 holds the whole tensor (W=1, replicated)
        comms.send_recv([], [], total_numel=numel, dtype=dtype)
        return local if me == 0 else None
    if me != 0:
        sends = [(local.contiguous(), 0) for src in senders.values() if src == me]
        comms.send_recv(sends, [], total_numel=numel, dtype=dtype)
        return None
    full = torch.empty(tensor.shape, dtype=tensor.dtype, device=local.device)
    recvs = []
    for part, src in senders.items():
        region = full[tuple(slice(a, b) for a, b in part)]
        if src == 0:
            region.copy_(local)
        else:
            recvs.append((region, src))
    comms.send_recv([], recvs, total_numel=numel, dtype=dtype)
    return full


def _prepare_out_dir(out_dir: str, what: str) -> None:
    """Creates ``out_dir``, or raises a clear error for a path that cannot be one."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(
            f"{what}: out_dir {out_dir!r} is an existing file, not a directory; pass the path "
            "of a directory (it is created if missing, and the model files are written in it)."
        )
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{what}: cannot create the output directory {out_dir!r}: {exc}") from exc
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ValueError(f"{what}: the output directory {out_dir!r} is not writable.")


@torch.no_grad()
def save_safetensors(
    module: nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    key_map: KeyMap | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
    metadata: dict[str, str] | None = None,
) -> list[str]:
    """Writes a (sharded) module's state dict as safetensors in Hugging Face's
    layout: ``model.safetensors``, or ``model-0000x-of-0000y.safetensors`` files
    of at most ``max_shard_size`` bytes each plus ``model.safetensors.index.json``.

    Collective: every rank calls it with the same module structure (the whole
    model, not a pipeline stage). Tensors are gathered one at a time in
    state-dict order, i.e. unit by unit, point to point into one full-size buffer
    on rank 0 (:func:`_gather_to_rank0`), which appends each to its file at once,
    so no rank holds more than one full tensor (see [Note: streaming export]). Tied parameters are written once, under their first state-dict name (as ``save_pretrained`` does;
    ``from_pretrained`` re-ties them).

    Args:
        module: the model.
        out_dir: output directory (created; other files in it, e.g. a
            ``config.json``, are kept; model files of an older export are replaced).
        key_map: maps a model state-dict key to the exported name, or to ``None``
            to leave the tensor out. Default: identity.
        max_shard_size: bytes per file (int) or a string such as ``"5GB"`` or ``"500MiB"``.
        dtype: cast floating-point tensors to this dtype (e.g. ``torch.bfloat16``).
            Default: keep each tensor's dtype.
        metadata: extra string metadata for the file headers (``format: pt`` is always set).

    Returns:
        The paths of the written files on rank 0 (the index last if any), ``[]``
        on the other ranks.
    """
    key_map = key_map or (lambda k: k)
    max_bytes = parse_size(max_shard_size)
    out: list[OutTensor] = []
    for t in targets_of(module):
        name = key_map(t.keys[0])
        if name is None:
            continue
        out_dtype = dtype if dtype is not None and t.tensor.is_floating_point() else t.tensor.dtype
        out.append(OutTensor(name, out_dtype, tuple(t.tensor.shape), t.tensor))
    check_names(out)
    files = split_files(out, max_bytes)
    rank = dist.get_rank() if dist_on() else 0
    out_dir = os.fspath(out_dir)
    export = _Export(out_dir, files, metadata or {})
    comms = ToolCollectives("safetensors.export", owner=module)
    # Rank 0 writes: it checks the path before any tensor moves, and every rank
    # learns the outcome (one all-reduce), so a bad path fails everywhere at once.
    error: BaseException | None = None
    if rank == 0:
        try:
            _prepare_out_dir(out_dir, "save_safetensors")
        except ValueError as exc:
            error = exc
    raise_if_any_failed(error, "save_safetensors", comms)

    gathered = [0]  # tensors gathered so far, in plan order

    def gather(t: OutTensor) -> torch.Tensor | None:
        gathered[0] += 1
        if isinstance(t.source, DTensor):
            return _gather_to_rank0(t.source, comms)
        return t.source if rank == 0 else None

    if rank == 0:
        try:
            for file in files:
                export.write_file(file, gather)
        except Exception as exc:
            error = exc
    # The other ranks (and rank 0 after a failure) only take part in the gathers,
    # so that every rank issues the same collectives.
    for rest in out[gathered[0] :]:
        gather(rest)
    paths: list[str] = []
    if rank == 0 and error is None:
        try:
            paths = export.publish()
            paths += [os.path.join(out_dir, INDEX_FILE)] if len(files) > 1 else []
        except Exception as exc:
            error = exc
    if rank == 0 and error is not None:
        export.cleanup()
    raise_if_any_failed(error, "save_safetensors", comms)
    logger.info("save_safetensors: wrote %d file(s) to %s", len(files), out_dir)
    return paths


def export_dcp_to_safetensors(
    checkpoint_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    prefix: str = "model.",
    key_map: KeyMap | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
    metadata: dict[str, str] | None = None,
) -> list[str]:
    """Converts a ``torch.distributed.checkpoint`` directory to safetensors in
    Hugging Face's layout, offline (no model needed), one tensor at a time.

    Runs on one process, or on every rank of a process group: then each rank
    writes every W-th output file (reading only the tensors of its files) and
    rank 0 publishes them. The checkpoint may have been saved at any world size.

    Args:
        checkpoint_dir: the DCP directory (with its ``.metadata`` file).
        out_dir: output directory (see :func:`save_safetensors`).
        prefix: only tensors whose key starts with it are exported, without it
            (``"model."`` for ``dcp.save({"model": model_state, "optim": ...})``;
            ``""`` for a bare model state dict).
        key_map: maps a key (after removing ``prefix``) to the exported name, or to
            ``None`` to leave it out. Default: identity.
        max_shard_size, dtype, metadata: as in :func:`save_safetensors`.

    Returns:
        The paths of the written files on rank 0, ``[]`` on the other ranks.
    """
    import torch.distributed.checkpoint as dcp

    checkpoint_dir = os.fspath(checkpoint_dir)
    out_dir = os.fspath(out_dir)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist_on() else (0, 1)
    # Every rank plans from the checkpoint's metadata; all learn whether any failed
    # (one all-reduce) before the first collective that needs the same plan.
    error: BaseException | None = None
    files: list[OutFile] = []
    comms = ToolCollectives("safetensors.export_dcp")
    try:
        files = _plan_dcp_export(checkpoint_dir, prefix, key_map, dtype, max_shard_size)
        _prepare_out_dir(out_dir, "export_dcp_to_safetensors")
    except Exception as exc:
        error = exc
    raise_if_any_failed(error, "export_dcp_to_safetensors", comms)
    export = _Export(out_dir, files, metadata or {})
    if dist_on():  # every rank must use the same temporary names
        export.tag = comms.broadcast_object(export.tag, src=0)

    def read(t: OutTensor) -> torch.Tensor:
        key, src_dtype = t.source
        buf = {key: torch.empty(t.shape, dtype=src_dtype)}
        with warnings.catch_warnings():  # no_dist is the intent, even without a process group
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to load in a single process"
            )
            dcp.load(buf, storage_reader=dcp.FileSystemReader(checkpoint_dir), no_dist=True)
        return buf[key]

    try:
        for i, file in enumerate(files):
            if i % world == rank:
                export.write_file(file, read)
    except Exception as exc:
        error = exc
    ok = agree_ok(error, comms)
    paths: list[str] = []
    if ok and rank == 0:
        try:
            paths = export.publish()
            paths += [os.path.join(out_dir, INDEX_FILE)] if len(files) > 1 else []
        except Exception as exc:
            error = exc
    if not ok or error is not None:
        export.cleanup()
    # A failed write keeps its rank's error set, so this raises wherever ok is False.
    raise_if_any_failed(error, "export_dcp_to_safetensors", comms)
    return paths


def _plan_dcp_export(
    checkpoint_dir: str,
    prefix: str,
    key_map: KeyMap | None,
    dtype: torch.dtype | None,
    max_shard_size: int | str,
) -> list[OutFile]:
    """The output files of :func:`export_dcp_to_safetensors`, from the checkpoint's
    metadata alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    key_map = key_map or (lambda k: k)
    reader = dcp.FileSystemReader(checkpoint_dir)
    try:
        saved = reader.read_metadata().state_dict_metadata
    except Exception as exc:  # DCP raises several types; name the directory
        raise ValueError(
            f"{checkpoint_dir} is not a readable torch.distributed.checkpoint directory: {exc}"
        ) from exc
    out: list[OutTensor] = []
    for key, md in saved.items():
        if not isinstance(md, TensorStorageMetadata) or not key.startswith(prefix):
            continue
        name = key_map(key[len(prefix) :])
        if name is None:
            continue
        src_dtype = md.properties.dtype
        out_dtype = dtype if dtype is not None and src_dtype.is_floating_point else src_dtype
        out.append(OutTensor(name, out_dtype, tuple(md.size), (key, src_dtype)))
    if not out:
        raise ValueError(
            f"no tensors with keys starting with {prefix!r} in the checkpoint {checkpoint_dir}"
        )
    check_names(out)
    return split_files(out, parse_size(max_shard_size))
