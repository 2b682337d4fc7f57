"""The flat communication buffer of a unit: its layout, and the copies in and out.

[Note: unsharded storage]
Each unit owns one flat ``unsharded`` buffer of ``W * S`` elements (``S``: one
rank's padded row), parameter-major: parameter p occupies ``W * slot_p`` elements
from ``W * offset_p``, and its unsharded ``nn.Parameter`` views the first
``numel_p``. Resharding resizes the storage to zero bytes; unsharding resizes and
refills it without bumping the version counter, so tensors autograd saved stay
valid. ``set_keep_unsharded_storage(True)`` keeps the memory (fixed data pointers
for CUDA graphs). The all-gather output is rank-major (``(W, S)``), so one
``split_with_sizes_copy`` moves each parameter's ``(W, slot_p)`` block into place;
gradients go the other way with one ``chunk_cat``. With a shard world of one, no
cast and plain (not tensor-subclass) shards, the unsharded parameter aliases the
local shard (no buffer, no copy).

[Note: in-place all-gather]
With one parameter sharded on dim 0, the rank-major all-gather output is the
parameter-major layout (rank ``r``'s chunk holds rows ``[r*k, (r+1)*k)``, padding
only at the end), so the default all-gather writes straight into the unsharded
storage and there is nothing to copy out: the same collective, bytes and values,
one full-size copy and one full-size temporary less. A custom ``all_gather_comm``
keeps its own buffer (its ``allocate`` decides where the output lives).

Nor is there anything to copy *in* for such a unit when no cast is due: its local
shard starts a storage of its padded slot ([Note: sharding layout] in
``_sharded_param.py``), which is this rank's row as it is, so the all-gather sends
that storage. A unit of several parameters packs their shards into the row (the
copy-in): keeping them inside one shared row instead would make the local tensors
views at non-zero offsets of one storage, whose DTensors torch cannot pickle
(``torch.save(model.state_dict())`` fails) and whose storage sharing FSDP2's users
never see.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import _collectives, _compat

if TYPE_CHECKING:
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
    ``mesh_info``; see [Note: unsharded storage]. ``alias``: no buffer, each
    unsharded parameter is its local shard."""

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
        no_cast = all(p.compute_dtype == p.orig_dtype for p in params)
        # A tensor-subclass shard (a wrapper subclass such as TwoTensor, by its flatten
        # protocol; one with FSDP2's all-gather extension has its own gather) is
        # gathered into a plain tensor on one rank too, as FSDP2 does: aliasing it
        # would make the forward compute with the subclass.
        subclass = any(hasattr(p.local_shard, "__tensor_flatten__") for p in params)
        self.alias = world == 1 and not offload and no_cast and not subclass
        self._fused_copy_out = all(p.shard_dim == 0 for p in params)
        # See [Note: in-place all-gather]; the version the unsharded storage had before.
        self._in_place = len(slots) == 1 and self._fused_copy_out
        # One parameter, sent as stored (see the note): nothing to copy in.
        self._send_stored = len(slots) == 1 and no_cast and not offload
        self._version = 0
        # This rank's shards fill its row without gaps (same dtype, no padding in
        # its slots): copy-in is one concatenation.
        self._dense_copy_in = uniform and all(
            s.param is not None and s.param.local_numel == s.size for s in slots
        )
        # The copy-out's split sizes and persistent destination views, per gathering world.
        self._copy_out: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
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
            start, numel = world * slot.offset, sp.orig_numel
            view = flat[start : start + numel * (1 if uniform else sp.compute_dtype.itemsize)]
            view = view.view(sp.compute_dtype).view(sp.orig_size)
            sp.unsharded_param = sp.wrap_unsharded(view)
        self._copy_out_targets(world)

    @property
    def nbytes(self) -> int:
        """Bytes of the unsharded parameters (none when they alias the shards)."""
        return 0 if self.alias else self.world * self.row * self.dtype.itemsize

    def free(self) -> None:
        """Frees the unsharded storage's memory (the storage itself stays)."""
        if self.unsharded is not None:
            free_storage(self.unsharded)

    def _copy_out_targets(self, world: int) -> tuple[list[int], list[torch.Tensor]]:
        targets = self._copy_out.get(world)
        if targets is None:
            assert self.unsharded is not None
            w, scale = self.world, self.world // world
            sizes = [s.size * scale for s in self.slots]
            views = [
                self.unsharded[w * s.offset : w * (s.offset + s.size)].view(world, size)
                for s, size in zip(self.slots, sizes)
            ]
            targets = self._copy_out[world] = (sizes, views)
        return targets

    def gather_output(self, comm: _collectives.AllGather, label: str) -> torch.Tensor:
        """The flat all-gather output (``W * row`` elements, also when gathering the
        post-forward shares of a smaller group): the unsharded storage itself where
        possible ([Note: in-place all-gather]), else a buffer from ``comm``."""
        if self._in_place and type(comm).allocate is _collectives.DefaultAllGather.allocate:
            assert self.unsharded is not None
            alloc_storage(self.unsharded)
            self._version = self.unsharded._version  # restored by copy_out
            return self.unsharded
        numel = self.world * self.row
        return _collectives.allocate(comm, numel, self.dtype, self.device, label, "all_gather")

    def copy_in(self, row: torch.Tensor) -> torch.Tensor:
        """Writes each local shard (cast to its compute dtype) into its slot of
        ``row`` and returns ``row``; padding is left as is (never read back). Returns
        instead the padded storage of a lone shard sent as stored, copying nothing
        ([Note: in-place all-gather]). No autograd: neither side requires grad, so no
        ``no_grad`` context is needed (hot path)."""
        stored = self.params[0].padded_storage() if self._send_stored else None
        if stored is not None:
            return stored
        if self._dense_copy_in:
            srcs = [self._copy_in_source(p).view(-1) for p in self.params]
            torch.cat(srcs, out=row) if len(srcs) > 1 else row.copy_(srcs[0])
            return row
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
        return row

    def _copy_in_source(self, p: ShardedParam) -> torch.Tensor:
        src = p.local_shard
        if self.offload:
            src = src.to(self.device, non_blocking=True)
        return src.contiguous()

    def copy_out(self, out: torch.Tensor, world: int) -> None:
        """Moves the rows ``out`` gathered over ``world`` ranks into the unsharded
        parameters (reallocating their storage)."""
        assert self.unsharded is not None
        if out is self.unsharded:  # gathered in place: only the version to keep
            _compat.restore_version(out, self._version)
            return
        alloc_storage(self.unsharded)
        sizes, views = self._copy_out_targets(world)
        # Refilling storage autograd may have saved is not a modification: keep
        # the version (see [Note: unsharded storage]).
        version = self.unsharded._version
        try:
            rows = out.view(world, -1)
            if self._fused_copy_out:
                torch.split_with_sizes_copy(rows, sizes, dim=1, out=views)
                return
            # Some parameter is sharded on a dim > 0: its rank chunks land in a
            # permuted view of the unsharded parameter (no temporary), all in one call.
            dsts, srcs = [], []
            for slot, block, view in zip(self.slots, rows.split(sizes, dim=1), views):
                p = slot.param
                if p is not None and p.shard_dim != 0:  # (byte buffers: reinterpret)
                    block = block.view(p.compute_dtype).view(world, *p.chunk_shape)
                    view = p.rank_view(p.unsharded_local, world)
                dsts.append(view)
                srcs.append(block)
            with torch.no_grad():  # writes through the unsharded parameters (leaves)
                torch._foreach_copy_(dsts, srcs)
        finally:
            _compat.restore_version(self.unsharded, version)

    def pack_post_forward_shard(self, group_size: int, group_rank: int) -> torch.Tensor:
        """This rank's share for ``reshard_after_forward=group_size``: rows ``[i*k,
        (i+1)*k)`` of every parameter block (``k = W / group_size``), what its group's
        all-gather contributes to rebuild the ``(W, S)`` layout in backward."""
        assert self.unsharded is not None
        w, k, i = self.world, self.world // group_size, group_rank
        pieces = [self.unsharded[w * s.offset + i * k * s.size :][: k * s.size] for s in self.slots]
        numel = sum(p.numel() for p in pieces)
        return torch.cat(pieces, out=torch.empty(numel, dtype=self.dtype, device=self.device))


def alloc_storage(tensor: torch.Tensor) -> None:
    """Re-allocates a freed storage to its full size (``tensor`` may be a view)."""
    storage = tensor.untyped_storage()
    if storage.size() == 0:
        storage.resize_(int(tensor.storage_offset() + tensor.numel()) * tensor.element_size())


def free_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)
