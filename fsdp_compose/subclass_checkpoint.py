"""Loading DCP checkpoints of quantized tensor-subclass parameters at another world size.

``torch.distributed.checkpoint`` (DCP) loads a sharded tensor saved at one world
size into shards of another by cutting rows out of each saved shard
(``Tensor.narrow``) and copying them into a row range of the local shard. A
subclass whose rows cannot be cut that way fails there. torchao's ``NF4Tensor``
(QLoRA weights) slices from row 0 to its end only, so a checkpoint saved at
W=2 does not load at W=4 (``aten.slice(NF4Tensor) with start=64``), nor one
saved at W=4 at W=2, with FSDP2 or fsdp_compose alike.

:class:`NF4LoadPlanner` is a ``DefaultLoadPlanner`` that loads such checkpoints
exactly; pass it to ``dcp.load`` (it changes nothing else, and loads everything
that is not an ``NF4Tensor`` as the default planner does)::

    from fsdp_compose.subclass_checkpoint import NF4LoadPlanner

    state = model.state_dict()            # sharded at the new world size
    dcp.load(state, checkpoint_id=path, planner=NF4LoadPlanner())
    model.load_state_dict(state)

After it, each rank's ``NF4Tensor`` shard holds the same quantized data, block
scalers, scaler factors and scaler mean, bit for bit, as the shard that
``fully_shard`` cuts from the full weight at that world size: nothing is
dequantized or quantized again. It works with either runtime's state dict
(both hold DTensors whose local tensor is the ``NF4Tensor``).

[Note: NF4 reshard on load]
An ``NF4Tensor`` is one quantization of the full weight: its flat values are
stored two per byte (``quantized_data``), with one int8 scaler per
``block_size`` values (``quantized_scalers``), one float factor per
``scaler_block_size`` scalers (``quantization_factor``) and one mean of the
scalers for the whole weight (``scaler_mean``). torchao shards it by splitting the
three per-block tensors and keeping the rest, so every shard is a row range that
starts and ends on a scaler-block boundary (``block_size * scaler_block_size``
values; a shard that does not is not representable, and ``fully_shard`` of such
a weight fails at that world size). Every row range that resharding asks for
lies between two such boundaries of the old and the new shards, so the rows of
any overlap are an exact slice of each of the three tensors. The planner:

* rewrites each DCP read of an ``NF4Tensor`` that cuts the saved shard or the
  local one into a read of the whole saved shard (so DCP narrows nothing);
* gives DCP an empty ``NF4Tensor`` of the saved shard's shape and block sizes to
  copy into (torchao's ``copy_`` between two such tensors copies their inner
  tensors as they are);
* in ``commit_tensor``, copies the overlap's slice of the three tensors, and the
  scaler mean, into the local shard's own tensors (views of the parameter's).

The other designs need what is not ours to change: DCP narrows the tensor it
unpickled, an ``NF4Tensor`` whatever the runtime did at save time, so only a
torchao with general slicing, a global torch-function mode, or a checkpoint
that stores another type (which FSDP2 could then not load) would let the
default planner do this. A read of a whole saved shard holds that one shard in
memory at a time, as the default planner does at the same world size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

__all__ = ["NF4LoadPlanner", "nf4_rows"]

# The inner tensors of an NF4Tensor that hold one entry per value, block or
# scaler block, in the flat order of the weight's values.
_PER_ROW = ("quantized_data", "quantized_scalers", "quantization_factor")
# The inner tensors the whole weight shares.
_SHARED = ("scaler_mean", "nf4")


def _is_nf4(tensor: Any) -> bool:
    """Whether ``tensor`` is a torchao ``NF4Tensor`` (checked by its layout, so
    this module imports no torchao path)."""
    return isinstance(tensor, torch.Tensor) and all(
        hasattr(tensor, name) for name in (*_PER_ROW, *_SHARED, "block_size", "scaler_block_size")
    )


def _value_ranges(tensor: Any, start: int, length: int) -> dict[str, slice]:
    """The slices of the per-row inner tensors that hold rows ``[start,
    start + length)`` of ``tensor``; raises where the rows are not a whole number
    of scaler blocks (then no NF4Tensor holds exactly them)."""
    if tensor.dim() not in (1, 2) or not tensor.is_contiguous():
        raise NotImplementedError(
            f"NF4 rows of a {tensor.dim()}-D tensor of stride {tensor.stride()}: only contiguous 1-D and 2-D"
        )
    per_row = tensor.size(1) if tensor.dim() == 2 else 1
    begin, end = start * per_row, (start + length) * per_row
    group = tensor.block_size * tensor.scaler_block_size
    if start < 0 or start + length > tensor.size(0) or begin % group or end % group:
        raise ValueError(
            f"rows [{start}, {start + length}) of an NF4Tensor of shape {tuple(tensor.shape)}: a row "
            f"range must lie inside it and start and end on a multiple of block_size * "
            f"scaler_block_size = {group} values"
        )
    return {
        "quantized_data": slice(begin // 2, end // 2),  # two 4-bit values a byte
        "quantized_scalers": slice(begin // tensor.block_size, end // tensor.block_size),
        "quantization_factor": slice(begin // group, end // group),
    }


def _rebuild(tensor: Any, rows: int, inner: dict[str, torch.Tensor]) -> Any:
    """An NF4Tensor like ``tensor`` (block sizes, block count, dtype) of ``rows``
    rows over the given inner tensors, through the subclass's own unflatten."""
    names, ctx = tensor.__tensor_flatten__()
    size = torch.Size((rows, *tensor.shape[1:]))
    stride = torch.empty(size, device="meta").stride()
    meta = dataclasses.replace(
        ctx["tensor_meta"],
        original_shape=size,
        original_strides=stride,
        storage_offset=0,
        device=inner["quantized_data"].device,
        requires_grad=False,
    )
    inner = {name: inner.get(name, getattr(tensor, name)) for name in names}
    return type(tensor).__tensor_unflatten__(inner, {**ctx, "tensor_meta": meta}, size, stride)


