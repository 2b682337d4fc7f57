"""fsdp_compose: fully sharded data parallel training with FSDP2's API.

Annotate modules bottom-up with :func:`fully_shard`; parameters become sharded
``DTensor``s in place and a per-root scheduler gathers them just in time (with
prefetch) and reduce-scatters gradients per unit. See the README for usage.

The tools (``plan``, ``safetensors_io``, ``subclass_checkpoint``, ``whole_matrix``,
``trace``, ``debug``, ``ft``) use the public API and are imported on first access:
importing fsdp_compose changes nothing in torch or in the process.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._fully_shard import fully_shard
from ._grad_scaler import ShardedGradScaler
from ._offload_budget import cpu_offload_by_budget
from ._optim import enable_sharded_step
from ._runtime import (
    AllGather,
    Annotation,
    CollectiveInfo,
    CPUOffloadPolicy,
    DataParallelMeshDims,
    DefaultAllGather,
    DefaultReduceScatter,
    FSDPModule,
    GatherInput,
    GradientReductionHandle,
    MixedPrecisionPolicy,
    Observer,
    OffloadPolicy,
    ParamInfo,
    ReduceScatter,
    UnitInfo,
    UnitOptionsInfo,
    UnshardHandle,
    register_fsdp_forward_method,
    share_comm_ctx,
)

if TYPE_CHECKING:
    from . import debug, ft, plan, safetensors_io, subclass_checkpoint, trace, whole_matrix
    from ._pipelining import PipelineStage
    from .plan import auto_wrap

__version__ = "0.1.0"

_TOOLS = ("debug", "ft", "plan", "safetensors_io", "subclass_checkpoint", "trace", "whole_matrix")


def __getattr__(name: str) -> Any:
    # Tools load on first use (PEP 562), so that importing the library stays cheap.
    if name in _TOOLS:
        return importlib.import_module(f"{__name__}.{name}")
    if name == "auto_wrap":
        return importlib.import_module(f"{__name__}.plan").auto_wrap
    if name == "PipelineStage":  # torch.distributed.pipelining imports torch._dynamo
        return importlib.import_module(f"{__name__}._pipelining").PipelineStage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AllGather",
    "Annotation",
    "CPUOffloadPolicy",
    "CollectiveInfo",
    "DataParallelMeshDims",
    "DefaultAllGather",
    "DefaultReduceScatter",
    "FSDPModule",
    "GatherInput",
    "GradientReductionHandle",
    "MixedPrecisionPolicy",
    "Observer",
    "OffloadPolicy",
    "ParamInfo",
    "PipelineStage",
    "ReduceScatter",
    "ShardedGradScaler",
    "UnitInfo",
    "UnitOptionsInfo",
    "UnshardHandle",
    "auto_wrap",
    "cpu_offload_by_budget",
    "debug",
    "enable_sharded_step",
    "ft",
    "fully_shard",
    "plan",
    "register_fsdp_forward_method",
    "safetensors_io",
    "share_comm_ctx",
    "subclass_checkpoint",
    "trace",
    "whole_matrix",
]
