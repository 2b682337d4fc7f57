"""fsdp_compose: fully sharded data parallel training with FSDP2's API.

Annotate modules bottom-up with :func:`fully_shard`; parameters become sharded
``DTensor``s in place and a per-root scheduler gathers them just in time (with
prefetch) and reduce-scatters gradients per unit. See the README for usage.
"""

# Extensions that attach to the core's registration points when imported.
from . import (  # noqa: F401
    _failures,  # errors of failed collectives that say why
    _full_state_dict,  # load_state_dict of full (unsharded) tensors
    _gloo,  # gloo's collectives as exchanges matched by what they are
    _guard,  # the collective guard, if FSDP_COMPOSE_COLLECTIVE_GUARD=1
    _misuse,  # misuse checks at the root's lazy init and at optimizer steps
    _recovery,  # reset_iter_state after an exception inside forward or backward
    _shared,  # parameters shared across units (tied weights)
    _validation,  # checks of fully_shard's arguments beyond FSDP2's
    debug,
    safetensors_io,
    trace,
    whole_matrix,
)
from ._fsdp_module import (
    FSDPModule,
    UnshardHandle,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from ._fully_shard import fully_shard
from ._grad_scaler import ShardedGradScaler
from ._mesh import DataParallelMeshDims
from ._pipelining import PipelineStage
from ._policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .plan import auto_wrap

__version__ = "0.1.0"

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "PipelineStage",
    "ShardedGradScaler",
    "UnshardHandle",
    "auto_wrap",
    "debug",
    "fully_shard",
    "register_fsdp_forward_method",
    "safetensors_io",
    "share_comm_ctx",
    "trace",
    "whole_matrix",
]
