"""Pretrained weights in and out of sharded models, in Hugging Face's safetensors layout.

* :func:`load_safetensors` reads a ``model.safetensors`` file, or Hugging Face's
  sharded ``model-0000x-of-0000y.safetensors`` files with their
  ``model.safetensors.index.json``, straight into a sharded model's local shards:
  each rank reads only the rows (and columns) it owns, from memory-mapped slices.
* :func:`save_safetensors` writes a sharded model in the same layout, gathering
  one tensor at a time, so no rank ever holds more than one full tensor.
* :func:`export_dcp_to_safetensors` converts a ``torch.distributed.checkpoint``
  directory offline, on one process or on any number of ranks.

This module is an extension: the core never imports it, and it imports the
``safetensors`` package only when a function needs it
(``pip install fsdp_compose[safetensors]``).

[Note: which part of a tensor a rank reads]
A ``DTensor``'s local tensor on this rank is a box of the global tensor: one range
of indices per dim. The box is found by applying the placements to the global
shape: ``Shard(d)`` on a mesh dim of size ``m`` at coordinate ``k`` keeps chunk
``k`` of ``ceil(n / m)`` indices of the current range on ``d`` (``torch.chunk``
semantics: trailing chunks may be short or empty); ``Replicate()`` keeps the
range. ``_StridedShard(d, split_factor=s)``, which fsdp_compose puts on the
data-parallel mesh dim when tensor parallel already shards the same dim, is a
chunk *inside* the chunk that the later ``Shard(d)`` placements select, so it is
applied after them. The computed box is checked against the local tensor's shape
before anything is read. HSDP replicas compute the same box and read the same rows.

[Note: memory while loading]
``safe_open`` memory-maps the file and a slice is a view of the mapping; the
pages it touches stay resident (and count in the process's RSS) as long as the
file is open. Each tensor is therefore read with its own short-lived
``safe_open``: the view is copied (and cast) into the local shard, then the file
is closed. The peak is the local shards plus one tensor's slice in the file's
dtype. Opening a file again costs one header parse (tens of microseconds).

[Note: streaming export]
``safetensors.torch.save_file`` needs every tensor of a file in memory at once.
The export instead lays out every file first (the header only needs names,
dtypes and shapes, which every rank knows without communication), writes the
headers, then appends each tensor's bytes as soon as it is gathered. Files are
written under temporary names and renamed at the end, the index (or the single
``model.safetensors``) last, so an interrupted export never looks complete.
"""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = [
    "LoadResult",
    "export_dcp_to_safetensors",
    "load_safetensors",
    "save_safetensors",
]

logger = logging.getLogger("fsdp_compose")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # transformers' default ("5GB")

KeyMap = Callable[[str], "str | None"]

# safetensors' dtype names (the format's spec) <-> torch dtypes.
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def _safe_open() -> Any:
    try:
        from safetensors import safe_open
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "fsdp_compose.safetensors_io needs the 'safetensors' package: "
            "pip install fsdp_compose[safetensors]  (or: pip install safetensors)"
        ) from exc
    return safe_open


# ---------------------------------------------------------------------------
# Which part of a tensor this rank holds
# ---------------------------------------------------------------------------


