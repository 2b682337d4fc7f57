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

Modules: ``_format`` (the file format, headers, output layout), ``_load`` and
``_export``.
"""

from __future__ import annotations

from ._export import export_dcp_to_safetensors, save_safetensors
from ._format import read_headers
from ._load import LoadResult, load_safetensors

__all__ = [
    "LoadResult",
    "export_dcp_to_safetensors",
    "load_safetensors",
    "read_headers",
    "save_safetensors",
]
