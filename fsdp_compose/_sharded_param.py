"""One managed parameter: its sharded DTensor, padding, and unsharded view.

[Note: sharding layout]
A parameter of shape ``(n, *rest)`` sharded over W ranks on dim 0 is cut into W
chunks of ``c = ceil(n / W)`` rows, exactly like ``torch.chunk`` and DTensor's
``Shard(0)``: rank r owns rows ``[min(r*c, n), min((r+1)*c, n))``, which may be
fewer than ``c`` rows or none at all. The local shard is stored unpadded (as the
DTensor's local tensor); padding exists only inside communication buffers, where
every rank contributes a slot of ``c * prod(rest)`` elements. Padding elements are
never read back, so they are never zeroed.

Sharding on a dim ``k > 0`` (``shard_placement_fn``) requires ``n_k`` divisible by
W; the local shard is ``chunk(k)[r]`` made contiguous.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import _compat
from ._mesh import MeshInfo


class ShardedParam:
    """Owns one parameter's sharded DTensor and describes its unsharded form.

    Args:
        param: the original parameter (full tensor, possibly on the meta device).
        owners: every ``(module, attribute)`` under which ``param`` is registered
            inside the unit (several for tied weights).
        mesh_info: the unit's data-parallel layout.
        shard_dim: tensor dim to shard (``Shard(shard_dim)``).
        device: device the sharded data lives on when not offloaded.
        offload_device: ``"cpu"`` when the sharded data is offloaded to host memory
            on an accelerator mesh, else ``None``.
        pin_memory: pin offloaded host memory.
    """

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
        if isinstance(param, DTensor):
            raise NotImplementedError(
                f"parameter {owners[0][1]!r} is already a DTensor (e.g. from tensor parallel); "
                "composing fully_shard with DTensor parameters is not supported yet"
            )
        if param.dim() == 0:
            raise ValueError(
                f"fully_shard cannot shard the 0-dim (scalar) parameter {owners[0][1]!r} of "
                f"{type(owners[0][0]).__name__}: make it a 1-element 1-D tensor, or pass it "
                "in ignored_params to leave it unsharded."
            )
        if not -param.dim() <= shard_dim < param.dim():
            raise ValueError(
                f"shard dim {shard_dim} is out of range for parameter {owners[0][1]!r} "
                f"of shape {tuple(param.shape)}"
            )
        shard_dim %= param.dim()
        world, rank = mesh_info.shard_size, mesh_info.shard_rank
        size = param.shape
        if shard_dim != 0 and size[shard_dim] % world != 0:
            raise ValueError(
                f"parameter {owners[0][1]!r} of shape {tuple(size)} cannot be sharded on dim "
                f"{shard_dim} over {world} ranks: sharding on a dim other than 0 needs the dim "
                f"size to be divisible by the shard world size (dim 0 allows uneven sizes)."
            )
        self.owners = owners
        self.mesh_info = mesh_info
        self.shard_dim = shard_dim
        self.orig_size = size
        self.orig_numel = param.numel()
        self.orig_dtype = param.dtype
        self.device = device
        self.offload_device = offload_device
        self.fqn = owners[0][1]  # refined at lazy init to the name under the root

        rows = size[shard_dim]
        self.chunk_rows = math.ceil(rows / world) if shard_dim == 0 else rows // world
        self.chunk_shape = torch.Size(
            (*size[:shard_dim], self.chunk_rows, *size[shard_dim + 1 :])
        )
        self.chunk_numel = self.chunk_shape.numel()  # padded slot size, in elements
        start = min(rank * self.chunk_rows, rows)
        stop = min(start + self.chunk_rows, rows)
        self.local_shape = torch.Size((*size[:shard_dim], stop - start, *size[shard_dim + 1 :]))
        self.local_numel = self.local_shape.numel()

        placements = (
            (Replicate(), Shard(shard_dim)) if mesh_info.is_hsdp else (Shard(shard_dim),)
        )
        self.placements = placements
        self.spec = _compat.make_dtensor_spec(
            mesh_info.mesh, placements, size, _contiguous_stride(size), param.dtype
        )

        with torch.no_grad():
            if param.is_meta:
                local = torch.empty(self.local_shape, dtype=param.dtype, device="meta")
            else:
                # clone so the full original tensor can be freed once fully_shard returns
                local = param.detach().narrow(shard_dim, start, stop - start)
                target = offload_device if offload_device is not None else device
                local = local.to(target, copy=True).contiguous()
                if pin_memory and offload_device is not None and not local.is_pinned():
                    local = local.pin_memory()
        self.sharded_param = nn.Parameter(
            _compat.dtensor_from_local(local, self.spec), requires_grad=param.requires_grad
        )
        self.register(self.sharded_param)

        # Set by the unit at lazy init (its flat buffer decides where the data lives).
        self.unsharded_param: nn.Parameter | None = None
        self.compute_dtype: torch.dtype = param.dtype
        # Unsharded gradient accumulated in the reduce dtype across no-sync steps.
        self.accumulated_grad: torch.Tensor | None = None

    # -- registration ------------------------------------------------------

    def register(self, tensor: nn.Parameter) -> None:
        """Makes ``tensor`` the parameter seen by every owning module."""
        for module, name in self.owners:
            if type(module).__setattr__ is nn.Module.__setattr__:  # skip its checks: hot path
                module._parameters[name] = tensor
            else:  # a user-defined __setattr__ may have side effects; respect them
                setattr(module, name, tensor)

    def registered(self) -> object:
        module, name = self.owners[0]
        return module._parameters.get(name)

    # -- sharded side ------------------------------------------------------

    @property
    def local_shard(self) -> torch.Tensor:
        """The local (unpadded) shard data, on its storage device."""
        return _compat.local_tensor(self.sharded_param)

    def data_version(self) -> int:
        """Changes whenever the sharded data is written in place, through the DTensor
        (optimizer steps, ``copy_``) or through its local tensor (``to_local()``
        writes, which DTensor's dispatch does not count on the wrapper)."""
        return self.sharded_param._version + self.local_shard._version

    def resync_sharded_param(self) -> None:
        """Adopts a new sharded parameter object if the module's registration was
        replaced (``load_state_dict(assign=True)``, ``_apply`` without swap)."""
        current = self.registered()
        if current is self.sharded_param:
            return
        if not isinstance(current, DTensor) or current.shape != self.orig_size:
            raise RuntimeError(
                f"parameter {self.fqn!r} was replaced by "
                f"{type(current).__name__}{tuple(getattr(current, 'shape', ()))} after fully_shard; "
                "a sharded module's parameters must stay DTensors of the original shape "
                "(load a state dict instead of assigning new parameters)."
            )
        if not isinstance(current, nn.Parameter):
            current = nn.Parameter(current, requires_grad=self.sharded_param.requires_grad)
        self.sharded_param = current
        self.register(current)

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full (unsharded) tensor of this parameter's shape."""
        rows = self.orig_size[self.shard_dim]
        start = min(self.mesh_info.shard_rank * self.chunk_rows, rows)
        return full.narrow(self.shard_dim, start, self.local_shape[self.shard_dim])

    def make_sharded_grad(self, local_grad: torch.Tensor) -> DTensor:
        spec = _compat.dtensor_spec_with_dtype(self.spec, local_grad.dtype)
        return _compat.dtensor_from_local(local_grad, spec)

    # -- unsharded side ----------------------------------------------------

    def rank_chunks(self, tensor: torch.Tensor, world: int) -> torch.Tensor:
        """Views an unsharded-shaped tensor as ``(world, chunk)`` rows, one per rank
        (dims > 0 need a permuted copy, which ``reshape`` makes)."""
        if self.shard_dim == 0:
            return tensor.reshape(world, -1)
        d = self.shard_dim
        return tensor.unflatten(d, (world, self.chunk_rows)).movedim(d, 0).reshape(world, -1)

    def unsharded_from_rank_chunks(self, chunks: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`rank_chunks` for dims > 0: ``(W, chunk)`` -> full layout view."""
        d = self.shard_dim
        return chunks.view(-1, *self.chunk_shape).movedim(0, d).flatten(d, d + 1)

    def __repr__(self) -> str:
        return f"ShardedParam({self.fqn}, size={tuple(self.orig_size)}, shard_dim={self.shard_dim})"


def _contiguous_stride(size: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(size):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))