def local_box(shape: Iterable[int], mesh: Any, placements: Iterable[Any]) -> list[tuple[int, int]]:
    """The ``[start, stop)`` range per tensor dim of this rank's local tensor of a
    DTensor with global ``shape`` (see [Note: which part of a tensor a rank reads]).

    Raises:
        NotImplementedError: for placements other than ``Shard``, ``Replicate`` and
            a ``_StridedShard`` whose split factor is the product of the later
            ``Shard`` placements' mesh sizes on the same dim.
    """
    box = [(0, int(n)) for n in shape]
    placements = list(placements)
    coord = mesh.get_coordinate()
    if coord is None:  # not part of the mesh: holds nothing
        return [(0, 0) for _ in box]
    strided: list[int] = []
    for i, placement in enumerate(placements):
        if _is_strided(placement):
            strided.append(i)
        elif type(placement) is Shard:
            box = _take_chunk(box, placement.dim % len(box), mesh.size(i), coord[i])
        elif not isinstance(placement, Replicate):
            raise NotImplementedError(f"placement {placement} (only Shard and Replicate are supported)")
    for i in strided:
        placement = placements[i]
        dim = placement.dim % len(box)
        # _StridedShard is a shard inside the chunks selected by the later Shard(dim)s.
        later = math.prod(
            mesh.size(j) for j in range(i + 1, len(placements))
            if type(placements[j]) is Shard and placements[j].dim % len(box) == dim
        )
        if later != placement.split_factor:
            raise NotImplementedError(
                f"placement {placement} on mesh dim {i}: split factor {placement.split_factor} is not the "
                f"size {later} of the later Shard({dim}) mesh dims"
            )
        box = _take_chunk(box, dim, mesh.size(i), coord[i])
    return box


def _is_strided(placement: Any) -> bool:
    # torch's _StridedShard is private; matched by name so that no private import is needed.
    return type(placement).__name__ == "_StridedShard"


def _take_chunk(box: list[tuple[int, int]], dim: int, parts: int, index: int) -> list[tuple[int, int]]:
    start, stop = box[dim]
    n = stop - start
    chunk = math.ceil(n / parts) if n else 0
    a = start + min(index * chunk, n)
    b = start + min(index * chunk + chunk, n)
    out = list(box)
    out[dim] = (a, b)
    return out


def _box_of(tensor: torch.Tensor) -> list[tuple[int, int]]:
    if isinstance(tensor, DTensor):
        return local_box(tensor.shape, tensor.device_mesh, tensor.placements)
    return [(0, int(n)) for n in tensor.shape]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


# ---------------------------------------------------------------------------
# Reading checkpoints
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    """One tensor of a safetensors checkpoint (from its header)."""

    file: str
    dtype: str
    shape: tuple[int, ...]


def _resolve(path: str | os.PathLike[str]) -> tuple[list[str], dict[str, str]]:
    """The checkpoint's files and, for an index, its ``weight_map`` (tensor -> file)."""
    path = os.fspath(path)
    index = None
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, INDEX_FILE)):
            index = os.path.join(path, INDEX_FILE)
        elif os.path.exists(os.path.join(path, SINGLE_FILE)):
            return [os.path.join(path, SINGLE_FILE)], {}
        else:
            raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
    elif path.endswith(".json"):
        index = path
    elif os.path.exists(path):
        return [path], {}
    else:
        raise FileNotFoundError(f"safetensors checkpoint {path} does not exist")
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read the safetensors index {index}: {exc}") from exc
    base = os.path.dirname(index)
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    missing = [f for f in by_file if not os.path.isfile(os.path.join(base, f))]
    if missing:
        f = missing[0]
        raise FileNotFoundError(
            f"the index {index} names the file {f!r} (tensors {_names(by_file[f])}), which does not "
            f"exist in {base}" + (f"; {len(missing) - 1} more files are missing" if len(missing) > 1 else "")
        )
    return [os.path.join(base, f) for f in by_file], {k: os.path.join(base, v) for k, v in weight_map.items()}


