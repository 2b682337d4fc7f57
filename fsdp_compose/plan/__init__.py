"""Know the memory before launch: auto-wrap, estimate, plan.

* :func:`auto_wrap` annotates a whole model from a policy or a plan.
* :func:`estimate` predicts per-rank peak memory (with a breakdown) and the
  bytes each rank sends per step, for a model on the meta device, at any world
  size, without launching ranks.
* :func:`plan_to_budget` chooses unit boundaries, ``reshard_after_forward`` per
  unit, prefetch depth and activation checkpointing to fit a memory budget.
* ``python -m fsdp_compose.plan CONFIG --world-size N --batch B --seq S`` does
  the last two from a Hugging Face ``config.json``.

This subpackage uses the core through its public API; the core never imports it.
"""

from .. import _env, _host_memory
from ._autowrap import auto_wrap
from ._estimate import MemoryEstimate, estimate, format_bytes, parse_bytes
from ._planner import CostModel, PlanResult, plan_to_budget
from ._policy import ShardingPlan, UnitPlan, WrapPolicy, resolve_plan


def set_host_buffers(kind: str) -> None:
    """Where fsdp_compose allocates its large per-step CPU buffers (all-gather
    outputs, unsharded parameters, reduce-scatter buffers) from now on.

    Args:
        kind: ``"heap"`` (default): ``torch.empty``, glibc's heap, where a freed
            buffer can stay resident and the resident peak depends on timing;
            ``"mapped"``: a private mapping per buffer, unmapped when freed, which
            makes the resident peak predictable (``estimate`` models it, see
            [Note: per-step host buffers outside the heap]) at the cost of page
            faults (6.5% of the small benchmark preset's step at W=2).
            ``FSDP_COMPOSE_HOST_BUFFERS`` sets it at import.
    """
    if kind not in ("heap", "mapped"):
        raise ValueError(f"set_host_buffers: kind must be 'heap' or 'mapped', got {kind!r}")
    _host_memory.set_enabled(kind == "mapped")


set_host_buffers(_env.choice("FSDP_COMPOSE_HOST_BUFFERS", ("heap", "mapped"), "heap"))

__all__ = [
    "CostModel",
    "MemoryEstimate",
    "PlanResult",
    "ShardingPlan",
    "UnitPlan",
    "WrapPolicy",
    "auto_wrap",
    "estimate",
    "format_bytes",
    "parse_bytes",
    "plan_to_budget",
    "resolve_plan",
    "set_host_buffers",
]
