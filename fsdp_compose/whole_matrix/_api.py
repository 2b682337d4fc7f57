"""The public extension point: a function on each full matrix, on its owner rank."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch
from torch.distributed.tensor import DTensor

from .. import _runtime as runtime
from .. import _tool_compat
from ._agree import Descriptor, check_agreement
from ._exchange import ExchangePlan, ShardLayout, layout_of


def _plans(matrices: Sequence[torch.Tensor]) -> list[tuple[ExchangePlan, list[int]]]:
    """One exchange plan per shard group, with the indices of its matrices."""
    layouts: list[ShardLayout] = []
    for i, t in enumerate(matrices):
        if t.ndim != 2:
            raise ValueError(
                f"fsdp_compose: matrices[{i}] has shape {tuple(t.shape)}; a 2-D matrix is needed."
            )
        layouts.append(layout_of(t, f"matrices[{i}]"))
    members: dict[int, list[int]] = {}
    for i, layout in enumerate(layouts):
        members.setdefault(id(layout.group), []).append(i)
    return [
        (
            ExchangePlan.build(
                layouts[idx[0]], [(matrices[i].shape[0], matrices[i].shape[1]) for i in idx]
            ),
            idx,
        )
        for idx in members.values()
    ]


_LABEL = "whole_matrix.map_full_matrices"


def _check_same_matrices(
    comms: runtime.ToolCollectives, matrices: Sequence[torch.Tensor], idx: list[int]
) -> None:
    """One all-reduce: raises on every rank unless all pass the same shapes and
    dtypes in the same order (see [Note: ranks agree on the matrices before the
    exchange])."""
    descriptors: list[Descriptor] = [
        (f"matrices[{i}]", "", "", tuple(matrices[i].shape), str(matrices[i].dtype), True)
        for i in idx
    ]
    raw = hashlib.blake2b(repr(descriptors).encode(), digest_size=8).digest()
    digest = int.from_bytes(raw, "little", signed=True)
    check_agreement(comms, digest, lambda: descriptors, "map_full_matrices")


def matrix_owners(matrices: Sequence[torch.Tensor]) -> list[int]:
    """The rank, within its shard group, that runs :func:`map_full_matrices`'s
    function for each matrix of ``matrices`` (the same list passed there).

    Owners depend only on the shapes and the order of ``matrices``, so a
    whole-matrix optimizer can keep per-matrix state (a preconditioner) on the
    owner alone. Plain tensors (not sharded) are owned by rank 0 of a group of one.
    """
    owners = [0] * len(matrices)
    for plan, idx in _plans(matrices):
        for k, i in enumerate(idx):
            owners[i] = plan.owners[k]
    return owners


def map_full_matrices(
    matrices: Sequence[torch.Tensor],
    fn: Callable[[int, torch.Tensor], torch.Tensor],
    *,
    comm_dtype: torch.dtype | None = None,
    result_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Runs ``fn`` once on each *full* matrix, on one owner rank, and returns each
    result sharded like its input.

    Every rank of the data-parallel group must call this with the same list (same
    shapes, same order): one all-reduce per shard group checks the shapes and
    dtypes, and every rank raises the same ``RuntimeError`` naming the first
    difference before any data moves. Each matrix ``matrices[i]`` (a ``DTensor`` sharded by
    :func:`~fsdp_compose.fully_shard`, or a plain tensor, which is treated as
    unsharded) is gathered onto its owner (see :func:`matrix_owners`), which calls
    ``fn(i, full)``; every rank receives its rows of the result. Owners are
    balanced by ``m·n·min(m, n)`` (a little more for a tall matrix); matrices move in rounds (each owner's next
    matrices, up to 2^21 elements), each round one all-to-all to the owners and one
    back, overlapped with ``fn``: a rank holds at most nine buffers of one round's
    size (inputs, results and rows; see [Note: owner compute for whole-matrix
    optimizers]).

    Args:
        matrices: 2-D tensors. ``DTensor`` inputs must be sharded on rows
            (``Shard(0)``) over one mesh dimension and replicated over the others
            (HSDP: every replica group runs ``fn`` on its own owners).
        fn: called as ``fn(i, full)`` on the owner of matrix ``i``, with ``full`` a
            fresh contiguous ``(m, n)`` tensor in ``comm_dtype`` that it may
            overwrite. It must return an ``(m, n)`` tensor (any layout); it is cast
            to ``result_dtype``. It runs inside the exchange: if it raises on the
            owner, every rank finishes the exchange without that matrix's result
            (its output holds zeros) and then raises the same ``RuntimeError``
            quoting the owner's error.
        comm_dtype: dtype the matrices travel in (default: their dtype, which must
            then be the same for all of them).
        result_dtype: dtype of the results (default: ``comm_dtype``).

    Returns:
        A list with, for each input, a tensor laid out like it (a ``DTensor`` with
        the same mesh and placements, or a plain tensor) holding ``fn``'s result.
    """
    if not matrices:
        return []
    dtypes = {t.dtype for t in matrices}
    if comm_dtype is None:
        if len(dtypes) != 1:
            raise ValueError(
                f"fsdp_compose: matrices of several dtypes {sorted(map(str, dtypes))}; pass comm_dtype."
            )
        comm_dtype = next(iter(dtypes))
    out_dtype = result_dtype or comm_dtype
    plans = _plans(matrices)
    comms = {
        id(plan): runtime.ToolCollectives(_LABEL, plan.layout.group, owner=matrices[idx[0]])
        for plan, idx in plans
    }
    for plan, idx in plans:  # the same list on every rank, before any data moves
        if plan.layout.group is not None and plan.layout.world > 1:
            _check_same_matrices(comms[id(plan)], matrices, idx)
    locals_ = [runtime.local_tensor(t) if isinstance(t, DTensor) else t for t in matrices]
    outputs = [torch.empty(x.shape, dtype=out_dtype, device=x.device) for x in locals_]
    for plan, idx in plans:

        def compute(k: int, full: torch.Tensor, idx: list[int] = idx) -> torch.Tensor:
            out = fn(idx[k], full)
            if tuple(out.shape) != tuple(full.shape):
                raise ValueError(
                    f"fsdp_compose: map_full_matrices' fn returned shape {tuple(out.shape)} for "
                    f"matrix {idx[k]} of shape {tuple(full.shape)}; it must return the same shape."
                )
            return out

        def fill(k: int, rows: torch.Tensor, idx: list[int] = idx) -> None:
            rows.copy_(locals_[idx[k]])

        def consume(k: int, rows: torch.Tensor, idx: list[int] = idx) -> None:
            outputs[idx[k]].copy_(rows)

        with torch.no_grad():
            plan.run(
                fill,
                compute,
                consume,
                comm_dtype=comm_dtype,
                result_dtype=out_dtype,
                device=locals_[idx[0]].device,
                describe=lambda k: f"matrices[{idx[k]}]",  # noqa: B023 - run returns first
                comms=comms[id(plan)],
            )
    return [
        runtime.dtensor_from_local(
            out, runtime.dtensor_spec_with_dtype(_tool_compat.dtensor_spec(t), out_dtype)
        )
        if isinstance(t, DTensor)
        else out
        for t, out in zip(matrices, outputs)
    ]
