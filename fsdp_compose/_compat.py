"""Every use of a torch internal that may move between releases lives here.

fsdp_compose declares ``torch>=2.11``, the oldest release it is exercised on
(2.11 with CUDA, 2.13 on the CPU). Where a public API exists it is used
elsewhere; this module wraps the few private ones we need for speed or because no
public equivalent exists. Fallbacks kept here cover renames *after* 2.11 (the
``*_single`` collectives) and bindings that may change, not older releases.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, _StridedShard

# ---------------------------------------------------------------------------
# DTensor construction without autograd or communication
# ---------------------------------------------------------------------------


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
    """Wraps ``local`` as a DTensor described by ``spec``.

    This runs once per parameter per step (sharded gradients), so it bypasses
    ``DTensor.from_local``'s argument handling and autograd; the public API is the
    fallback when the private constructor is unavailable.
    """
    try:
        return DTensor(local, spec, requires_grad=False)  # type: ignore[call-arg]
    except TypeError:  # pragma: no cover - constructor signature changed
        pass
    meta = spec.tensor_meta
    mesh, placements, shape, stride = spec.mesh, spec.placements, meta.shape, meta.stride
    with torch.no_grad():
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=shape, stride=stride
        )


def dtensor_spec_with_dtype(spec: Any, dtype: torch.dtype) -> Any:
    """Returns ``spec`` describing a tensor of ``dtype`` (same shape and placement)."""
    meta = spec.tensor_meta
    if meta.dtype == dtype:
        return spec
    return DTensorSpec(
        spec.mesh, spec.placements, tensor_meta=TensorMeta(meta.shape, meta.stride, dtype)
    )


def strided_shard(dim: int, split_factor: int) -> Placement:
    """DTensor's placement for a dim sharded over a mesh dim *inside* each of
    ``split_factor`` chunks made by a later mesh dim (FSDP's shard of a TP shard).

    ``_StridedShard`` is private, hence wrapped here.
    """
    return _StridedShard(dim, split_factor=split_factor)


_spmd_meshes: dict[tuple[int, int], tuple[DeviceMesh, DeviceMesh, DeviceMesh]] = {}


def concatenate_meshes(outer: DeviceMesh, inner: DeviceMesh) -> DeviceMesh:
    """The mesh whose dims are ``outer``'s followed by ``inner``'s (e.g. dp then tp),
    both sub-meshes of one root mesh; cached so that every parameter of a layout
    shares one mesh object.

    Built by ``DeviceMesh._concatenate``, as torch's FSDP2 does (private, hence
    wrapped here).
    """
    key = (id(outer), id(inner))
    hit = _spmd_meshes.get(key)
    if hit is not None:
        return hit[2]
    mesh = DeviceMesh._concatenate([outer, inner])
    # keep outer/inner alive so that their ids are not reused for other meshes
    _spmd_meshes[key] = (outer, inner, mesh)
    return mesh


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (itself if it is a root)."""
    return mesh._get_root_mesh()


def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a plain tensor whose collective (if any) has completed.

    DTensor redistributions may hand back a functional collective's
    ``AsyncCollectiveTensor``, which is only safe to read after ``wait()``.
    """
    wait = getattr(tensor, "wait", None)
    if callable(wait) and type(tensor) is not torch.Tensor:
        return wait()
    return tensor


def local_tensor(dtensor: torch.Tensor) -> torch.Tensor:
    """The local shard of ``dtensor`` (a ``DTensor``, typed as the ``Parameter`` or
    ``Tensor`` that holds it) without an autograd op (hot path)."""
    return dtensor._local_tensor  # type: ignore[attr-defined]


def dtensor_spec(dtensor: DTensor) -> Any:
    """The (private) spec of ``dtensor``: mesh, placements and tensor metadata."""
    return dtensor._spec


def set_local_tensor(dtensor: DTensor, tensor: torch.Tensor) -> None:
    """Replaces the local shard object of ``dtensor`` in place."""
    dtensor._local_tensor = tensor


def outside_fake_mode() -> contextlib.AbstractContextManager[Any]:
    """Suspends an active ``FakeTensorMode`` (a dry run) for code that must read
    tensor values back, such as a ``DeviceMesh``'s rank table."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


# ---------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------


