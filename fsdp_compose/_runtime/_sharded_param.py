"""One managed parameter: its sharded DTensor, padding, and unsharded view.

[Note: sharding layout]
A parameter of shape ``(n, *rest)`` sharded over W ranks on dim 0 is cut, like
``torch.chunk`` and DTensor's ``Shard(0)``, into chunks of ``c = ceil(n / W)`` rows:
rank r owns rows ``[min(r*c, n), min((r+1)*c, n))``, possibly none. In communication
buffers every rank has a slot of ``c * prod(rest)`` elements; padding is never read
back (so never zeroed). As under FSDP2, the local shard is the start (storage offset
0) of a storage of its padded slot, so that a one-parameter unit's all-gather can
send that storage as it is ([Note: in-place all-gather] in ``_flat_buffer.py``); a
shard given new data (``to_empty``, ``load_state_dict(assign=True)``) is moved back
into such a storage at lazy init, as FSDP2 does. Sharding on a dim ``k > 0``
(``shard_placement_fn``) requires ``n_k`` divisible by W; the local shard is
``chunk(k)[r]`` made contiguous.

[Note: tensor-parallel parameters]
A DTensor parameter on a 1-D tensor-parallel mesh is sharded the same way on its
*TP-local* tensor, which is all the unit gathers and reduces. The sharded
parameter is a DTensor on the mesh ``dp x tp`` (``replicate x shard x tp`` with
HSDP) of the TP DTensor's global shape. When TP shards the same tensor dim,
FSDP's rows are a slice inside each TP chunk: ``_StridedShard(dim,
split_factor=tp_size)`` on the dp dim, so ``full_tensor()`` and DCP see the true
layout. The unsharded parameter is a DTensor on the TP mesh with the original
placement (TP's forward runs as without FSDP); its gradient, possibly
``Partial``, is redistributed to that placement before being reduce-scattered.

[Note: parameter-subclass attributes]
An ``nn.Parameter`` subclass without the all-gather extension (bitsandbytes'
``Params4bit``) is sharded as plain data, as in FSDP2, but the sharded and the
unsharded parameters carry its instance attributes (``quant_state``, ...) and
its properties' values, for ``forward``, ``state_dict()`` and
``get_model_state_dict``; the unsharded one takes the sharded one's current
values when registered.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from . import _compat, _extensions, _ownership
from ._errors import FSDPValueError
from ._mesh import MeshInfo


class ShardedParam:
    """Owns one parameter's sharded DTensor and describes its unsharded form.
    ``param`` (maybe on the meta device, or a TP DTensor) is registered as each
    ``(module, attribute)`` of ``owners`` (several for tied weights); its shard
    lives on ``device``, or on ``offload_device`` (the CPU, ``pin_memory``)."""

    def __init__(
        self,
        param: nn.Parameter,
        owners: list[tuple[nn.Module, str]],
        mesh_info: MeshInfo,
        shard_dim: int,
        device: torch.device,
        offload_device: torch.device | None = None,
        pin_memory: bool = False,
    ) -> None:
        self.unit_label: str | None = None  # see mark_owned
        self.tp_spec = _tp_spec(param, owners, mesh_info)
        # The model-parallel dim of tp_spec's mesh and its placement (None: only dp dims).
        self.tp_dim: int | None = None
        self.tp_placement: Placement | None = None
        if self.tp_spec is not None:
            spmd = mesh_info.spmd
            dp_dims = () if spmd is None else spmd.dp_dims
            self.tp_dim = next((i for i in range(self.tp_spec.mesh.ndim) if i not in dp_dims), None)
            if self.tp_dim is not None:
                self.tp_placement = self.tp_spec.placements[self.tp_dim]
        self.global_size = param.shape  # the shape users see (the TP DTensor's global shape)
        requires_grad = param.requires_grad  # a DTensor's local tensor never requires grad
        if self.tp_spec is not None:
            param = _compat.local_tensor(param)  # type: ignore[assignment]
        _check_shardable(param, owners)
        if not -param.dim() <= shard_dim < param.dim():
            raise FSDPValueError(
                f"Shard dim {shard_dim} is invalid for {param.ndim}D tensor: shard dim "
                f"{shard_dim} is out of range for parameter {owners[0][1]!r} of shape "
                f"{tuple(param.shape)}"
            )
        shard_dim %= param.dim()
        world, rank = mesh_info.shard_size, mesh_info.shard_rank
        size = param.shape
        if shard_dim != 0 and size[shard_dim] % world != 0:
            tp_local = " (TP-local)" if self.tp_spec is not None else ""
            raise NotImplementedError(  # FSDP2's type, see [Note: FSDP2's exception types]
                f"parameter {owners[0][1]!r} of{tp_local} shape {tuple(size)} cannot be sharded on "
                f"dim {shard_dim} over {world} ranks: sharding on a dim other than 0 needs the dim "
                "size to be divisible by the shard world size (dim 0 allows uneven sizes)."
            )
        self.owners = owners
        self.mesh_info = mesh_info
        self.shard_dim = shard_dim
        self.orig_size = size
        self.orig_numel = param.numel()
        self.orig_dtype = param.dtype
        self.device = device
        self.offload_device = offload_device
        # Pinned host shards make the device-to-host gradient copies asynchronous.
        self.pin_memory = pin_memory and offload_device is not None
        self.fqn = owners[0][1]  # refined at lazy init to the name under the root

        rows = size[shard_dim]
        self.chunk_rows = math.ceil(rows / world) if shard_dim == 0 else rows // world
        self.chunk_shape = torch.Size((*size[:shard_dim], self.chunk_rows, *size[shard_dim + 1 :]))
        self.chunk_numel = self.chunk_shape.numel()  # padded slot size, in elements
        start = min(rank * self.chunk_rows, rows)
        stop = min(start + self.chunk_rows, rows)
        self.local_shape = torch.Size((*size[:shard_dim], stop - start, *size[shard_dim + 1 :]))
        self.local_numel = self.local_shape.numel()

        self.spec = self._sharded_spec(param.dtype)

        # An all-gather-extension subclass stays the local tensor ([Note: all-gather extensions]).
        self.extension = self.tp_spec is None and _extensions.has_extension(param)
        local = self._cut_local_shard(param, start, stop - start, pin_memory)
        # fully_shard registers it once the whole unit is valid ([Note: atomic fully_shard]).
        self.sharded_param = nn.Parameter(
            _compat.dtensor_from_local(local, self.spec), requires_grad=requires_grad
        )
        self.pad_local_shard()
        self.attributes = {} if self.extension else _subclass_attributes(param)
        self.sharded_param.__dict__.update(self.attributes)

        # Set by the unit at lazy init (its flat buffer decides where the data lives).
        self.unsharded_param: nn.Parameter | None = None
        self.compute_dtype: torch.dtype = param.dtype
        self.param_dtype: torch.dtype | None = None  # the policy's, for this parameter
        self.grad_dtype: torch.dtype | None = None  # the unsharded parameter's
        # The dtype of the sharded gradient (MixedPrecisionPolicy.grad_dtype, else the
        # parameter's own): set at lazy init.
        self.sharded_grad_dtype: torch.dtype = param.dtype
        # Unsharded gradient accumulated in the reduce dtype across no-sync steps.
        self.accumulated_grad: torch.Tensor | None = None

    def _cut_local_shard(
        self, param: torch.Tensor, start: int, length: int, pin_memory: bool
    ) -> torch.Tensor:
        """This rank's shard of ``param`` (rows ``[start, start + length)`` of the
        shard dim), on its storage device."""
        d, device, offload_device = self.shard_dim, self.device, self.offload_device
        with torch.no_grad():
            if self.extension:
                if d != 0:
                    raise NotImplementedError(
                        f"parameter {self.fqn!r} is a {type(param).__name__} with FSDP2's "
                        "all-gather extension; fsdp_compose shards such parameters on dim 0 only."
                    )
                return _extensions.shard_subclass(param, self.mesh_info, self.chunk_shape, device)
            # a copy, so the full original tensor can be freed
            local = param.detach().narrow(d, start, length)
            if param.is_meta:  # (empty_like, not empty: a tensor subclass stays one)
                return torch.empty_like(local, memory_format=torch.contiguous_format)
            target = offload_device if offload_device is not None else device
            local = local.to(target, copy=True).contiguous()
            if pin_memory and offload_device is not None and not local.is_pinned():
                local = local.pin_memory()
            return local

    def _sharded_spec(self, dtype: torch.dtype) -> Any:
        info, d = self.mesh_info, self.shard_dim
        replicate: tuple[Placement, ...] = (Replicate(),) if info.is_hsdp else ()
        if self.tp_spec is None:
            stride = torch.empty(self.orig_size, device="meta").stride()
            dp_placements = (*replicate, Shard(d))
            return _compat.make_dtensor_spec(
                info.mesh, dp_placements, self.orig_size, stride, dtype
            )
        spmd = info.spmd
        if spmd is None:  # FSDP's dims, then the TP mesh's one
            mesh = self._dp_tp_mesh(self.tp_spec.mesh)
            placements = [*replicate, Shard(d), *self.tp_spec.placements]
            dp_dim, tp_dim = len(replicate), mesh.ndim - 1
        else:  # the full SPMD mesh, see [Note: dp_mesh_dims]
            mesh, placements = spmd.mesh, list(self.tp_spec.placements)
            if spmd.replicate_dim is not None:
                placements[spmd.replicate_dim] = Replicate()
            dp_dim, tp_dim = spmd.shard_dim, self.tp_dim
        # FSDP's shard of a TP shard of the same tensor dim on a later mesh dim is
        # a slice inside each TP chunk (see the note above): a strided shard.
        placements[dp_dim] = Shard(d)
        tp = self.tp_placement
        split = mesh.size(tp_dim) if tp_dim is not None and tp_dim > dp_dim else 1
        if split > 1 and tp is not None and _shard_dim_of(tp, len(self.global_size)) == d:
            placements[dp_dim] = _compat.strided_shard(d, split)
        meta = self.tp_spec.tensor_meta
        return _compat.make_dtensor_spec(mesh, tuple(placements), meta.shape, meta.stride, dtype)

    def _dp_tp_mesh(self, tp_mesh: Any) -> Any:
        try:
            return _compat.concatenate_meshes(self.mesh_info.mesh, tp_mesh)
        except Exception as exc:
            raise ValueError(
                f"parameter {self.fqn!r} is a DTensor on mesh {tp_mesh}, which cannot be "
                f"combined with fully_shard's mesh {self.mesh_info.mesh} ({exc}). Both must be "
                "sub-meshes of one device mesh, e.g. mesh = init_device_mesh(device, (dp, tp), "
                'mesh_dim_names=("dp", "tp")); parallelize_module(block, mesh["tp"], ...); '
                'fully_shard(block, mesh=mesh["dp"]).'
            ) from exc

    # -- registration ------------------------------------------------------

    def register(self, tensor: nn.Parameter) -> None:
        """Makes ``tensor`` the parameter seen by every owning module."""
        if self.attributes and tensor is not self.sharded_param:  # the sharded one's values
            tensor.__dict__.update(
                (k, getattr(self.sharded_param, k, None)) for k in self.attributes
            )
        for module, name in self.owners:
            if type(module).__setattr__ is nn.Module.__setattr__:  # skip its checks: hot path
                module._parameters[name] = tensor
            else:  # a user-defined __setattr__ may have side effects; respect them
                setattr(module, name, tensor)

    def registered(self) -> Any:
        module, name = self.owners[0]
        return module._parameters.get(name)

    # -- sharded side ------------------------------------------------------

    @property
    def local_shard(self) -> torch.Tensor:
        """The local (unpadded) shard data, on its storage device."""
        return _compat.local_tensor(self.sharded_param)

    def data_version(self) -> int:
        """Changes whenever the sharded data is written in place, through the DTensor
        (optimizer steps) or its local tensor (not counted on the wrapper)."""
        return self.sharded_param._version + self.local_shard._version

    def padded_storage(self) -> torch.Tensor | None:
        """The local shard's storage as its padded slot (``chunk_numel`` elements), or
        None where it is not laid out so ([Note: sharding layout])."""
        local = self.local_shard
        padded = local.storage_offset() == 0 and local.is_contiguous()
        if not padded or local.untyped_storage().nbytes() < self.chunk_numel * local.itemsize:
            return None
        return local.new_empty(0).set_(local.untyped_storage(), 0, (self.chunk_numel,), (1,))

    def pad_local_shard(self) -> None:
        """Moves the local shard (the same tensor object, its version kept: the values
        are the same) to the start of a storage of its padded slot, if it is not there
        ([Note: sharding layout]); not offloaded or extension shards, sent through a copy."""
        local = self.local_shard
        if self.extension or self.offload_device is not None or local.is_meta:
            return
        if self.padded_storage() is None:
            version = local._version
            with torch.inference_mode(False), torch.no_grad():  # the storage outlives this
                padded = torch.empty(self.chunk_numel, dtype=local.dtype, device=local.device)
                padded[: local.numel()].view_as(local).copy_(local)
                local.set_(padded.untyped_storage(), 0, local.shape, local.stride())
            _compat.restore_version(local, version)

    def resync_sharded_param(self) -> None:
        """Adopts the module's new sharded parameter if it was replaced
        (``load_state_dict(assign=True)``, ``_apply`` without swap)."""
        current = self.registered()
        if current is self.sharded_param:
            return  # _apply swapped the tensor's contents: the same object, still recorded
        if not isinstance(current, DTensor) or current.shape != self.global_size:
            raise RuntimeError(
                f"parameter {self.fqn!r} was replaced by {type(current).__name__}"
                f"{tuple(getattr(current, 'shape', ()))} after fully_shard; a sharded module's "
                "parameters must stay DTensors of the original shape (load a state dict instead "
                "of assigning new parameters)."
            )
        if not isinstance(current, nn.Parameter):
            current = nn.Parameter(current, requires_grad=self.sharded_param.requires_grad)
        current.__dict__.update(self.attributes)
        self.sharded_param = current
        self.register(current)
        self.mark_owned()

    def mark_owned(self, unit_label: str | None = None) -> None:
        """Records the sharded parameter as owned by the unit labelled ``unit_label``
        (the runtime's answer to ``owner_of``/``fqn_of``; see [Note: parameter records])."""
        if unit_label is not None:
            self.unit_label = unit_label
        _ownership.record_sharded(self.sharded_param, self)

    def make_sharded_grad(self, local_grad: torch.Tensor) -> DTensor:
        spec = _compat.dtensor_spec_with_dtype(self.spec, local_grad.dtype)
        return _compat.dtensor_from_local(local_grad, spec)

    # -- unsharded side ----------------------------------------------------

    def wrap_unsharded(self, local: torch.Tensor) -> nn.Parameter:
        """The unsharded parameter on ``local`` (a view of the unit's buffer); with
        tensor parallel, a DTensor on the TP mesh with the original placement."""
        if self.tp_spec is not None:
            spec = _compat.dtensor_spec_with_dtype(self.tp_spec, local.dtype)
            local = _compat.dtensor_from_local(local, spec)
        param = nn.Parameter(local, requires_grad=self.sharded_param.requires_grad)
        if self.grad_dtype is not None:
            param.grad_dtype = self.grad_dtype  # type: ignore[attr-defined]
        return param

    @property
    def unsharded_local(self) -> torch.Tensor:
        """The unsharded parameter's data as a plain tensor (its TP-local tensor)."""
        up = self.unsharded_param
        assert up is not None
        return _compat.local_tensor(up) if isinstance(up, DTensor) else up

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """An unsharded gradient as the plain tensor that the unit reduces; a TP
        gradient is first redistributed to the TP placement (summing a ``Partial``)."""
        if not isinstance(grad, DTensor):
            return grad
        assert self.tp_spec is not None, f"{self.fqn}: DTensor gradient of a plain parameter"
        target = tuple(self.tp_spec.placements)
        spmd = self.mesh_info.spmd
        if spmd is not None:
            # The dp dims stay as they are: each rank's local gradient is its
            # contribution, summed by the reduce-scatter (and all-reduce) below.
            target = tuple(
                grad.placements[i]
                if i in spmd.dp_dims and not isinstance(grad.placements[i], Shard)
                else (Replicate() if i in spmd.dp_dims else p)
                for i, p in enumerate(target)
            )
        if tuple(grad.placements) != target:
            grad = grad.redistribute(grad.device_mesh, target)
        local = _compat.wait_tensor(_compat.local_tensor(grad))
        if local.shape != self.orig_size:
            raise RuntimeError(
                f"fsdp_compose: gradient of {self.fqn!r} has local shape {tuple(local.shape)}, "
                f"expected the TP-local shape {tuple(self.orig_size)}"
            )
        return local

    def rank_view(self, tensor: torch.Tensor, world: int) -> torch.Tensor:
        """Views an unsharded-shaped tensor as ``(world, *chunk_shape)``: rank ``r``'s
        chunk at index ``r`` (strided for dims > 0)."""
        d = self.shard_dim
        return tensor.unflatten(d, (world, self.chunk_rows)).movedim(d, 0)

    def rank_chunks(self, tensor: torch.Tensor, world: int) -> torch.Tensor:
        """:meth:`rank_view` as ``(world, chunk)`` rows, one per rank (dims > 0 need
        a permuted copy, which ``reshape`` makes)."""
        if self.shard_dim == 0:
            return tensor.reshape(world, -1)
        return self.rank_view(tensor, world).reshape(world, -1)

    def __repr__(self) -> str:
        return (
            f"ShardedParam({self.fqn}, size={tuple(self.global_size)}, shard_dim={self.shard_dim})"
        )


@contextlib.contextmanager
def grads_kept(params: list[ShardedParam]) -> Iterator[None]:
    """Takes the sharded gradients of ``params`` off them for the block (a module
    conversion, ``_apply``) and then puts them back in their own dtype, moved to
    where their parameter now lives (the same object, or what replaced it), also
    if the block fails part way: ``MixedPrecisionPolicy.grad_dtype``'s gradients
    are never cast with their parameters."""
    kept = [(p, p.registered().grad) for p in params if p.registered().grad is not None]
    for p, _ in kept:
        p.registered().grad = None
    try:
        yield
    finally:
        for p, grad in kept:
            param = p.registered()
            param.grad_dtype = grad.dtype
            param.grad = grad.to(param.device)


def _subclass_attributes(param: torch.Tensor) -> dict[str, Any]:
    """What a parameter subclass's sharded and unsharded parameters carry; see
    [Note: parameter-subclass attributes]."""
    mro = type(param).__mro__
    if nn.Parameter not in mro[1:]:  # a plain parameter, or not an nn.Parameter subclass
        return {}
    attributes = dict(vars(param))
    for cls in mro[: mro.index(nn.Parameter)]:
        for name, value in vars(cls).items():
            if isinstance(value, property) and not hasattr(torch.Tensor, name):
                with contextlib.suppress(AttributeError):  # raised when its state is unset
                    attributes.setdefault(name, getattr(param, name))
    return attributes


def _check_shardable(param: torch.Tensor, owners: list[tuple[nn.Module, str]]) -> None:
    """Refuses what FSDP2 refuses, with FSDP2's type and its message first."""
    if param.dim() == 0:
        raise ValueError(
            "fully_shard doesn't support scalar parameters. Change "
            f"{owners[0][1]} to a 1D tensor with numel equal to 1. fsdp_compose: "
            f"cannot shard the 0-dim (scalar) parameter {owners[0][1]!r} of "
            f"{type(owners[0][0]).__name__}: make it a 1-element 1-D tensor, or pass it "
            "in ignored_params to leave it unsharded."
        )
    if not param.is_contiguous():
        name = owners[0][1]
        raise NotImplementedError(  # FSDP2's type, see [Note: FSDP2's exception types]
            "FSDP does not support non-contiguous parameters yet: fsdp_compose, as "
            f"FSDP2, refuses the non-contiguous parameter {name!r} of "
            f"{type(owners[0][0]).__name__} (shape {tuple(param.shape)}, stride "
            f"{param.stride()}): make it contiguous first, e.g. "
            f"module.{name.rsplit('.', 1)[-1]} = nn.Parameter(param.contiguous())."
        )


def _shard_dim_of(placement: Placement, ndim: int) -> int | None:
    """The tensor dim a TP placement shards, or None (replicated)."""
    return placement.dim % ndim if type(placement) is Shard else None


def _tp_spec(param: nn.Parameter, owners: list[tuple[nn.Module, str]], mesh_info: MeshInfo) -> Any:
    """Validates a DTensor parameter (on a 1-D tensor-parallel mesh, or with
    ``dp_mesh_dims`` on the full SPMD mesh, ``Replicate()`` on the dp dims) and
    returns its DTensor spec; ``None`` for a plain parameter."""
    spmd = mesh_info.spmd
    name = f"{owners[0][1]!r} of {type(owners[0][0]).__name__}"
    if not isinstance(param, DTensor):
        if spmd is None:
            return None
        raise ValueError(
            "When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh "
            f"(e.g. via distribute_tensor / distribute_module), but parameter {name} is a plain "
            f"tensor. Distribute it on {spmd.mesh} with Replicate() on the data-parallel dims."
        )
    mesh = param.device_mesh
    model_dims = [0]
    if spmd is None and mesh.ndim != 1:
        raise NotImplementedError(
            f"parameter {name} is a DTensor on a {mesh.ndim}-D mesh {mesh}; fully_shard composes "
            "with DTensor parameters on a 1-D (tensor-parallel) mesh only."
        )
    if spmd is None and mesh.device_type != mesh_info.mesh.device_type:
        raise ValueError(
            f"parameter {name} lives on a {mesh.device_type!r} mesh but fully_shard's mesh is "
            f"{mesh_info.mesh.device_type!r}: use one device type for both."
        )
    if spmd is not None:
        # (FSDP2 compares the objects; but torch's DTensor may give a parameter an equal
        # mesh object made earlier, from its caches, so that a second model in a process
        # is refused: equal meshes are accepted)
        if mesh != spmd.mesh:
            raise ValueError(
                f"Expected param's DTensor mesh to be the same mesh passed to fully_shard, but "
                f"{name} is on {mesh}, not {spmd.mesh}: distribute it on the mesh passed"
            )
        dim_names = mesh.mesh_dim_names or ()
        for i in spmd.dp_dims:
            if not isinstance(param.placements[i], Replicate):
                raise ValueError(
                    f"Expected Replicate() on data-parallel mesh dim {dim_names[i]!r} (index "
                    f"{i}) for parameter {name} but got {param.placements[i]}"
                )
        model_dims = [i for i in range(mesh.ndim) if i not in spmd.dp_dims]
    for i in model_dims:
        if type(param.placements[i]) not in (Shard, Replicate):
            raise NotImplementedError(
                f"parameter {name} has placement {param.placements[i]} on mesh dim {i}; "
                "fully_shard composes with model-parallel placements Shard(dim) or Replicate() "
                "only."
            )
    if not param.is_meta and not _compat.local_tensor(param).is_contiguous():
        raise NotImplementedError(f"parameter {name} has a non-contiguous local tensor")
    return param._spec  # the public equivalents rebuild it