def _names(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def read_headers(path: str | os.PathLike[str]) -> dict[str, _Entry]:
    """Every tensor of a safetensors checkpoint (a file, a directory, or an index
    JSON): its file, dtype and shape, from the headers alone.

    Raises:
        ValueError: a file that is not a complete safetensors file (truncated), or
            an index that disagrees with the files.
        FileNotFoundError: a missing checkpoint or a file the index names.
    """
    safe_open = _safe_open()
    files, weight_map = _resolve(path)
    entries: dict[str, _Entry] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                    s = f.get_slice(name)
                    entries[name] = _Entry(file, s.get_dtype(), tuple(s.get_shape()))
        except Exception as exc:  # safetensors raises its own error type
            if isinstance(exc, (KeyboardInterrupt, MemoryError)):
                raise
            raise ValueError(
                f"cannot read the safetensors file {file}: {exc} (a truncated or corrupted file? "
                "re-download or re-export it)"
            ) from exc
    for name, file in weight_map.items():
        entry = entries.get(name)
        if entry is None or entry.file != file:
            raise ValueError(
                f"the index lists tensor {name!r} in {file}, but that file does not contain it "
                f"(index and files are from different exports?)"
            )
    return entries


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
class _Target:
    keys: list[str]  # tied keys share one tensor
    tensor: torch.Tensor
    is_param: bool
    file_key: str | None = None
    box: list[tuple[int, int]] = field(default_factory=list)


def _targets(module: nn.Module) -> list[_Target]:
    """The module's state-dict tensors, tied keys grouped (by tensor identity)."""
    # state_dict(keep_vars=True) also reshards fsdp_compose units, so the sharded
    # parameters are the registered ones.
    state = module.state_dict(keep_vars=True)
    params = {id(p) for p in module.parameters()}
    groups: dict[int, _Target] = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        target = groups.get(id(value))
        if target is None:
            groups[id(value)] = _Target([key], value, id(value) in params)
        else:
            target.keys.append(key)
    return list(groups.values())


def _plan_load(
    targets: list[_Target], entries: dict[str, _Entry], key_map: KeyMap, strict: bool, source: str
) -> tuple[list[str], list[str]]:
    """Matches model keys to checkpoint tensors and checks shapes, dtypes and the
    local layout of every tensor; raises one error listing every problem."""
    problems: list[str] = []
    missing: list[str] = []
    used: set[str] = set()
    for t in targets:
        mapped = [(k, key_map(k)) for k in t.keys]
        names = [name for _, name in mapped if name is not None]
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
        file_dtype = _DTYPES.get(entry.dtype)
        if file_dtype is None:
            problems.append(f"{where} has dtype {entry.dtype}, which this torch cannot represent")
            continue
        if file_dtype.is_floating_point != t.tensor.dtype.is_floating_point:
            problems.append(
                f"{where} has dtype {entry.dtype}, which cannot be converted to the model's "
                f"{t.keys[0]!r} of dtype {t.tensor.dtype}"
            )
            continue
        try:
            t.box = _box_of(t.tensor)
        except NotImplementedError as exc:
            problems.append(f"model tensor {t.keys[0]!r}: cannot load into its layout: {exc}")
            continue
        box_shape = tuple(b - a for a, b in t.box)
        if box_shape != tuple(_local(t.tensor).shape):
            problems.append(
                f"model tensor {t.keys[0]!r}: its local shard has shape {list(_local(t.tensor).shape)}, "
                f"but its placements {getattr(t.tensor, 'placements', None)} describe {list(box_shape)}"
            )
    unexpected = sorted(set(entries) - used)
    if strict and missing:
        problems.append(
            f"missing from the checkpoint {source}: {_names(missing, 10)} (pass key_map to rename keys, or "
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


def _owners(module: nn.Module, tensor: torch.Tensor, is_param: bool) -> list[tuple[nn.Module, str]]:
    owners = []
    for m in module.modules():
        slots = m._parameters if is_param else m._buffers
        owners.extend((m, name) for name, v in slots.items() if v is tensor)
    return owners


def _materialize(module: nn.Module, t: _Target, device: torch.device) -> None:
    """Replaces a meta tensor by an uninitialized one with the same layout (only
    the local shard is allocated), registered wherever the meta one was."""
    old = t.tensor
    local = torch.empty(_local(old).shape, dtype=old.dtype, device=device)
    new: torch.Tensor = local
    if isinstance(old, DTensor):
        new = DTensor.from_local(
            local, old.device_mesh, old.placements, run_check=False, shape=old.shape, stride=old.stride()
        )
    if t.is_param:
        new = nn.Parameter(new, requires_grad=old.requires_grad)
    for owner, name in _owners(module, old, t.is_param):
        if t.is_param:
            owner._parameters[name] = new  # type: ignore[assignment]
        else:
            owner._buffers[name] = new
    t.tensor = new


def _default_device(targets: list[_Target]) -> torch.device:
    for t in targets:
        if isinstance(t.tensor, DTensor):
            mesh = t.tensor.device_mesh
            if mesh.device_type == "cuda":
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device(mesh.device_type)
    return torch.device("cpu")


def _invalidate_units(module: nn.Module) -> None:
    # fsdp_compose units re-derive their buffers from the (new) sharded parameters.
    for m in module.modules():
        get_state = getattr(m, "_fsdp_state", None)
        unit = getattr(get_state(), "unit", None) if callable(get_state) else None
        if unit is not None:
            unit.invalidate()


@torch.no_grad()
def load_safetensors(
    module: nn.Module,
    path: str | os.PathLike[str],
    *,
    key_map: KeyMap | None = None,
    strict: bool = True,
    device: torch.device | str | None = None,
) -> LoadResult:
    """Loads a safetensors checkpoint into a (sharded) module, each rank reading
    only its own part of each tensor.

    ``module``'s parameters may be fsdp_compose's sharded ``DTensor``s (on a 1-D
    mesh, an HSDP mesh, or a ``dp x tp`` mesh with tensor parallel), other
    ``DTensor``s, or plain tensors; on the meta device (built under
    ``torch.device("meta")`` and annotated with ``fully_shard``) or materialized.
    Meta tensors are materialized on ``device``: only the local shard is allocated.
    Values are cast to each tensor's dtype (e.g. a bfloat16 file into float32
    parameters). Tied parameters (one tensor under several names) are loaded once,
    from whichever of their names the checkpoint has.

    No communication: every rank reads its own slices (see [Note: which part of a
    tensor a rank reads]). Non-persistent buffers are not part of a checkpoint:
    a module built on the meta device must initialize them itself (e.g. rotary
    embedding frequencies).

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

    Returns:
        A :class:`LoadResult`.

    Raises:
        ValueError, FileNotFoundError: a missing, truncated or mismatching
            checkpoint (key, shape, dtype kind), naming the tensor and the file.
            Every header is read and checked before any tensor is modified.
    """
    safe_open = _safe_open()
    key_map = key_map or (lambda k: k)
    entries = read_headers(path)
    targets = _targets(module)
    missing, unexpected = _plan_load(targets, entries, key_map, strict, os.fspath(path))

    dev = torch.device(device) if device is not None else _default_device(targets)
    result = LoadResult(missing=missing, unexpected=unexpected)
    materialized = False
    for t in targets:
        if t.file_key is None:
            continue
        if t.tensor.is_meta:
            _materialize(module, t, dev)
            materialized = True
        local = _local(t.tensor)
        if local.numel() > 0:
            entry = entries[t.file_key]
            # A short-lived handle per tensor: see [Note: memory while loading].
            with safe_open(entry.file, framework="pt") as f:
                piece = f.get_slice(t.file_key)[tuple(slice(a, b) for a, b in t.box)]
                local.copy_(piece)
                result.bytes_read += piece.numel() * piece.element_size()
                del piece
        result.loaded.extend(t.keys)
    if materialized:
        _invalidate_units(module)
    still_meta = [n for n, b in module.named_buffers() if b.is_meta]
    if still_meta:
        logger.warning(
            "load_safetensors: buffers not in the checkpoint are still on the meta device: %s; "
            "initialize them before the first forward", _names(still_meta, 10)
        )
    return result


# ---------------------------------------------------------------------------
# Writing checkpoints
# ---------------------------------------------------------------------------


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    text = size.strip().upper()
    for unit, factor in units.items():
        if text.endswith(unit):
            try:
                return _parse_size(int(float(text[: -len(unit)]) * factor))
            except ValueError:
                break
    raise ValueError(f"max_shard_size {size!r}: expected bytes (int) or a string like '5GB' or '500MiB'")


@dataclass
class _OutTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    source: Any  # what the producer needs to get the tensor

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class _OutFile:
    name: str
    tensors: list[_OutTensor]

    def header(self, metadata: dict[str, str]) -> bytes:
        entries: dict[str, Any] = {"__metadata__": metadata}
        offset = 0
        for t in self.tensors:
            entries[t.name] = {
                "dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                "data_offsets": [offset, offset + t.nbytes],
            }
            offset += t.nbytes
        raw = json.dumps(entries, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        return len(raw).to_bytes(8, "little") + raw


def _split(tensors: list[_OutTensor], max_bytes: int) -> list[_OutFile]:
    """Hugging Face's layout: tensors in order, a new file when the next tensor
    would exceed ``max_bytes`` (a tensor larger than that gets a file of its own)."""
    groups: list[list[_OutTensor]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    if len(groups) == 1:
        return [_OutFile(SINGLE_FILE, groups[0])]
    n = len(groups)
    return [_OutFile(f"model-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


def _check_names(tensors: list[_OutTensor]) -> None:
    seen: set[str] = set()
    for t in tensors:
        if t.name in seen:
            raise ValueError(f"two tensors are exported under the name {t.name!r} (check key_map)")
        if t.dtype not in _DTYPE_NAMES:
            raise ValueError(f"tensor {t.name!r} has dtype {t.dtype}, which safetensors cannot store")
        seen.add(t.name)


def _write_bytes(f: Any, tensor: torch.Tensor) -> None:
    data = tensor.detach().to("cpu").contiguous().reshape(-1)
    if data.numel():
        f.write(data.view(torch.uint8).numpy().data)


class _Export:
    """Writes planned files under temporary names, then publishes them."""

    def __init__(self, out_dir: str, files: list[_OutFile], metadata: dict[str, str]) -> None:
        self.out_dir = out_dir
        self.files = files
        self.metadata = {"format": "pt", **metadata}
        self.tag = uuid.uuid4().hex[:8]

    def tmp(self, name: str) -> str:
        return os.path.join(self.out_dir, f".{name}.{self.tag}.tmp")

    def write_file(self, file: _OutFile, produce: Callable[[_OutTensor], torch.Tensor | None]) -> None:
        with open(self.tmp(file.name), "wb") as f:
            f.write(file.header(self.metadata))
            for t in file.tensors:
                tensor = produce(t)
                if tensor is not None:
                    _write_bytes(f, tensor.to(t.dtype))
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
        for f in self.files:
            try:
                os.remove(self.tmp(f.name))
            except FileNotFoundError:
                pass


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _agree_ok(error: BaseException | None, group: Any = None) -> bool:
    """True when no rank failed (collective when a process group exists)."""
    if not _dist_on():
        return error is None
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, group=group)
    return int(flag.item()) == 0


@torch.no_grad()
def save_safetensors(
    module: nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    key_map: KeyMap | None = None,
    max_shard_size: int | str = _DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
    metadata: dict[str, str] | None = None,
) -> list[str]:
    """Writes a (sharded) module's state dict as safetensors in Hugging Face's
    layout: ``model.safetensors``, or ``model-0000x-of-0000y.safetensors`` files
    of at most ``max_shard_size`` bytes each plus ``model.safetensors.index.json``.

    Collective: every rank of the module's meshes must call it. Tensors are
    gathered one at a time (``DTensor.full_tensor()``) in state-dict order, i.e.
    unit by unit, and rank 0 appends each to its file at once, so no rank holds
    more than one full tensor (see [Note: streaming export]). Tied parameters are
    written once, under their first state-dict name (as ``save_pretrained`` does;
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
    max_bytes = _parse_size(max_shard_size)
    out: list[_OutTensor] = []
    for t in _targets(module):
        name = key_map(t.keys[0])
        if name is None:
            continue
        out_dtype = dtype if dtype is not None and t.tensor.is_floating_point() else t.tensor.dtype
        out.append(_OutTensor(name, out_dtype, tuple(t.tensor.shape), t.tensor))
    _check_names(out)
    files = _split(out, max_bytes)
    rank = dist.get_rank() if _dist_on() else 0
    out_dir = os.fspath(out_dir)
    export = _Export(out_dir, files, metadata or {})

    gathered = [0]  # tensors gathered so far, in plan order

    def gather(t: _OutTensor) -> torch.Tensor | None:
        gathered[0] += 1
        full = t.source.full_tensor() if isinstance(t.source, DTensor) else t.source
        return full if rank == 0 else None

    error: BaseException | None = None
    if rank == 0:
        try:
            os.makedirs(out_dir, exist_ok=True)
            for file in files:
                export.write_file(file, gather)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = exc
    # The other ranks (and rank 0 after a failure) only take part in the gathers,
    # so that every rank issues the same collectives.
    for t in out[gathered[0]:]:
        gather(t)
    paths: list[str] = []
    if rank == 0 and error is None:
        try:
            paths = export.publish()
            paths += [os.path.join(out_dir, INDEX_FILE)] if len(files) > 1 else []
        except Exception as exc:  # noqa: BLE001
            error = exc
    if rank == 0 and error is not None:
        export.cleanup()
    if not _agree_ok(error):
        if error is not None:
            raise error
        raise RuntimeError("save_safetensors failed on rank 0 (see its error); nothing was published")
    logger.info("save_safetensors: wrote %d file(s) to %s", len(files), out_dir)
    return paths


def export_dcp_to_safetensors(
    checkpoint_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    prefix: str = "model.",
    key_map: KeyMap | None = None,
    max_shard_size: int | str = _DEFAULT_MAX_SHARD_SIZE,
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
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    key_map = key_map or (lambda k: k)
    checkpoint_dir = os.fspath(checkpoint_dir)
    reader = dcp.FileSystemReader(checkpoint_dir)
    try:
        saved = reader.read_metadata().state_dict_metadata
    except Exception as exc:  # DCP raises several types; name the directory
        raise ValueError(f"{checkpoint_dir} is not a readable torch.distributed.checkpoint directory: {exc}") from exc
    out: list[_OutTensor] = []
    for key, md in saved.items():
        if not isinstance(md, TensorStorageMetadata) or not key.startswith(prefix):
            continue
        name = key_map(key[len(prefix):])
        if name is None:
            continue
        src_dtype = md.properties.dtype
        out_dtype = dtype if dtype is not None and src_dtype.is_floating_point else src_dtype
        out.append(_OutTensor(name, out_dtype, tuple(md.size), (key, src_dtype)))
    if not out:
        raise ValueError(f"no tensors with keys starting with {prefix!r} in the checkpoint {checkpoint_dir}")
    _check_names(out)
    files = _split(out, _parse_size(max_shard_size))
    rank, world = (dist.get_rank(), dist.get_world_size()) if _dist_on() else (0, 1)
    out_dir = os.fspath(out_dir)
    export = _Export(out_dir, files, metadata or {})
    if _dist_on():  # every rank must use the same temporary names
        tag = [export.tag]
        dist.broadcast_object_list(tag, src=0)
        export.tag = tag[0]

    def read(t: _OutTensor) -> torch.Tensor:
        key, src_dtype = t.source
        buf = {key: torch.empty(t.shape, dtype=src_dtype)}
        with warnings.catch_warnings():  # no_dist is the intent, even without a process group
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(buf, storage_reader=dcp.FileSystemReader(checkpoint_dir), no_dist=True)
        return buf[key]

    error: BaseException | None = None
    try:
        os.makedirs(out_dir, exist_ok=True)
        for i, file in enumerate(files):
            if i % world == rank:
                export.write_file(file, read)
    except Exception as exc:  # noqa: BLE001 - the other ranks must hear of it
        error = exc
    ok = _agree_ok(error)
    paths: list[str] = []
    if ok and rank == 0:
        try:
            paths = export.publish()
            paths += [os.path.join(out_dir, INDEX_FILE)] if len(files) > 1 else []
        except Exception as exc:  # noqa: BLE001
            error = exc
    if not ok or error is not None:
        export.cleanup()
    if _dist_on():
        ok = _agree_ok(error) and ok
    if error is not None:
        raise error
    if not ok:
        raise RuntimeError("export_dcp_to_safetensors failed on another rank; nothing was published")
    return paths
