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
        kind: ``"pooled"`` (default): private mappings outside glibc's heap,
            reused through a pool (a freed buffer's resident pages serve the
            next request of its size, up to 32 MiB; unmapped by
            :func:`release_host_buffers`), which the estimate follows within
            10%; ``"heap"``: ``torch.empty``, glibc's heap, where small
            objects carved out of freed buffers make the resident peak grow and
            depend on timing (measured peaks up to 1.54x the estimate at W >= 2:
            the estimate is then a lower bound);
            ``"mapped"``: a fresh mapping per buffer, unmapped when freed (the
            kernel zeroes every page again: 6.5% of the small benchmark preset's
            step at W=2). ``estimate`` models each (see [Note: per-step
            host buffers outside the heap]); ``FSDP_COMPOSE_HOST_BUFFERS`` sets it
            at import.
    """
    if kind not in _host_memory.MODES:
        raise ValueError(
            f"set_host_buffers: kind must be one of {_host_memory.MODES}, got {kind!r}"
        )
    _host_memory.set_mode(kind)


def release_host_buffers() -> int:
    """Unmaps the per-step CPU buffers the pool keeps for reuse (like
    ``torch.cuda.empty_cache()`` for the CUDA caching allocator): after training,
    or before a phase that needs the memory. The next step maps them again.

    Returns:
        The bytes released.
    """
    released = _host_memory.POOL.cached_bytes()
    _host_memory.POOL.release()
    return released


set_host_buffers(_env.choice("FSDP_COMPOSE_HOST_BUFFERS", _host_memory.MODES, "pooled"))

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
    "release_host_buffers",
    "resolve_plan",
    "set_host_buffers",
]
