"""Every torch internal that may move between releases (private APIs needed for speed
or without a public equivalent). fsdp_compose declares ``torch>=2.11`` (exercised on
2.11 with CUDA, 2.13 on CPU); fallbacks here cover renames after 2.11, not before."""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed as dist
from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem, _get_registry
from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule
from torch.distributed.tensor import DeviceMesh, DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.profiler import record_function

# FSDP2 2.15 reduces gradients in their parameter's dtype when
# MixedPrecisionPolicy.reduce_dtype is None; earlier releases in param_dtype.
REDUCE_IN_PARAM_DTYPE = torch.__version__ >= "2.15"  # TorchVersion compares releases
# FSDP2 with the pending-gradient API (2.16's) accumulates unsynchronized gradients
# through autograd, in the unsharded parameter's grad_dtype, and its zero_grad clears
# them ([Note: pending gradients] in _reduce.py). A feature test: builds from torch's
# main branch count.
PENDING_GRADIENT_API = hasattr(_TorchFSDPModule, "get_pending_gradients")


_P = ParamSpec("_P")
_R = TypeVar("_R")


def make_dtensor_spec(
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: torch.Size,
    stride: tuple[int, ...],
    dtype: torch.dtype,
) -> Any:
    """Builds the (private) spec object used by :func:`dtensor_from_local`."""
    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, stride, dtype))


def dtensor_from_local(local: torch.Tensor, spec: Any) -> DTensor:
    """``local`` as a DTensor described by ``spec``, without ``DTensor.from_local``'s
    argument handling and autograd (hot path)."""
    return DTensor(local, spec, requires_grad=False)  # type: ignore[call-arg]


def dtensor_spec_with_dtype(spec: Any, dtype: torch.dtype) -> Any:
    """Returns ``spec`` describing a tensor of ``dtype`` (same shape and placement)."""
    meta = spec.tensor_meta
    if meta.dtype == dtype:
        return spec
    return make_dtensor_spec(spec.mesh, spec.placements, meta.shape, meta.stride, dtype)


def strided_shard(dim: int, split_factor: int) -> Placement:
    """The (private) placement of a dim sharded over a mesh dim *inside* each of
    ``split_factor`` chunks made by a later mesh dim (FSDP's shard of a TP shard)."""
    return _StridedShard(dim, split_factor=split_factor)


# Weak values: an entry lives as long as someone (a unit's mesh info, a parameter's
# DTensor spec) holds the concatenated mesh, and goes with the model that uses it.
_spmd_meshes: weakref.WeakValueDictionary[tuple[Any, ...], DeviceMesh] = (
    weakref.WeakValueDictionary()
)


def concatenate_meshes(outer: DeviceMesh, inner: DeviceMesh) -> DeviceMesh:
    """The mesh with ``outer``'s dims then ``inner``'s (e.g. dp then tp; sub-meshes of
    one root mesh), as FSDP2 builds it; cached so a layout's parameters share one mesh."""
    # Keyed by value (DeviceMesh compares layout and ranks; the group names tell apart
    # meshes over process groups created again): a sub-mesh sliced again from the same
    # root mesh (a new object each time) finds the same concatenated mesh.
    key = (outer, inner, tuple(outer._dim_group_names), tuple(inner._dim_group_names))
    mesh = _spmd_meshes.get(key)
    if mesh is None:
        mesh = _spmd_meshes[key] = DeviceMesh._concatenate([outer, inner])
    return mesh


