"""The FSDP2-equivalent runtime: what torch's ``_fully_shard/`` does, in its shape.

``fully_shard`` (``_fully_shard``) builds units (``_unit``, ``_flat_buffer``,
``_reduce``, ``_sharded_param``) and hooks (``_hooks``); the hooks drive the root's
scheduler (``_scheduler``), the scheduler the units, the units the collectives
(``_collectives``), which report to the root's observers (``_events``).

[Note: the runtime's front door]
This file is the only way into the runtime for the rest of fsdp_compose (the public
API in ``fsdp_compose/__init__.py``, the checks, the tools, the optimizers): they
import the names below and nothing from a ``_runtime._*`` submodule
(``tests/test_code_layout.py`` enforces it). What they may ask is here too: which
call owns a parameter (``owner_of``, ``fqn_of``, ``is_ignored``; see
[Note: parameter records]), never an attribute read from or written on a tensor;
observers get values (``UnitInfo``, see [Note: observer values]), never a unit;
which collectives the tools may issue and how (``ToolCollectives``, found for a
parameter's or module's root; see [Note: tools' collectives]). How the tools' ranks
agree or all raise (``fsdp_compose/_agree.py``) is built on ``ToolCollectives`` outside
the runtime, which never calls it. The runtime, in turn, imports nothing outside itself.
"""

from ._collectives import (
    AllGather,
    DefaultAllGather,
    DefaultReduceScatter,
    PendingCollective,
    ReduceScatter,
)
from ._compat import dtensor_from_local, dtensor_spec_with_dtype, local_tensor
from ._events import (
    Annotation,
    CollectiveEvent,
    CollectiveInfo,
    GatherInput,
    Observer,
    ParamInfo,
    UnitEvent,
    UnitInfo,
    UnitOptionsInfo,
)
from ._fsdp_module import (
    FSDPModule,
    GradientReductionHandle,
    UnshardHandle,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from ._fully_shard import describe_modules, fully_shard
from ._hooks import invalidate_unsharded, unit_infos
from ._mesh import DataParallelMeshDims, MeshInfo, validate_reshard_after_forward
from ._ownership import fqn_of, ignored_by, is_ignored, owner_of, replaced_by
from ._policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._shared import is_borrowed
from ._tool_collectives import ToolCollectives

__all__ = [
    "AllGather",
    "Annotation",
    "CPUOffloadPolicy",
    "CollectiveEvent",
    "CollectiveInfo",
    "DataParallelMeshDims",
    "DefaultAllGather",
    "DefaultReduceScatter",
    "FSDPModule",
    "GatherInput",
    "GradientReductionHandle",
    "MeshInfo",
    "MixedPrecisionPolicy",
    "Observer",
    "OffloadPolicy",
    "ParamInfo",
    "PendingCollective",
    "ReduceScatter",
    "ToolCollectives",
    "UnitEvent",
    "UnitInfo",
    "UnitOptionsInfo",
    "UnshardHandle",
    "describe_modules",
    "dtensor_from_local",
    "dtensor_spec_with_dtype",
    "fqn_of",
    "fully_shard",
    "ignored_by",
    "invalidate_unsharded",
    "is_borrowed",
    "is_ignored",
    "local_tensor",
    "owner_of",
    "register_fsdp_forward_method",
    "replaced_by",
    "share_comm_ctx",
    "unit_infos",
    "validate_reshard_after_forward",
]
