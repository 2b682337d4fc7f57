"""Checks that the ranks agree, beyond FSDP2's, through the job's store.

At the root's lazy init (``on_root_init``) the ranks of each data-parallel group
compare their units (names, parameter shapes and dtypes, the settings that change
collectives); before an extension unit's first all-gather (``on_unit("packed")``)
they compare what its subclass hooks return. A difference raises on every rank,
naming it, where FSDP2 would hang or exchange mismatched data. The comparison goes
through the store, not a collective, so torch's tools count exactly FSDP2's.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from .. import _tool_compat
from .._agree import StoreExchange
from .._runtime import UnitInfo

__all__ = ["check_same_inputs", "check_same_structure"]

_DEFAULT_TIMEOUT_S = 600.0


def _compared(group: dist.ProcessGroup | None) -> bool:
    """Whether ranks of ``group`` are compared: several of them, on a real backend."""
    return group is not None and group.size() > 1 and _tool_compat.backend_name(group) != "fake"


def check_same_structure(units: Sequence[UnitInfo]) -> None:
    """Raises on every rank if the ranks of a data-parallel group built different
    models (which would otherwise hang or exchange mismatched data at the first
    all-gather)."""
    if not units or not dist.is_initialized():
        return
    groups: dict[tuple[int, ...], list[UnitInfo]] = {}
    for u in units:
        for group, ranks in (
            (u.shard_group, u.shard_ranks),
            (u.replicate_group, u.replicate_ranks),
        ):
            if _compared(group):
                groups.setdefault(ranks, []).append(u)
    for ranks, members in groups.items():
        description = repr([_unit_description(u) for u in members])
        group = members[0].shard_group
        differ = _compare("structure", ranks, description, group, _first_difference)
        if differ is not None:
            raise RuntimeError(
                "fsdp_compose: the ranks of a data-parallel group built different models: "
                f"{differ}. Every rank must build the same model and call fully_shard with the "
                "same arguments."
            )


def check_same_inputs(info: UnitInfo) -> None:
    """At an extension unit's pack (``info.all_gather_inputs``): raises on every rank of
    its shard group if the ranks' all-gather inputs (sizes and dtypes per parameter)
    differ, before the collective that would hang or mix mismatched data."""
    group, inputs = info.shard_group, info.all_gather_inputs
    if inputs is None or not _compared(group):
        return
    layout = [(i.fqn, list(i.sizes), [str(d) for d in i.dtypes]) for i in inputs]
    ranks = info.shard_ranks
    differ = _compare("all_gather_inputs", ranks, repr(layout), group, _input_difference)
    if differ is not None:
        raise RuntimeError(
            "fsdp_compose: the ranks of a data-parallel group would all-gather different "
            f"tensors: {differ}. A subclass's fsdp_pre_all_gather must return the same sizes "
            "and dtypes on every rank (the padded shard's size where sharded unevenly)."
        )


def _unit_description(u: UnitInfo) -> tuple[Any, ...]:
    """What must be equal across the ranks of a unit's groups (sizes, dtypes and
    the settings that change its collectives)."""
    options = u.options
    params = [(p.fqn, p.shape, str(p.dtype), p.requires_grad) for p in u.params]
    settings = (
        str(options.param_dtype),
        str(options.reduce_dtype),
        str(options.reshard_after_forward),
        options.offload,
    )
    return (u.name, params, settings)


def _compare(
    what: str,
    ranks: tuple[int, ...],
    description: str,
    group: dist.ProcessGroup,
    explain: Callable[[str, str], str],
) -> str | None:
    """Exchanges ``description`` among ``ranks`` through the job's store (the
    runtime's store exchange: no collective, so torch's tools count exactly
    FSDP2's). None if every rank's is the same, else (on every rank) which ranks
    differ from the first, and how."""
    timeout = _tool_compat.process_group_timeout(group) or _DEFAULT_TIMEOUT_S
    exchange = StoreExchange(what, ranks, timeout)
    if exchange.same(description):
        return None
    others = dict(zip(ranks, exchange.gather(description)))
    reference = others[ranks[0]]
    differ = [r for r in ranks if others[r] != reference]
    detail = explain(reference, others[differ[0]])
    me = dist.get_rank()
    return f"ranks {differ} differ from rank {ranks[0]} ({detail}; rank {me} is this one)"


def _first_difference(mine_text: str, theirs_text: str) -> str:
    """Where two descriptions by :func:`_unit_description` (reprs of literals) differ."""
    mine, theirs = ast.literal_eval(mine_text), ast.literal_eval(theirs_text)
    if len(mine) != len(theirs):
        return f"{len(mine)} units vs {len(theirs)}"
    for (name_a, params_a, settings_a), (name_b, params_b, settings_b) in zip(mine, theirs):
        if name_a != name_b:
            return f"unit {name_a!r} vs {name_b!r}"
        if settings_a != settings_b:
            return (
                f"unit {name_a!r}: settings (param_dtype, reduce_dtype, reshard_after_forward, "
                f"offload) {settings_a} vs {settings_b}"
            )
        if len(params_a) != len(params_b):
            return f"unit {name_a!r} has {len(params_a)} parameters vs {len(params_b)}"
        for a, b in zip(params_a, params_b):
            if a != b:
                return f"parameter {a[0]!r}: shape {a[1]} {a[2]} vs {b[0]!r} shape {b[1]} {b[2]}"
    return "no difference found in the descriptions"


def _input_difference(mine: str, other: str) -> str:
    a, b = ast.literal_eval(mine), ast.literal_eval(other)
    for (name, sizes, dtypes), (_, other_sizes, other_dtypes) in zip(a, b):
        if (sizes, dtypes) != (other_sizes, other_dtypes):
            return (
                f"parameter {name!r}: fsdp_pre_all_gather returned sizes {sizes} and dtypes "
                f"{dtypes} on one rank but sizes {other_sizes} and dtypes {other_dtypes} on another"
            )
    return "the all-gather inputs differ"
