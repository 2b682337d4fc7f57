"""The safetensors format: reading headers, laying out and naming output files."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # transformers' default ("5GB")

KeyMap = Callable[[str], "str | None"]

# safetensors' dtype names (the format's spec) <-> torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def safe_open_fn() -> Any:
    try:
        from safetensors import safe_open
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "fsdp_compose.safetensors_io needs the 'safetensors' package: "
            "pip install fsdp_compose[safetensors]  (or: pip install safetensors)"
        ) from exc
    return safe_open


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors checkpoint (from its header)."""

    file: str
    dtype: str
    shape: tuple[int, ...]


def resolve(path: str | os.PathLike[str]) -> tuple[list[str], dict[str, str]]:
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
        with open(index) as fh:
            weight_map = json.load(fh)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read the safetensors index {index}: {exc}") from exc
    base = os.path.dirname(index)
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    missing = [f for f in by_file if not os.path.isfile(os.path.join(base, f))]
    if missing:
        first = missing[0]
        raise FileNotFoundError(
            f"the index {index} names the file {first!r} (tensors {names_of(by_file[first])}), which does not "
            f"exist in {base}"
            + (f"; {len(missing) - 1} more files are missing" if len(missing) > 1 else "")
        )
    return [os.path.join(base, f) for f in by_file], {
        k: os.path.join(base, v) for k, v in weight_map.items()
    }


def names_of(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def read_headers(path: str | os.PathLike[str]) -> dict[str, Entry]:
    """Every tensor of a safetensors checkpoint (a file, a directory, or an index
    JSON): its file, dtype and shape, from the headers alone.

    Raises:
        ValueError: a file that is not a complete safetensors file (truncated), or
            an index that disagrees with the files.
        FileNotFoundError: a missing checkpoint or a file the index names.
    """
    safe_open = safe_open_fn()
    files, weight_map = resolve(path)
    entries: dict[str, Entry] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                    s = f.get_slice(name)
                    entries[name] = Entry(file, s.get_dtype(), tuple(s.get_shape()))
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


def parse_size(size: int | str) -> int:
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    units = {
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "B": 1,
    }
    text = size.strip().upper()
    for unit, factor in units.items():
        if text.endswith(unit):
            try:
                return parse_size(int(float(text[: -len(unit)]) * factor))
            except ValueError:
                break
    raise ValueError(
        f"max_shard_size {size!r}: expected bytes (int) or a string like '5GB' or '500MiB'"
    )


@dataclass
class OutTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    source: Any  # what the producer needs to get the tensor

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class OutFile:
    name: str
    tensors: list[OutTensor]

    def header(self, metadata: dict[str, str]) -> bytes:
        entries: dict[str, Any] = {"__metadata__": metadata}
        offset = 0
        for t in self.tensors:
            entries[t.name] = {
                "dtype": DTYPE_NAMES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + t.nbytes],
            }
            offset += t.nbytes
        raw = json.dumps(entries, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        return len(raw).to_bytes(8, "little") + raw


def split_files(tensors: list[OutTensor], max_bytes: int) -> list[OutFile]:
    """Hugging Face's layout: tensors in order, a new file when the next tensor
    would exceed ``max_bytes`` (a tensor larger than that gets a file of its own)."""
    groups: list[list[OutTensor]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    if len(groups) == 1:
        return [OutFile(SINGLE_FILE, groups[0])]
    n = len(groups)
    return [OutFile(f"model-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


def check_names(tensors: list[OutTensor]) -> None:
    seen: set[str] = set()
    for t in tensors:
        if t.name in seen:
            raise ValueError(f"two tensors are exported under the name {t.name!r} (check key_map)")
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(
                f"tensor {t.name!r} has dtype {t.dtype}, which safetensors cannot store"
            )
        seen.add(t.name)