def nf4_rows(tensor: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Rows ``[start, start + length)`` of an ``NF4Tensor`` as an ``NF4Tensor``
    whose inner tensors are views of ``tensor``'s (writing into them writes into
    ``tensor``), with the same block sizes and scaler mean: the rows' values,
    scalers and factors exactly, with nothing quantized again.

    Args:
        tensor: a contiguous 1-D or 2-D ``NF4Tensor``.
        start: the first row.
        length: the number of rows.

    Raises:
        ValueError: the row range does not start and end on a scaler-block
            boundary (``block_size * scaler_block_size`` values), so no
            ``NF4Tensor`` holds exactly these rows.
    """
    ranges = _value_ranges(tensor, start, length)
    t: Any = tensor
    return _rebuild(t, length, {name: getattr(t, name)[ranges[name]] for name in _PER_ROW})


def _empty_like_rows(tensor: Any, rows: int) -> Any:
    """An uninitialised NF4Tensor like ``tensor`` with ``rows`` rows, on the CPU
    (where DCP loads the saved shards)."""
    per_row = tensor.size(1) if tensor.dim() == 2 else 1
    values = rows * per_row
    sizes = {
        "quantized_data": values // 2,
        "quantized_scalers": values // tensor.block_size,
        "quantization_factor": values // (tensor.block_size * tensor.scaler_block_size),
    }
    inner = {
        name: torch.empty(sizes[name], dtype=getattr(tensor, name).dtype, device="cpu")
        for name in _PER_ROW
    }
    for name in _SHARED:
        inner[name] = torch.empty_like(getattr(tensor, name), device="cpu")
    return _rebuild(tensor, rows, inner)


class NF4LoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` that also loads ``NF4Tensor`` shards saved at
    another world size, exactly; see [Note: NF4 reshard on load].

    Takes ``DefaultLoadPlanner``'s arguments. Reads that cut an ``NF4Tensor``
    (the saved shard's or the local one's rows) read the whole saved shard
    instead and copy the overlap's quantized rows into the local shard's inner
    tensors; every other read is the default planner's. The model's NF4 block
    sizes must be the checkpoint's: torchao's ``copy_`` between NF4Tensors of
    other block sizes quantizes again, here as with the default planner.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._cuts: dict[ReadItem, ReadItem] = {}  # whole-shard read -> the read it replaces

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        self._cuts = {}
        items = []
        for item in plan.items:
            whole = self._whole_shard_read(item)
            if whole is not None:
                self._cuts[whole] = item
            items.append(whole or item)
        return dataclasses.replace(plan, items=items)

    def _whole_shard_read(self, item: ReadItem) -> ReadItem | None:
        """The read of ``item``'s whole saved shard where ``item`` reads part of
        an ``NF4Tensor``; None where the default read is exact."""
        assert self.metadata is not None
        stored = self.metadata.state_dict_metadata.get(item.storage_index.fqn)
        if not isinstance(stored, TensorStorageMetadata):
            return None
        local = self.lookup_tensor(item.dest_index)
        if not _is_nf4(local):
            return None
        saved = _saved_chunk_sizes(stored, item)
        if item.lengths == saved and item.lengths == local.size():
            return None  # the saved shard is the local one: DCP copies it whole
        inner_dims = zip(
            item.storage_offsets[1:], item.dest_offsets[1:], item.lengths[1:], saved[1:]
        )
        if any(s or d or n != full for s, d, n, full in inner_dims):
            raise NotImplementedError(
                f"{item.dest_index.fqn!r}: an NF4Tensor shard cut on a dimension other than 0"
            )
        zeros = torch.Size([0] * len(saved))
        return dataclasses.replace(
            item, dest_offsets=zeros, storage_offsets=zeros, lengths=torch.Size(saved)
        )

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        cut = self._cuts.get(read_item)
        if cut is None:
            return super().resolve_tensor(read_item)
        local = self.lookup_tensor(cut.dest_index)
        return _empty_like_rows(local, read_item.lengths[0])

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        cut = self._cuts.get(read_item)
        if cut is None:
            return super().commit_tensor(read_item, tensor)
        saved: Any = tensor
        local: Any = self.lookup_tensor(cut.dest_index)
        rows = cut.lengths[0]
        source = _value_ranges(saved, cut.storage_offsets[0], rows)
        target = _value_ranges(local, cut.dest_offsets[0], rows)
        with torch.no_grad():
            for name in _PER_ROW:
                getattr(local, name)[target[name]].copy_(getattr(saved, name)[source[name]])
            for name in _SHARED:  # one per weight: the same in every saved shard
                getattr(local, name).copy_(getattr(saved, name))


def _saved_chunk_sizes(stored: TensorStorageMetadata, item: ReadItem) -> torch.Size:
    offset = item.storage_index.offset
    hint = item.storage_index.index
    if hint is not None and hint < len(stored.chunks) and stored.chunks[hint].offsets == offset:
        return stored.chunks[hint].sizes
    for chunk in stored.chunks:
        if chunk.offsets == offset:
            return chunk.sizes
    raise ValueError(f"{item.storage_index.fqn!r}: no saved chunk at offset {tuple(offset or ())}")
