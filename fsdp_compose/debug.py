"""Debug mode: find ranks that issue different collectives instead of hanging.

The most expensive distributed failure is a hang: one rank takes a different
branch (a conditional module, an uneven number of batches), issues a different
all-gather, and every rank waits forever -- or, worse, two units of the same size
silently exchange each other's data. In debug mode every collective fsdp_compose
issues for the model (the tools' too: a Muon exchange, a safetensors export, named
by their operation, e.g. ``all_to_all for muon.exchange``) first publishes a
fingerprint (unit, kind, sizes, dtype, step) through the process group's key-value
store and compares it with the fingerprints of the other ranks of its group
*before* the payload moves. On a mismatch every rank raises
(as long as the store outlives the ranks, as under torchrun; a store hosted by
rank 0, ``init_method="tcp://..."``, disappears when rank 0 exits after raising,
and a rank still reading it then fails with ``DistNetworkError`` instead)::

    RuntimeError: fsdp_compose collective mismatch on group [0, 1] (collective #17):
      rank 0 issued all_gather for blocks.2 (4160 x float32, step 3)
      rank 1 issued all_gather for blocks.1 (4160 x float32, step 3)

and a rank that stops issuing collectives makes the others raise after
``timeout`` seconds, naming the ranks they waited for. A reduce-scatter's
fingerprint also lists the unit's parameters that got no gradient on the rank
(the reduce-scatter leaves them out, as FSDP2's does), so ranks that disagree on
them (an MoE expert that got tokens on some ranks only) raise, naming the
parameters, even where the sizes happen to match.

It works the same on every backend (gloo, NCCL, ...): the fingerprints go
through the store, never through the collectives, so the collectives issued are
exactly those of a run without it.

Turn it on for every model with the environment variable
``FSDP_COMPOSE_DEBUG_COLLECTIVES=1`` (``FSDP_COMPOSE_DEBUG_TIMEOUT`` sets the
timeout; by default it is the process group's own timeout, so debug mode never
waits longer than the collective itself would), or for one model in code::

    from fsdp_compose import debug
    with debug.collective_checks(model, timeout=30.0):
        train_step()

:func:`check_optimizer` is the other debug aid: warnings at ``optimizer.step()``
for an optimizer built before ``fully_shard``, a forgotten root annotation, or
gradient synchronization left off (see [Note: optimizer checks are opt-in warnings]).

Cost: each collective waits for a store round trip with every rank of its group,
and the wait makes communication synchronous with
the training thread, so overlap is lost. Use it to diagnose, not to train.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _env, _tool_compat
from ._agree import CollectiveMismatchError, RanksMissing, StoreExchange, raise_unless_same
from ._optim_checks import check_optimizer
from ._runtime import CollectiveEvent, CollectiveInfo, FSDPModule, Observer, UnitEvent, UnitInfo

__all__ = [
    "CollectiveChecks",
    "CollectiveMismatchError",
    "check_optimizer",
    "collective_checks",
]

_FALLBACK_TIMEOUT_S = 60.0  # where torch does not expose a group's timeout


class CollectiveChecks(Observer):
    """Cross-checks every collective of the roots it observes across the ranks of
    its group before it is issued (see the module's docstring).

    Args:
        timeout (Optional[float]): seconds to wait for the other ranks' fingerprints
            before raising :class:`CollectiveMismatchError`. Defaults to
            ``FSDP_COMPOSE_DEBUG_TIMEOUT`` if set, else the timeout of the process
            group the collective runs on.
    """

    unit_events = frozenset({"backward_end"})

    def __init__(self, timeout: float | None = None) -> None:
        self.timeout = _env.debug_timeout() if timeout is None else timeout
        # (rank, unit name) -> its parameters without a gradient. By rank too: one
        # object may observe every rank-thread of a threaded process group.
        self._no_grad: dict[tuple[int, str], list[str]] = {}

    def on_unit(self, event: UnitEvent, info: UnitInfo) -> None:
        # Recorded when the unit's backward is done, just before its reduction
        # takes the gradients (see the module's docstring).
        if event == "backward_end" and not info.options.reduce_scatter_unused_params:
            self._no_grad[(dist.get_rank(), info.name)] = list(info.without_grad or ())

    def on_collective(self, event: CollectiveEvent, info: CollectiveInfo) -> None:
        if event == "issue":
            key = (dist.get_rank(), info.label)
            no_grad = self._no_grad.pop(key, None) if info.kind == "reduce_scatter" else None
            detail = f", no gradient here: {no_grad}" if no_grad else ""
            numel = info.agreed_numel  # a tool's all-to-all: its total over the ranks
            self._check(info.kind, info.label, info.group, numel, info.dtype, info.step, detail)

    def _check(
        self,
        kind: str,
        label: str,
        group: dist.ProcessGroup,
        numel: int,
        dtype: torch.dtype,
        step: int,
        detail: str = "",
    ) -> None:
        ranks = tuple(dist.get_process_group_ranks(group))
        timeout = self.timeout
        if timeout is None:
            timeout = _tool_compat.process_group_timeout(group) or _FALLBACK_TIMEOUT_S
        # Numbered per group of ranks across every root of the rank (the runtime's
        # store exchange): the keys of two roots on one group never collide.
        exchange = StoreExchange("fingerprint", ranks, timeout)
        dtype_name = str(dtype).replace("torch.", "")
        mine = f"{kind} for {label} ({numel} x {dtype_name}, step {step}{detail})"
        me = dist.get_rank()
        try:
            raise_unless_same(
                mine,
                exchange,
                lambda seen: _mismatch(list(ranks), exchange.round, seen),
                error_type=CollectiveMismatchError,
            )
        except RanksMissing as exc:
            seq = exchange.round
            raise CollectiveMismatchError(
                f"fsdp_compose: rank {me} issued {mine} as collective #{seq} on group "
                f"{list(ranks)}, but ranks {exc.missing} issued no collective #{seq} within "
                f"{timeout:.0f}s. They may have stopped early (an uneven number of "
                "batches), crashed, taken a branch without this unit, or be blocked elsewhere."
            ) from exc


def _mismatch(ranks: list[int], seq: int, seen: list[str]) -> str:
    """The error naming what each rank of ``ranks`` issued as collective ``seq``."""
    lines = "\n".join(f"  rank {r} issued {v}" for r, v in zip(ranks, seen))
    hint = (
        "Parameters of one unit have gradients on some ranks only (e.g. an MoE expert "
        "that got no tokens on some ranks): call set_reduce_scatter_unused_params(True) "
        "on the model, so that every rank reduces them (zeros where unused)."
        if any("no gradient here" in v for v in seen)
        else "The ranks ran different units or a different number of steps (e.g. a "
        "data-dependent branch taken on some ranks only). Every rank must run the same "
        "fully_shard units in the same order."
    )
    return (
        f"fsdp_compose collective mismatch on group {ranks} (collective #{seq}):\n{lines}\n{hint}"
    )


@contextlib.contextmanager
def collective_checks(
    *modules: nn.Module, timeout: float | None = None
) -> Iterator[CollectiveChecks]:
    """Cross-checks every collective of ``modules`` (root ``FSDPModule``s) across
    ranks inside a ``with`` block; yields the :class:`CollectiveChecks` observer."""
    if not modules:
        raise TypeError("debug.collective_checks() needs the model: collective_checks(model)")
    checks = CollectiveChecks(timeout)
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise TypeError(
                f"collective_checks() takes modules annotated with fully_shard, got "
                f"{type(module).__name__}"
            )
        cast(FSDPModule, module).register_observer(checks)
    try:
        yield checks
    finally:
        for module in modules:
            cast(FSDPModule, module).unregister_observer(checks)