def dynamo_disable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Keeps torch.compile from tracing into ``fn`` (our hooks mutate Python state
    and issue collectives); a compiled forward graph-breaks around it instead."""
    try:
        import torch._dynamo

        return torch._dynamo.disable(fn, recursive=True)
    except Exception:  # pragma: no cover - builds without dynamo
        return fn


def is_compiling() -> bool:
    """True while torch.compile traces the calling code."""
    return torch.compiler.is_compiling()


# ---------------------------------------------------------------------------
# Autograd engine
# ---------------------------------------------------------------------------


def queue_end_of_backward_callback(callback: Callable[[], None]) -> None:
    """Runs ``callback`` once the current ``backward()`` has finished all nodes,
    before ``backward()`` returns to the caller."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]


def inside_backward() -> bool:
    """True while the autograd engine executes a graph task (e.g. activation
    checkpointing recomputing a forward inside backward)."""
    return torch._C._current_graph_task_id() != -1


def restore_version(tensor: torch.Tensor, version: int) -> None:
    """Sets ``tensor``'s version counter back to ``version``, read before an
    in-place write that is not a semantic modification: refilling an unsharded
    parameter's storage that autograd saved for backward (see [Note: unsharded
    storage] in ``_unit.py``)."""
    torch._C._autograd._unsafe_set_version_counter((tensor,), (version,))


# ---------------------------------------------------------------------------
# Collectives whose names changed between releases
# ---------------------------------------------------------------------------

# Recent releases name these ``all_gather_single``/``reduce_scatter_single`` (what
# torch 2.13's FSDP2 calls); the older names stay the fallback (kept: not checked
# that 2.11 has the new ones).
_all_gather_single = getattr(dist, "all_gather_single", None)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None)


def all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> dist.Work | None:
    if _all_gather_single is not None:
        return _all_gather_single(output, input, group=group, async_op=async_op)
    return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)


# [Note: issuing gloo collectives]
# On the CPU, torch.distributed's Python wrappers (argument checks, group
# translation, coalescing bookkeeping) cost about as much as the collective's own
# issue for small tensors: 16-24 us of ~60 us per call (measured, torch 2.13).
# With hundreds of small units per step that is most of the per-unit overhead, so
# gloo collectives are issued on the ProcessGroup object directly. Accelerator
# backends keep the wrappers: they decide which stream the collective runs on.
# Only for groups whose CPU backend is a ProcessGroupGloo (serves_cpu_with_gloo):
# a group without one (torch's threaded test group, a CUDA-only group) has nothing
# to issue on, see [Note: collectives per backend] in _collectives.py.
_direct_gloo_ok = True


_W = TypeVar("_W")


def _issue_gloo(direct: Callable[[], _W], fallback: Callable[[], _W | None]) -> _W:
    global _direct_gloo_ok
    if _direct_gloo_ok:
        try:
            return direct()
        except (AttributeError, TypeError):  # pragma: no cover - binding changed
            _direct_gloo_ok = False
    work = fallback()
    assert work is not None
    return work


def all_gather_bytes(payload: bytes, group: dist.ProcessGroup, device: torch.device) -> list[bytes]:
    """Gathers every rank's ``payload`` with tensor collectives. torch's object
    collectives (``all_gather_object``) need NumPy, which torch does not require;
    the error they would raise here would hide the one being reported."""
    mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    sizes = torch.empty(group.size(), dtype=torch.int64, device=device)
    size = torch.tensor([mine.numel()], dtype=torch.int64, device=device)
    all_gather_into_tensor(sizes, size, group, async_op=False)
    lengths = [int(n) for n in sizes.tolist()]
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine
    gathered = torch.empty(group.size() * longest, dtype=torch.uint8, device=device)
    all_gather_into_tensor(gathered, padded, group, async_op=False)
    rows = gathered.view(group.size(), longest).cpu()
    return [bytes(rows[i, :n].tolist()) for i, n in enumerate(lengths)]


def gloo_all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup
) -> dist.Work:
    """Asynchronous all-gather on a gloo ``group`` (see [Note: issuing gloo collectives])."""
    return _issue_gloo(
        lambda: group._allgather_base(output, input),
        lambda: all_gather_into_tensor(output, input, group, async_op=True),
    )


class WorkGroup:
    """Several ``Work`` objects behaving as one: ``wait`` waits for all of them and
    ``get_future`` completes when all have."""

    __slots__ = ("_works",)

    def __init__(self, works: list[dist.Work]) -> None:
        self._works = works

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return torch.futures.collect_all([work.get_future() for work in self._works])


