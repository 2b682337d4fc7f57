"""torch internals that the checks, the debug tools and the optimizers use (the
runtime's own are in ``_runtime/_compat.py``): a DTensor's spec, and what a process
group does not say publicly (its backend's name, its timeout, the job's store)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def dtensor_spec(dtensor: DTensor) -> Any:
    """The (private) spec of ``dtensor``: mesh, placements and tensor metadata."""
    return dtensor._spec


def backend_name(group: dist.ProcessGroup) -> str:
    """Lower-case backend name of ``group`` (``"gloo"``, ``"nccl"``, ...)."""
    try:
        return str(dist.get_backend(group)).lower()
    except (RuntimeError, ValueError, KeyError):  # a group torch does not know
        return "unknown"


def default_store() -> dist.Store:
    """The default process group's key-value store (e.g. torchrun's): rank checks
    exchange through it instead of issuing collectives."""
    return dist.distributed_c10d._get_default_store()


def process_group_timeout(group: dist.ProcessGroup) -> float | None:
    """The timeout (seconds) ``group`` was created with (private options), or None."""
    try:
        device = torch.device("cpu") if backend_name(group) == "gloo" else torch.device("cuda")
        return float(group._get_backend(device).options._timeout.total_seconds())
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None
