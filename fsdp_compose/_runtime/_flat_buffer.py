"""The flat communication buffer of a unit: its layout, and the copies in and out.

[Note: unsharded storage]
Each unit owns one flat ``unsharded`` buffer of ``W * S`` elements (``S`` = one
rank's padded row) laid out parameter-major: parameter p occupies ``W * slot_p``
elements starting at ``W * offset_p``, and its unsharded ``nn.Parameter`` is a view
of the first ``numel_p``. The buffer is created once; resharding resizes its
storage to zero bytes, unsharding resizes it back and refills it, so references
autograd saved for backward stay valid (the refill restores the same values and
does not bump the version counter). With ``set_keep_unsharded_storage(True)`` the
memory is kept too, so data pointers stay fixed (CUDA graph capture).

The all-gather output is rank-major (``(W, S)``: row r is rank r's slots), so one
copy (``split_with_sizes_copy``) moves each parameter's ``(W, slot_p)`` block into
place. Gradients go the other way with one ``chunk_cat``.

With a shard world of one and no dtype cast, the unsharded parameter simply
aliases the local shard (no buffer, no copy): a one-rank run costs what the
unwrapped model costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _compat
from ._mesh import MeshInfo
from ._sharded_param import ShardedParam

_BYTE_ALIGNMENT = 16  # slot alignment when a unit mixes dtypes and buffers are bytes


@dataclass
class _Slot:
    param: ShardedParam | None  # None: alignment gap
    offset: int  # within one rank's row, in buffer elements
    size: int  # per-rank padded slot, in buffer elements


class FlatBuffer:
    """The flat all-gather buffer of one unit's ``params`` on the shard group of
    ``mesh_info``: its layout, and the copies of the shards in (before an
    all-gather) and of the gathered rows out (after it); see [Note: unsharded
    storage]. ``alias``: no buffer, each unsharded parameter is its local shard."""

    def __init__(self, params: list[ShardedParam], mesh_info: MeshInfo, offload: bool) -> None:
        self.params = params
        self.device = mesh_info.device
        self.offload = offload
        self.world = world = mesh_info.shard_size
        dtypes = {p.compute_dtype for p in params}
        self.uniform = uniform = len(dtypes) == 1
        self.dtype = next(iter(dtypes)) if uniform else torch.uint8
        slots: list[_Slot] = []
        row = 0
        for p in params:
            if uniform:
                size = p.chunk_numel
            else:
                misalign = row % _BYTE_ALIGNMENT
                if misalign:
                    slots.append(_Slot(None, row, _BYTE_ALIGNMENT - misalign))
                    row += _BYTE_ALIGNMENT - misalign
                size = p.chunk_numel * p.compute_dtype.itemsize
            slots.append(_Slot(p, row, size))
            row += size
        self.slots = slots
        self.row = row
        self.alias = (
            world == 1 and not offload and all(p.compute_dtype == p.orig_dtype for p in params)
        )
        self._fused_copy_out = all(p.shard_dim == 0 for p in params)
        # This rank's shards fill its row without gaps (same dtype, no padding in
        # its slots): copy-in is one concatenation.
        self._dense_copy_in = uniform and all(
            s.param is not None and s.param.local_numel == s.size for s in slots
        )
        self._copy_out_sizes: dict[int, list[int]] = {}
        # Persistent destination views of the copy-out, per gathering world size.
        self._copy_out_targets: dict[int, list[torch.Tensor]] = {}
        self.unsharded: torch.Tensor | None = None
        if self.alias:
            for p in params:
                p.unsharded_param = p.wrap_unsharded(p.local_shard)
            return
        # Views are created while the storage exists (slicing checks bounds); the
        # unit frees the storage until its first unshard.
        flat = torch.empty(world * row, dtype=self.dtype, device=self.device)
        self.unsharded = flat
        for slot in slots:
            sp = slot.param
            if sp is None:
                continue
            start = world * slot.offset
            if uniform:
                view = flat[start : start + sp.orig_numel]
            else:
                view = flat[start : start + sp.orig_numel * sp.compute_dtype.itemsize].view(
                    sp.compute_dtype
                )
            sp.unsharded_param = sp.wrap_unsharded(view.view(sp.orig_size))
        self._copy_out_views(world)

    @property
    def nbytes(self) -> int:
        """Bytes of the unsharded parameters (none when they alias the shards)."""
        return 0 if self.alias else self.world * self.row * self.dtype.itemsize

    def free(self) -> None:
        """Frees the unsharded storage's memory (the storage itself stays)."""
        if self.unsharded is not None:
            _free_storage(self.unsharded)

    def _copy_out_views(self, world: int) -> list[torch.Tensor]:
        views = self._copy_out_targets.get(world)
        if views is None:
            assert self.unsharded is not None
            scale = self.world // world
            views = [
                self.unsharded[self.world * s.offset : self.world * (s.offset + s.size)].view(
                    world, s.size * scale
                )
                for s in self.slots
            ]
            self._copy_out_targets[world] = views
        return views

    def copy_in(self, row: torch.Tensor) -> None:
        """Writes each local shard (cast to its compute dtype) into its slot of
        ``row``; padding is left as is (never read back). No autograd: neither
        side requires grad, so no ``no_grad`` context is needed (hot path)."""
        if self._dense_copy_in:
            srcs = [self._copy_in_source(p).view(-1) for p in self.params]
            torch.cat(srcs, out=row) if len(srcs) > 1 else row.copy_(srcs[0])
            return
        dsts, srcs = [], []
        byte_mode = not self.uniform
        for slot in self.slots:
            p = slot.param
            if p is None or p.local_numel == 0:
                continue
            size = p.local_numel * (p.compute_dtype.itemsize if byte_mode else 1)
            dst = row[slot.offset : slot.offset + size]
            dsts.append(dst.view(p.compute_dtype) if byte_mode else dst)
            srcs.append(self._copy_in_source(p).reshape(-1))
        if dsts:
            torch._foreach_copy_(dsts, srcs)

    def _copy_in_source(self, p: ShardedParam) -> torch.Tensor:
        src = p.local_shard
        if self.offload:
            src = src.to(self.device, non_blocking=True)
        return src.contiguous()

    def copy_out(self, out: torch.Tensor, world: int) -> None:
        """Moves the rows ``out`` gathered over ``world`` ranks into the unsharded
        parameters (reallocating their storage)."""
        assert self.unsharded is not None
        _alloc_storage(self.unsharded)
        scale = self.world // world
        # Refilling storage autograd may have saved is not a modification: keep
        # the version (see [Note: unsharded storage]). Nothing here requires grad.
        version = self.unsharded._version
        try:
            rows = out.view(world, -1)
            if self._fused_copy_out:
                sizes = self._copy_out_sizes.get(world)
                if sizes is None:
                    sizes = self._copy_out_sizes[world] = [s.size * scale for s in self.slots]
                torch.split_with_sizes_copy(rows, sizes, dim=1, out=self._copy_out_views(world))
            else:  # some parameter is sharded on a dim > 0 (needs a permuted copy)
                self._copy_out_per_param(rows, scale)
        finally:
            _compat.restore_version(self.unsharded, version)

    def _copy_out_per_param(self, rows: torch.Tensor, scale: int) -> None:
        with torch.no_grad():  # writes through the unsharded parameters (leaves)
            for slot in self.slots:
                p = slot.param
                if p is None:
                    continue
                block = rows[:, slot.offset * scale : (slot.offset + slot.size) * scale]
                if block.dtype != p.compute_dtype:  # byte buffers: reinterpret
                    block = block.view(p.compute_dtype)
                if p.shard_dim == 0:
                    flat = p.unsharded_local.view(-1)
                    full = p.orig_numel // p.chunk_numel
                    flat[: full * p.chunk_numel].view(full, -1).copy_(block[:full])
                    rest = p.orig_numel - full * p.chunk_numel
                    if rest:
                        flat[full * p.chunk_numel :].copy_(block[full, :rest])
                else:
                    p.unsharded_local.copy_(p.unsharded_from_rank_chunks(block))

    def pack_post_forward_shard(self, group_size: int, group_rank: int) -> torch.Tensor:
        """This rank's share for ``reshard_after_forward=group_size``: rows
        ``[i*k, (i+1)*k)`` of every parameter block, ``k = W / group_size``, exactly
        what an all-gather over its group must contribute to rebuild the ``(W, S)``
        rank-major gather layout in backward."""
        assert self.unsharded is not None
        w, k, i = self.world, self.world // group_size, group_rank
        pieces = [self.unsharded[w * s.offset + i * k * s.size :][: k * s.size] for s in self.slots]
        numel = sum(p.numel() for p in pieces)
        return torch.cat(pieces, out=torch.empty(numel, dtype=self.dtype, device=self.device))


def _alloc_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def _free_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)
