"""The public ``fully_shard``: the runtime's annotator with fsdp_compose's checks.

It is FSDP2's ``fully_shard`` (``fsdp_compose._runtime``, where its one signature,
its typing overloads and its documentation are) with fsdp_compose's checks subscribed to
every call before the caller's observers, :func:`fsdp_compose._checks.observers` (see [Note:
checks beyond FSDP2]), and torch's own policy objects accepted in place of
fsdp_compose's, so that an FSDP2 program runs with only its ``fully_shard`` import
changed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields
from typing import Any, TypeVar, cast

import torch
from torch.distributed import fsdp as torch_fsdp

from . import _checks
from ._runtime import CPUOffloadPolicy, MixedPrecisionPolicy, Observer, OffloadPolicy
from ._runtime import fully_shard as _runtime_fully_shard

__all__ = ["fully_shard"]

_F = TypeVar("_F", bound=Callable[..., Any])


def _with_checks(fn: _F) -> _F:
    """``fn`` (the runtime's ``fully_shard``) with the checks subscribed before the
    caller's ``observers`` and torch's policies converted. ``functools.wraps`` keeps
    ``fn``'s documentation and signature (``help()`` and ``inspect.signature`` show
    them) and the return type keeps its overloads: they are written once, in ``fn``."""

    @functools.wraps(fn)
    def checked(*args: Any, observers: Iterable[Observer] = (), **kwargs: Any) -> Any:
        mp_policy, offload_policy = kwargs.get("mp_policy"), kwargs.get("offload_policy")
        if mp_policy is not None:
            kwargs["mp_policy"] = _adopt_torch_mp_policy(mp_policy)
        if offload_policy is not None:
            kwargs["offload_policy"] = _adopt_torch_offload_policy(offload_policy)
        return fn(*args, observers=(*_checks.observers(), *observers), **kwargs)

    return cast(_F, checked)


def _adopt_torch_mp_policy(mp_policy: object) -> object:
    """fsdp_compose's equivalent of a ``torch.distributed.fsdp.MixedPrecisionPolicy``
    (so an FSDP2 program runs with only ``fully_shard``'s import changed); other
    values are returned as they are."""
    if isinstance(mp_policy, torch_fsdp.MixedPrecisionPolicy):
        values = {f.name: getattr(mp_policy, f.name) for f in fields(mp_policy)}
        unknown = sorted(set(values) - {f.name for f in fields(MixedPrecisionPolicy)})
        if unknown:
            raise NotImplementedError(
                f"torch {torch.__version__}'s MixedPrecisionPolicy has fields {unknown} that "
                "this fsdp_compose does not know; use fsdp_compose.MixedPrecisionPolicy"
            )
        return MixedPrecisionPolicy(**values)
    return mp_policy


def _adopt_torch_offload_policy(offload_policy: object) -> object:
    """As :func:`_adopt_torch_mp_policy`, for torch's offload policies (also as the
    values of a per-parameter mapping)."""
    if isinstance(offload_policy, Mapping):
        return {fqn: _adopt_torch_offload_policy(p) for fqn, p in offload_policy.items()}
    if isinstance(offload_policy, torch_fsdp.CPUOffloadPolicy):
        return CPUOffloadPolicy(pin_memory=offload_policy.pin_memory)
    if type(offload_policy) is torch_fsdp.OffloadPolicy:
        return OffloadPolicy()
    return offload_policy


fully_shard = _with_checks(_runtime_fully_shard)
