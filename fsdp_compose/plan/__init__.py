"""Know the memory before launch: auto-wrap, estimate, plan.

* :func:`auto_wrap` annotates a whole model from a policy or a plan.
* :func:`estimate` predicts per-rank peak memory (with a breakdown) and the
  bytes each rank sends per step, for a model on the meta device, at any world
  size, without launching ranks.
* :func:`plan_to_budget` chooses unit boundaries, ``reshard_after_forward`` per
  unit, prefetch depth and activation checkpointing to fit a memory budget (with
  ``offload_by_budget=True``, also which units to offload to the host).
* ``python -m fsdp_compose.plan CONFIG --world-size N --batch B --seq S`` does
  the last two from a Hugging Face ``config.json``.

This subpackage uses the core through its public API; the core never imports it.
"""

from ._autowrap import auto_wrap
from ._cost import CostModel, StepCost
from ._estimate import MemoryEstimate, estimate
from ._planner import plan_to_budget
from ._policy import ShardingPlan, UnitPlan, WrapPolicy, resolve_plan
from ._result import PlanResult
from ._units import format_bytes, parse_bytes

__all__ = [
    "CostModel",
    "MemoryEstimate",
    "PlanResult",
    "ShardingPlan",
    "StepCost",
    "UnitPlan",
    "WrapPolicy",
    "auto_wrap",
    "estimate",
    "format_bytes",
    "parse_bytes",
    "plan_to_budget",
    "resolve_plan",
]