def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` once its collective (if any) has completed: DTensor may hand back a
    functional collective's ``AsyncCollectiveTensor``, safe to read after ``wait()``."""
    wait = getattr(tensor, "wait", None)
    if callable(wait) and type(tensor) is not torch.Tensor:
        return wait()
    return tensor


def local_tensor(dtensor: torch.Tensor) -> torch.Tensor:
    """The local shard of ``dtensor`` (a ``DTensor``, typed as the ``Parameter`` or
    ``Tensor`` that holds it) without an autograd op (hot path)."""
    return dtensor._local_tensor  # type: ignore[attr-defined]


def outside_fake_mode() -> contextlib.AbstractContextManager[Any]:
    """Suspends an active ``FakeTensorMode`` (a dry run) for code that must read
    tensor values back, such as a ``DeviceMesh``'s rank table."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def queue_end_of_backward_callback(callback: Callable[[], None]) -> None:
    """Runs ``callback`` when the current ``backward()`` has run every node, before it returns."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]


def without_functorch(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """``method``, run with torch.func's transforms (``jvp``, ``vmap``) turned off while
    one is active, as FSDP2 runs its unit operations: a unit's buffers and unsharded
    parameters are plain tensors, never a transform's wrappers (whose storage cannot
    be freed or refilled)."""

    @functools.wraps(method)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if torch._C._are_functorch_transforms_active():
            with torch._C._DisableFuncTorch():
                return method(*args, **kwargs)
        return method(*args, **kwargs)

    return run


# [Note: torch's composable-API registry]
# torch's composable APIs (FSDP2's fully_shard, replicate, checkpoint) record
# themselves by name in a registry on each module they are applied to, and each reads
# the others' entries: replicate leaves the parameters of modules marked
# "fully_shard" to it (and refuses such a module), and FSDP2's fully_shard does not
# enter a subtree marked "replicate". fsdp_compose's fully_shard reads and writes the
# registry as FSDP2's does, so that the two compose as with FSDP2.


def replicated_by_torch(module: torch.nn.Module) -> bool:
    """Whether torch's composable ``replicate`` manages ``module`` (its subtree)."""
    return "replicate" in (_get_registry(module) or ())


def register_fully_shard(module: torch.nn.Module) -> None:
    """Marks ``module`` as managed by ``fully_shard`` in torch's registry."""
    module.__dict__.setdefault(REGISTRY_KEY, {}).setdefault("fully_shard", RegistryItem())


def inside_backward() -> bool:
    """Whether autograd runs a graph task now (e.g. checkpointing recomputes a forward)."""
    return torch._C._current_graph_task_id() != -1


def restore_version(tensor: torch.Tensor, version: int) -> None:
    """Sets ``tensor``'s version counter back to ``version`` after an in-place write
    that is no semantic change ([Note: unsharded storage] in ``_flat_buffer.py``)."""
    torch._C._autograd._unsafe_set_version_counter((tensor,), (version,))


# torch 2.13 renames these ``all_gather_single``/``reduce_scatter_single`` and deprecates
# the older names, kept as the fallback (not checked that 2.11 has the new ones). Names,
# not functions: the default collectives look them up on ``torch.distributed`` at each
# call, as FSDP2 does, so that a test replacing torch's function (torch's own
# ``patch_all_gather``/``patch_reduce_scatter`` count FSDP2's collectives that way)
# sees fsdp_compose's calls too.
_RENAMED = hasattr(dist, "reduce_scatter_single")  # both renamed in the same release
ALL_GATHER = "all_gather_single" if _RENAMED else "all_gather_into_tensor"
REDUCE_SCATTER = "reduce_scatter_single" if _RENAMED else "reduce_scatter_tensor"


def chunk_cat(tensors: Sequence[torch.Tensor], num_chunks: int, out: torch.Tensor) -> None:
    """Packs ``tensors`` into ``out`` (``(num_chunks, -1)``) in one fused kernel: row
    ``r`` holds every tensor's ``r``-th dim-0 chunk, padded, cast to ``out.dtype``."""
    torch._chunk_cat(list(tensors), dim=0, num_chunks=num_chunks, out=out)


_NO_LABEL = contextlib.nullcontext()
# The root unit's name (observers, messages); its FQN, which FSDP2's spans show, is "".
ROOT_NAME = "root"
# FSDP2's logger: ``TORCH_LOGS=fsdp`` shows its debug lines, and the same ones of ours.
_FSDP_LOG = logging.getLogger("torch.distributed.fsdp.fully_shard")


def profiler_label(what: str, unit: str = "") -> contextlib.AbstractContextManager[Any]:
    """``record_function("FSDP::{what} ({unit})")``, named as FSDP2 names its spans (the
    root's without a unit: its FQN is empty), while torch's profiler runs, and the same
    name as a debug line of FSDP2's logger where that is on; otherwise nothing (a label
    costs a dispatcher call each, on every hook)."""
    profiling = torch._C._autograd._profiler_enabled()
    if not profiling and not _FSDP_LOG.isEnabledFor(logging.DEBUG):
        return _NO_LABEL
    root = not unit or unit == ROOT_NAME or unit.startswith(ROOT_NAME + " [")
    name = f"FSDP::{what}" if root else f"FSDP::{what} ({unit})"
    _FSDP_LOG.debug("%s", name)
    return record_function(name) if profiling else _NO_LABEL
