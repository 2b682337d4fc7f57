"""Parameters whose tensor subclass decides what is all-gathered (FSDP2's extension).

[Note: all-gather extensions]
A parameter whose local shard defines ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather`` (torchao's ``NF4Tensor``, float8 training weights) is
sharded as FSDP2 does (``new_zeros`` of the padded shard, this rank's rows copied
in, the local shard a ``narrow`` of it), so the DTensor's local tensor is the
subclass. Its unit gathers per parameter, as FSDP2 does, not via the flat buffer:

* ``fsdp_pre_all_gather`` (either of FSDP2's signatures) returns the inputs (one of
  the unpadded shard's shape is padded with zero rows) and metadata; the unit's
  inputs are packed into one row (bytes when dtypes differ, or float8), gathered in
  one collective and copied into per-parameter outputs that live as long as the unit;
* ``fsdp_post_all_gather(outputs, metadata, param_dtype)`` returns the unsharded
  tensor and the inner tensors to free at reshard; later unshards pass ``out=``
  that parameter, whose inner tensors are re-allocated and refilled;
* ``fsdp_should_release_all_gather_outputs_after_post_all_gather()``, if true,
  frees the outputs right after the rebuild.

Plain parameters of such a unit are gathered the same way, padded and cast. Each
pack is an event (``packed``) before the collective: the checks of the public
``fully_shard`` compare the ranks' inputs there, so hooks that disagree raise an
error naming the parameter instead of hanging.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch

from . import _collectives, _compat
from ._collectives import AllGather
from ._flat_buffer import alloc_storage, free_storage
from ._policies import MixedPrecisionPolicy

if TYPE_CHECKING:
    from ._mesh import MeshInfo
    from ._sharded_param import ShardedParam

_RELEASE = "fsdp_should_release_all_gather_outputs_after_post_all_gather"


def has_extension(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` defines FSDP2's all-gather extension hooks."""
    pre = hasattr(tensor, "fsdp_pre_all_gather")
    post = hasattr(tensor, "fsdp_post_all_gather")
    if pre != post:
        raise AssertionError(  # FSDP2's type and wording
            "Both fsdp_pre_all_gather and fsdp_post_all_gather should be defined "
            f"if using all-gather extensions: {type(tensor).__name__}"
        )
    if hasattr(tensor, _RELEASE) and not pre:
        raise AssertionError(f"{_RELEASE} requires fsdp_pre_all_gather and fsdp_post_all_gather")
    return pre


def shard_subclass(
    param: torch.Tensor, info: MeshInfo, padded_shape: torch.Size, device: torch.device
) -> torch.Tensor:
    """This rank's dim-0 shard of a subclass parameter, cut with the operations
    FSDP2 uses (``chunk``, ``new_zeros``, ``narrow`` from row 0, ``copy_``) so the
    subclass survives (torchao's ``NF4Tensor`` slices from row 0 only)."""
    with torch.no_grad():
        param = param.detach()
        chunks, rank = torch.chunk(param, info.shard_size, dim=0), info.shard_rank
        length = chunks[rank].size(0) if rank < len(chunks) else 0
        padded = param.new_zeros(padded_shape)
        if length and not param.is_meta:
            padded.narrow(0, 0, length).copy_(chunks[rank])
        if not param.is_meta and padded.device != device:
            padded = padded.to(device)
        return padded.narrow(0, 0, length)


class _ParamGather:
    """One parameter's all-gather inputs' layout, metadata and outputs."""

    def __init__(self, param: ShardedParam) -> None:
        self.param = param
        self.extension = has_extension(param.local_shard)
        self.sizes: list[torch.Size] = []
        self.dtypes: list[torch.dtype] = []
        self.metadata: Any = None
        self.outputs: list[torch.Tensor] = []  # flat, world * input numel each
        self.inner: list[torch.Tensor] = []  # what fsdp_post_all_gather asked to free
        # the unsharded parameter's (contiguous) stride, for the hooks and the view
        self.orig_stride = torch.empty(param.orig_size, device="meta").stride()
        release = getattr(param.local_shard, _RELEASE, None)  # only with the extension
        self.release = bool(release() if callable(release) else release)
        pre = getattr(param.local_shard, "fsdp_pre_all_gather", None)
        # fsdp_pre_all_gather's arity: FSDP2's two signatures
        self.hook_args = len(inspect.signature(pre).parameters) if pre is not None else 0


