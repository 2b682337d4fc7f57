"""``cpu_offload_by_budget``: which parameters to offload, largest first, up to a budget.

It only chooses: the mapping it returns is ``fully_shard``'s per-parameter
``offload_policy`` ([Note: per-parameter offload] in the runtime's annotator).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn

from ._runtime import CPUOffloadPolicy, OffloadPolicy

__all__ = ["cpu_offload_by_budget"]


def cpu_offload_by_budget(
    module: nn.Module, budget_bytes: int, *, pin_memory: bool = True
) -> dict[str, OffloadPolicy]:
    """Chooses parameters of ``module`` to keep in host memory, largest first, within
    ``budget_bytes``; torch's draft API for FSDP2, with its semantics.

    Parameters are taken in decreasing size (unsharded bytes, ``numel *
    element_size``; ties in FQN order) while their total stays within
    ``budget_bytes``; the first one that would exceed it ends the selection (so
    the selection never exceeds the budget and grows with it). ``0`` offloads
    nothing; a budget of at least every parameter's size offloads them all, like
    :class:`CPUOffloadPolicy` for the whole call. Tied parameters count once,
    under their first name.

    The result maps each chosen parameter's FQN (relative to ``module``) to
    ``CPUOffloadPolicy(pin_memory=pin_memory)``: pass it as ``fully_shard(module,
    offload_policy=...)``. Parameters it leaves out stay on the device. When blocks
    are sharded by their own ``fully_shard`` calls first, pass each call the
    entries under its module, with the module's prefix removed (the FQNs are
    relative to the module ``fully_shard`` is given).

    The budget bounds the bytes moved to the host, not the device memory left: to
    fit a device budget, ``fsdp_compose.plan.plan_to_budget(...,
    offload_by_budget=True)`` chooses whole units to offload with the rest of the
    plan.

    Args:
        module (nn.Module): the module whose parameters are chosen from (usually
            before ``fully_shard``, e.g. on the meta device).
        budget_bytes (int): the most parameter bytes to offload.
        pin_memory (bool): the chosen policies' ``pin_memory``. (Default: ``True``)

    Returns:
        Dict[str, OffloadPolicy]: the chosen parameters' FQNs and their policy.

    Raises:
        ValueError: ``budget_bytes`` is negative.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise TypeError(f"budget_bytes must be an int (bytes), got {budget_bytes!r}")
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be non-negative, but got {budget_bytes}")
    sizes = [(fqn, p.numel() * p.element_size()) for fqn, p in module.named_parameters()]
    policy = CPUOffloadPolicy(pin_memory=pin_memory)
    return {fqn: policy for fqn in _select_largest_first(sizes, budget_bytes)}


def _select_largest_first(items: Sequence[tuple[str, int]], budget_bytes: int) -> list[str]:
    """The names of ``items`` (``(fqn, nbytes)`` pairs) chosen largest first within
    ``budget_bytes``, in the order chosen.

    Ties break on the name, so the input order never matters. The selection is a
    prefix of that order: it stops at the first item that does not fit rather than
    skipping it for smaller ones, so a larger budget always chooses a superset (a
    smaller item taken past a skipped one would be dropped again when the budget
    grows enough for the skipped one). The semantics of torch main's helper of the
    same name, whose tests run against this one through
    ``tools/run_torch_fsdp_tests.py --swap``.
    """
    chosen: list[str] = []
    used = 0
    for fqn, nbytes in sorted(items, key=lambda item: (-item[1], item[0])):
        if used + nbytes > budget_bytes:
            break
        chosen.append(fqn)
        used += nbytes
    return chosen