def gloo_all_gather_by_broadcast(output: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
    """Asynchronous all-gather on a gloo ``group`` as one broadcast per rank, each
    straight into its row of ``output`` (this rank's row already holds its input).
    See [Note: all-gather on gloo]."""
    rows = output.view(group.size(), -1)

    def direct() -> WorkGroup:
        works = []
        for root in range(group.size()):
            opts = dist.BroadcastOptions()
            opts.rootRank = root
            opts.rootTensor = 0
            works.append(group.broadcast([rows[root]], opts))
        return WorkGroup(works)

    def fallback() -> WorkGroup:
        ranks = dist.get_process_group_ranks(group)
        return WorkGroup(
            [
                dist.broadcast(rows[root], ranks[root], group=group, async_op=True)  # type: ignore[misc]
                for root in range(group.size())
            ]
        )

    # A WorkGroup has the part of Work's interface the collectives use (wait,
    # get_future), so callers treat it as one.
    return _issue_gloo(direct, fallback)  # type: ignore[return-value]


def gloo_all_to_all_single(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup
) -> dist.Work:
    """Asynchronous even all-to-all on a gloo ``group`` (see [Note: issuing gloo collectives])."""
    return _issue_gloo(
        lambda: group.alltoall_base(output, input, [], []),
        lambda: dist.all_to_all_single(output, input, group=group, async_op=True),
    )


def reduce_scatter_tensor(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> dist.Work | None:
    if _reduce_scatter_single is not None:
        return _reduce_scatter_single(
            output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op
        )
    return dist.reduce_scatter_tensor(
        output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op
    )


def chunk_cat(tensors: Sequence[torch.Tensor], num_chunks: int, out: torch.Tensor) -> None:
    """Packs ``tensors`` into ``out`` (shape ``(num_chunks, -1)``): row ``r`` holds
    the ``r``-th dim-0 chunk of every tensor, each padded to equal size, cast to
    ``out.dtype``, in one fused kernel."""
    torch._chunk_cat(list(tensors), dim=0, num_chunks=num_chunks, out=out)


def register_load_state_dict_pre_hook(module: torch.nn.Module, hook: Callable[..., None]) -> Any:
    """``hook(module, state_dict, prefix, *args)`` before ``module`` loads its state."""
    return module.register_load_state_dict_pre_hook(hook)


def default_store() -> dist.Store:
    """The key-value store of the default process group (used by debug checks)."""
    return dist.distributed_c10d._get_default_store()


def process_group_backend(group: dist.ProcessGroup) -> str:
    """Lower-case backend name of ``group`` (``"gloo"``, ``"nccl"``, ...)."""
    return str(dist.get_backend(group)).lower()


def serves_cpu_with_gloo(group: dist.ProcessGroup) -> bool:
    """Whether CPU tensors on ``group`` go to a real ``ProcessGroupGloo`` (possibly
    inside torch's debug wrapper), so that the gloo-only paths apply.

    Asks the group for its CPU backend object rather than comparing names: the
    threaded test group, the ``fake`` backend, MPI, UCC and vendor backends
    register other classes (or no CPU backend at all), and a group created with
    ``"cpu:gloo,cuda:nccl"`` is gloo for its CPU tensors.
    """
    gloo_class = getattr(dist, "ProcessGroupGloo", None)
    if gloo_class is None:  # torch built without gloo
        return False
    try:
        backend = group._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return False  # no backend object for the CPU (e.g. a Python-level ProcessGroup)
    # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the backend to check collectives first
    backend = getattr(backend, "wrapped_pg", backend)
    return isinstance(backend, gloo_class)


def is_fake_backend(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is torch's ``fake`` backend, whose collectives return
    at once without communicating (dry runs of a large world in one process)."""
    return process_group_backend(group) == "fake"


def process_group_timeout(group: dist.ProcessGroup) -> float | None:
    """The timeout (seconds) ``group`` was created with, or None if this torch
    version does not expose it (read through the backend's private options)."""
    try:
        device = (
            torch.device("cpu") if process_group_backend(group) == "gloo" else torch.device("cuda")
        )
        return float(group._get_backend(device).options._timeout.total_seconds())
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None