class ExtensionGather:
    """The per-parameter all-gather of a unit with extension parameters; see
    [Note: all-gather extensions]."""

    def __init__(
        self, params: list[ShardedParam], mp_policy: MixedPrecisionPolicy, world: int
    ) -> None:
        self.params = [_ParamGather(p) for p in params]
        self.mp_policy = mp_policy
        # Of the last all-gather output; an estimate until the first one.
        self.nbytes = sum(world * p.chunk_numel * p.compute_dtype.itemsize for p in params)
        self.owns_output = False  # allocated here (torch.empty), not by a custom comm

    def _inputs(self, pg: _ParamGather, mesh: Any) -> list[torch.Tensor]:
        p = pg.param
        if not pg.extension:
            src = p.local_shard.to(p.device, p.compute_dtype).reshape(-1)
            padded = src.new_zeros(p.chunk_numel)
            padded[: src.numel()].copy_(src)
            pg.sizes, pg.dtypes = [padded.shape], [padded.dtype]
            return [padded]
        local: Any = p.local_shard  # a subclass with the extension's hooks
        if local.device != p.device:
            local = local.to(p.device, non_blocking=True)
        if local.numel() == 0 and p.chunk_numel:  # an empty shard: hooks see its padding
            local = local.new_zeros(p.chunk_shape)  # (reductions like max fail on empty ones)
        if pg.hook_args == 1:
            inputs, pg.metadata = local.fsdp_pre_all_gather(mesh)
        elif pg.hook_args == 5:
            module = p.owners[0][0]
            inputs, pg.metadata = local.fsdp_pre_all_gather(
                mesh, p.orig_size, pg.orig_stride, module, self.mp_policy
            )
        else:
            signature = inspect.signature(local.fsdp_pre_all_gather)
            raise AssertionError(  # FSDP2's type
                f"Invalid fsdp_pre_all_gather of {p.fqn!r}: {signature}; expects "
                "fsdp_pre_all_gather(self, mesh) or fsdp_pre_all_gather(self, mesh, "
                "outer_size, outer_stride, module, mp_policy)"
            )
        if p.local_shape != p.chunk_shape:  # an input that is the shard itself: pad it
            pad = p.chunk_rows - p.local_shape[0]
            inputs = [_pad_rows(t, pad) if t.shape == p.local_shape else t for t in inputs]
        pg.sizes = [t.size() for t in inputs]
        pg.dtypes = [t.dtype for t in inputs]
        return [t.reshape(-1) for t in inputs]

    def pack(
        self, comm: AllGather, info: MeshInfo, label: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Calls the pre-all-gather hooks and packs their inputs into this rank's row
        of a new all-gather output (from ``comm``); returns the output and the row."""
        mesh, world = info.mesh, info.shard_size
        if mesh.ndim > 1:  # HSDP: the shard dim's mesh, as FSDP2 passes
            mesh = mesh[mesh.mesh_dim_names[-1]]  # type: ignore[index]
        inputs = [t for pg in self.params for t in self._inputs(pg, mesh)]
        dtypes = {t.dtype for t in inputs}
        dtype = next(iter(dtypes)) if len(dtypes) == 1 else torch.uint8
        if dtype.is_floating_point and dtype.itemsize == 1:  # float8: gloo has no such type
            dtype = torch.uint8
        pieces = [t.contiguous().view(dtype) if dtype == torch.uint8 else t for t in inputs]
        row = sum(t.numel() for t in pieces)
        device = self.params[0].param.device
        out = _collectives.allocate(comm, world * row, dtype, device, label, "all_gather")
        self.owns_output = type(comm).allocate is _collectives.DefaultAllGather.allocate
        send = out.view(world, row)[info.shard_rank]
        torch.cat(pieces, out=send)
        self.nbytes = out.numel() * out.element_size()
        return out, send

    def copy_out(self, out: torch.Tensor, world: int) -> None:
        """Copies the gathered rows into each parameter's outputs and rebuilds the
        unsharded parameters (``fsdp_post_all_gather``)."""
        targets, sizes = [], []
        for pg in self.params:
            if not pg.outputs:
                pg.outputs = [
                    torch.empty(world * s.numel(), dtype=d, device=out.device)
                    for s, d in zip(pg.sizes, pg.dtypes)
                ]
            for o in pg.outputs:
                alloc_storage(o)
                view = o.view(world, -1)
                targets.append(view.view(torch.uint8) if out.dtype == torch.uint8 else view)
                sizes.append(targets[-1].shape[1])
        version = [t._version for t in targets]
        torch.split_with_sizes_copy(out.view(world, -1), sizes, dim=1, out=targets)
        for t, v in zip(targets, version):  # autograd may hold the unsharded views
            _compat.restore_version(t, v)
        if self.owns_output:  # copied out: free it before the rebuilds' temporaries
            free_storage(out)  # (a backward prefetch may already hold the next unit's)
        with torch.no_grad():
            for pg in self.params:
                self._post_all_gather(pg)

    def _post_all_gather(self, pg: _ParamGather) -> None:
        p = pg.param
        if not pg.extension:
            if p.unsharded_param is None:
                full = pg.outputs[0][: p.orig_numel].view(p.orig_size)
                p.unsharded_param = p.wrap_unsharded(full)
            return
        outputs = tuple(o.view(-1, *s[1:]) for o, s in zip(pg.outputs, pg.sizes))
        dtype = p.compute_dtype
        local: Any = p.local_shard
        if p.unsharded_param is None:
            tensor, pg.inner = local.fsdp_post_all_gather(outputs, pg.metadata, dtype)
            if tensor.shape != p.orig_size:  # padded rows: FSDP2's view of the first ones
                tensor = torch.as_strided(tensor, p.orig_size, pg.orig_stride, 0)
            p.unsharded_param = p.wrap_unsharded(tensor)
        else:
            for t in pg.inner:
                alloc_storage(t)
            local.fsdp_post_all_gather(outputs, pg.metadata, dtype, out=p.unsharded_param)
        pg.metadata = None
        if pg.release:
            for o in pg.outputs:
                free_storage(o)

    def free(self) -> None:
        """Frees the outputs and the inner tensors of the unsharded parameters."""
        for pg in self.params:
            for t in (*pg.outputs, *pg.inner):
                free_storage(t)


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    padded = tensor.new_zeros((tensor.size(0) + rows, *tensor.shape[1:]))
    padded[: tensor.size(0)].copy_(tensor)
    return padded
