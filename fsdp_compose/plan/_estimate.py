"""Per-rank memory and communication of a training step, predicted without ranks.

:func:`estimate` profiles the model once on the meta device (``_profile.py``),
then walks one training step unit by unit, the way fsdp_compose's scheduler runs
it, and keeps the largest total it sees.

[Note: the memory model]
Per rank (the worst rank: rank 0 holds ``ceil(rows / W)`` rows of every
parameter), with ``W`` the shard group size:

* **params, grads, optimizer_state** (resident all step): the padded shards in
  the parameters' own dtype; gradients for trainable parameters; AdamW keeps two
  states per element, SGD with momentum and Muon one (Muon's non-matrix
  parameters use AdamW), plain SGD none. Gradients are counted all step, as if
  ``zero_grad(set_to_none=False)``: that is also the state during gradient
  accumulation and at the optimizer step.
* **unsharded**: each unit's all-gather buffer, ``W * row`` elements in the
  compute dtype (``MixedPrecisionPolicy.param_dtype``), from its gather (or
  prefetch ``prefetch_depth`` units ahead) until it is resharded: after forward
  for ``reshard_after_forward=True``, to ``1/k`` of it for an int ``k``, never for
  ``False`` (the root's default); after its backward in any case. A unit's
  unsharded gradients (compute dtype) live from its backward until they are
  packed for the reduce-scatter. At ``W = 1`` without casts or offload the
  unsharded parameters alias the shards and cost nothing.
* **activations**: every storage the step allocates on the meta device
  (activations, temporaries, the loss and its gradient), at the moment it is
  allocated and freed: the profile's allocation trace, replayed with the
  buffers above ([Note: replaying the trace]). With activation checkpointing a
  unit keeps only its output after forward and recomputes the rest when its
  backward starts.
* **comm_buffers**: the reduce-scatter input (``W * row``) and output (``row``)
  in the reduce dtype; fsdp_compose completes one unit's reduce-scatter before
  packing the next, so at most one is alive besides the one being packed.

* **Muon's owner step**: with ``optimizer="muon"`` the optimizer step is a
  candidate peak of its own: the full matrices an owner rank holds at once and
  the Newton–Schulz temporaries (:func:`_muon_owner_bytes`), counted under
  ``unsharded`` when it is the peak.

The estimate is of allocated tensor bytes (``torch.cuda.max_memory_allocated``
on a GPU, torch's ``MemTracker`` on any device). Not modelled: allocator excess
(CUDA caching fragmentation, glibc's resident heap: the planner's headroom),
kernel workspaces, CUDA context, optimizer temporaries.

Communication is the ideal per-rank byte count (see ``benchmarks/probes.py``):
an all-gather sends ``(W-1)/W`` of its output, a reduce-scatter ``(W-1)/W`` of its
input, an all-reduce (HSDP replicas, ``R``) ``2 (R-1)/R`` of the tensor.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .._runtime import MixedPrecisionPolicy, OffloadPolicy, validate_reshard_after_forward
from ._policy import ShardingPlan, UnitPlan, WrapPolicy, resolve_plan
from ._profile import ROOT, ModelProfile, ModuleProfile, StepFn, default_step, profile_model
from ._replay import simulate
from ._units import format_bytes, parse_bytes

logger = logging.getLogger("fsdp_compose")

__all__ = ["MemoryEstimate", "estimate", "format_bytes", "parse_bytes"]

BREAKDOWN_KEYS = (
    "params",
    "grads",
    "optimizer_state",
    "unsharded",
    "activations",
    "comm_buffers",
)
OPTIMIZERS = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1, "muon": 1}


@dataclass(frozen=True)
class UnitEstimate:
    """Per-rank figures of one unit (bytes)."""

    name: str
    numel: int
    sharded_bytes: int
    unsharded_bytes: int
    reshard_after_forward: bool | int
    checkpoint: bool
    activation_bytes: int
    flops: float
    all_gather_bytes: int  # sent per step (forward + backward re-gather)
    backward_gather_bytes: int  # of which the backward re-gather
    reduce_bytes: int  # sent per step (reduce-scatter + HSDP all-reduce)
    grad_bytes: int = 0  # sharded gradients (own dtype)
    optimizer_bytes: int = 0  # its parameters' optimizer states
    offload: bool = False  # its sharded state lives in host memory
    grad_numel: int = 0  # padded trainable elements per rank (N / W)
    grad_reduce_bytes: int = 0  # the same in the reduce dtype (N / W * r)


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted per-rank peak memory of one training step, and its communication.

    Attributes:
        peak_bytes_per_rank: the largest memory the step holds on one rank.
        breakdown: the terms of that peak (``params``, ``grads``,
            ``optimizer_state``, ``unsharded``, ``activations``, ``comm_buffers``).
        peak_at: where in the step the peak occurs.
        comm_bytes_per_rank_per_step: bytes one rank sends per step (ideal).
        host_bytes_per_rank: offloaded state held in host memory (``device="cuda"``
            with ``CPUOffloadPolicy``), not part of the peak.
        units: per-unit figures, in forward order (the root first).
        config: the inputs of the estimate.
    """

    peak_bytes_per_rank: int
    breakdown: dict[str, int]
    peak_at: str
    comm_bytes_per_rank_per_step: int
    host_bytes_per_rank: int
    units: tuple[UnitEstimate, ...]
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (what ``--json`` prints)."""
        return {
            "peak_bytes_per_rank": self.peak_bytes_per_rank,
            "breakdown": dict(self.breakdown),
            "peak_at": self.peak_at,
            "comm_bytes_per_rank_per_step": self.comm_bytes_per_rank_per_step,
            "host_bytes_per_rank": self.host_bytes_per_rank,
            "config": self.config,
            "units": [u.__dict__ for u in self.units],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def table(self) -> str:
        """The breakdown as a small text table."""
        rows = [(k, format_bytes(v)) for k, v in self.breakdown.items()]
        rows.append(("peak per rank", format_bytes(self.peak_bytes_per_rank)))
        rows.append(("  (at)", self.peak_at))
        if self.host_bytes_per_rank:
            rows.append(("host (offloaded)", format_bytes(self.host_bytes_per_rank)))
        rows.append(("sent per rank per step", format_bytes(self.comm_bytes_per_rank_per_step)))
        width = max(len(r[0]) for r in rows)
        return "\n".join(f"{k:<{width}}  {v:>12}" for k, v in rows)


@dataclass
class _Unit:
    """Simulation view of one unit at a given world size."""

    name: str
    profile: ModuleProfile
    reshard: bool | int
    checkpoint: bool
    fqns: list[str] = field(default_factory=list)  # the modules it is made of
    offload: bool = False  # sharded state in host memory (with device="cuda")
    sharded: int = 0  # params, own dtype, padded
    grads: int = 0
    opt: int = 0
    unsharded: int = 0  # all-gather buffer, compute dtype
    rs_buffers: int = 0
    reduce_row: int = 0  # reduce-scatter output (reduce dtype); 0 when aliased
    numel: int = 0
    ag_send: int = 0
    ag_backward: int = 0
    reduce_send: int = 0
    grad_numel: int = 0  # padded trainable elements per rank
    grad_reduce_bytes: int = 0  # the same in the reduce dtype, never aliased

    def kept_after_forward(self) -> int:
        if self.reshard is True:
            return 0
        if self.reshard is False:
            return self.unsharded
        return self.unsharded // int(self.reshard)

    @property
    def saved(self) -> int:
        return self.profile.input_bytes if self.checkpoint else self.profile.saved_bytes


def _check_mesh(world_size: int | None, mesh_shape: Sequence[int] | None) -> tuple[int, int]:
    """(replicate, shard) sizes; raises on a mesh the world size cannot hold."""
    if mesh_shape is None:
        if world_size is None:
            raise ValueError("give world_size (or mesh_shape)")
        mesh_shape = (world_size,)
    shape = tuple(mesh_shape)
    if not 1 <= len(shape) <= 2 or not all(isinstance(s, int) and s > 0 for s in shape):
        raise ValueError(
            f"mesh_shape must be (shard,) or (replicate, shard) positive ints, got {mesh_shape!r}"
        )
    total = 1
    for s in shape:
        total *= s
    if world_size is not None:
        if not isinstance(world_size, int) or world_size <= 0:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if total != world_size:
            raise ValueError(
                f"mesh shape {shape} holds {total} ranks, not world size {world_size}; "
                f"the product of the mesh dimensions must equal the world size"
            )
    return (1, shape[0]) if len(shape) == 1 else (shape[0], shape[1])


def estimate(
    model: nn.Module,
    *,
    batch: int,
    seq: int,
    world_size: int | None = None,
    mesh_shape: Sequence[int] | None = None,
    policy: WrapPolicy = None,
    plan: ShardingPlan | None = None,
    reshard_after_forward: bool | int | None = None,
    prefetch_depth: int | None = None,
    activation_checkpointing: bool | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    optimizer: str = "adamw",
    device: str = "cuda",
    set_to_none: bool = False,
    step_fn: StepFn = default_step,
    profile: ModelProfile | None = None,
) -> MemoryEstimate:
    """Predicts per-rank peak memory and bytes sent per step, without launching ranks.

    The model is never materialized (build it under ``torch.device("meta")``) and
    never modified: one forward and backward run on the meta device with
    substituted parameters. See ``[Note: the memory model]`` for what is counted.

    Args:
        model: the unwrapped model, usually on the meta device.
        batch: micro-batch size per rank (sequences).
        seq: sequence length (tokens).
        world_size: number of ranks (``mesh_shape`` may be given instead).
        mesh_shape: ``(shard,)`` or, for HSDP, ``(replicate, shard)``.
        policy: the wrap policy (see :func:`~fsdp_compose.auto_wrap`); ignored
            when ``plan`` is given.
        plan: the units, with per-unit ``reshard_after_forward`` and checkpointing.
        reshard_after_forward, prefetch_depth, activation_checkpointing: override
            the plan's values for every non-root unit (``None``: keep them).
        mp_policy: the mixed-precision policy (compute, reduce dtypes).
        offload_policy: ``CPUOffloadPolicy()`` moves the shards, gradients and
            optimizer states to the host; with ``device="cuda"`` they leave the
            device peak and are reported as ``host_bytes_per_rank``. Units whose
            :class:`UnitPlan` has ``offload=True`` are offloaded in any case.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"``, ``"sgd_momentum"`` or
            ``"muon"``.
        device: ``"cuda"`` (default) or ``"cpu"``: where the training runs; it only
            matters with offload (on ``"cpu"`` the offloaded state stays in the peak).
        set_to_none: whether the training loop drops the gradients
            (``optimizer.zero_grad(set_to_none=True)``, torch's default) instead of
            keeping them between steps. Gradients are counted all step either way.
        step_fn: ``fn(model, batch, seq) -> loss`` for one step (default: token
            ids in, cross-entropy on the logits).
        profile: a profile from an earlier call with the same model, units,
            batch, sequence length and compute dtype (the planner reuses it).

    Returns:
        A :class:`MemoryEstimate`.

    Raises:
        ValueError: inconsistent mesh and world size, an unknown optimizer or
            device, a plan that does not match the model.
    """
    replicate, shard = _check_mesh(world_size, mesh_shape)
    for name, value in (("batch", batch), ("seq", seq)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZERS)}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if plan is None:
        plan = resolve_plan(model, policy)
    plan.validate_for(model)
    plan = _override(plan, reshard_after_forward, prefetch_depth, activation_checkpointing)
    unit_modules = [m for u in plan.units[:-1] for m in u.modules]
    if profile is None:
        profile = profile_model(
            model,
            unit_modules,
            batch=batch,
            seq=seq,
            compute_dtype=mp_policy.param_dtype,
            step_fn=step_fn,
        )
    # Training on the CPU, fsdp_compose ignores offloading (everything is on the CPU
    # already): the units behave as without it.
    on_gpu = device == "cuda"
    every = type(offload_policy).__name__ == "CPUOffloadPolicy" and on_gpu
    units = _build_units(plan, profile, shard, replicate, mp_policy, every, optimizer, on_gpu)
    resident = [u for u in units if not u.offload]
    per_unit_states = {
        "params": sum(u.sharded for u in resident),
        "grads": sum(u.grads for u in resident),
        "optimizer_state": sum(u.opt for u in resident),
    }
    host = sum(u.sharded + u.grads + u.opt for u in units if u.offload)
    offload = any(u.offload for u in units)
    peak, at, terms = simulate(units, profile, plan.prefetch_depth)
    owner = _muon_owner_bytes(units) if optimizer == "muon" else 0
    if owner > peak:
        peak, at = owner, "optimizer step (Muon owner)"
        terms = {"unsharded": owner, "activations": 0, "comm_buffers": 0}
    breakdown = {**per_unit_states, **terms}
    config = {
        "world_size": replicate * shard,
        "mesh_shape": [replicate, shard] if replicate > 1 else [shard],
        "batch": batch,
        "seq": seq,
        "param_dtype": None if mp_policy.param_dtype is None else str(mp_policy.param_dtype),
        "reduce_dtype": None if mp_policy.reduce_dtype is None else str(mp_policy.reduce_dtype),
        "offload": offload,
        "offloaded_units": [u.name for u in units if u.offload] if offload and not every else [],
        "optimizer": optimizer,
        "device": device,
        "prefetch_depth": plan.prefetch_depth,
        "units": len(plan.units),
    }
    return MemoryEstimate(
        peak_bytes_per_rank=sum(per_unit_states.values()) + peak,
        breakdown={k: breakdown[k] for k in BREAKDOWN_KEYS},
        peak_at=at,
        comm_bytes_per_rank_per_step=sum(u.ag_send + u.reduce_send for u in units),
        host_bytes_per_rank=host,
        units=tuple(map(_unit_estimate, units)),
        config=config,
    )


def _unit_estimate(u: _Unit) -> UnitEstimate:
    return UnitEstimate(
        u.name,
        u.numel,
        u.sharded,
        u.unsharded,
        u.reshard,
        u.checkpoint,
        u.saved,
        u.profile.flops,
        u.ag_send,
        u.ag_backward,
        u.reduce_send,
        u.grads,
        u.opt,
        u.offload,
        u.grad_numel,
        u.grad_reduce_bytes,
    )


def _override(
    plan: ShardingPlan, reshard: bool | int | None, depth: int | None, checkpoint: bool | None
) -> ShardingPlan:
    if reshard is None and depth is None and checkpoint is None:
        return plan
    units = [
        UnitPlan(
            u.modules,
            u.reshard_after_forward if reshard is None or u.modules == (ROOT,) else reshard,
            u.checkpoint if checkpoint is None or u.modules == (ROOT,) else checkpoint,
            u.offload,
        )
        for u in plan.units
    ]
    return ShardingPlan(tuple(units), plan.prefetch_depth if depth is None else depth, plan.skipped)


def _build_units(
    plan: ShardingPlan,
    profile: ModelProfile,
    shard: int,
    replicate: int,
    mp: MixedPrecisionPolicy,
    offload: bool,
    optimizer: str,
    on_gpu: bool,
) -> list[_Unit]:
    """Units in forward order (root first), with their per-rank sizes; offloaded:
    every unit with ``offload``, those the plan offloads on a GPU."""
    by_module: dict[str, UnitPlan] = {m: u for u in plan.units for m in u.modules}
    order = [ROOT, *[m for m in profile.forward_order if m in by_module]]
    # Units that never ran forward still hold state (and gather nothing).
    order += [m for m in by_module if m not in order]
    seen_units: dict[UnitPlan, _Unit] = {}
    out: list[_Unit] = []
    frac = (shard - 1) / shard
    for fqn in order:
        up = by_module[fqn]
        if up in seen_units:
            _merge(seen_units[up], profile.modules[fqn])
            seen_units[up].fqns.append(fqn)
            continue
        reshard: bool | int = (
            up.reshard_after_forward if up.reshard_after_forward is not None else fqn != ROOT
        )
        # fsdp_compose's own normalisation: 1 -> False, the shard size -> True,
        # an int that does not divide the shard group is an error.
        reshard = validate_reshard_after_forward(reshard, shard)
        unit = _Unit(up.name, ModuleProfile(fqn), reshard, up.checkpoint, [fqn])
        unit.offload = offload or (up.offload and on_gpu)
        _merge(unit, profile.modules[fqn])
        seen_units[up] = unit
        out.append(unit)
    for u in out:
        _size(u, shard, replicate, mp, u.offload, optimizer, frac)
    return out


def _merge(unit: _Unit, prof: ModuleProfile) -> None:
    p = unit.profile
    p.params.extend(prof.params)
    p.saved_bytes += prof.saved_bytes
    p.input_bytes += prof.input_bytes
    p.flops += prof.flops


def _size(
    u: _Unit,
    shard: int,
    replicate: int,
    mp: MixedPrecisionPolicy,
    offload: bool,
    optimizer: str,
    frac: float,
) -> None:
    per_state = OPTIMIZERS[optimizer]
    row_bytes = 0  # compute dtype
    reduce_row = 0
    alias = shard == 1 and not offload
    for p in u.profile.params:
        n = p.shard_numel(shard)
        u.numel += p.numel
        u.sharded += n * p.dtype.itemsize
        compute = (
            mp.param_dtype if mp.param_dtype is not None and p.dtype.is_floating_point else p.dtype
        )
        if compute != p.dtype:
            alias = False
        row_bytes += n * compute.itemsize
        if p.trainable:
            u.grads += n * p.dtype.itemsize
            states = per_state
            if optimizer == "muon" and len(p.shape) != 2:
                states = OPTIMIZERS["adamw"]  # Muon is for matrices; the rest use AdamW
            u.opt += states * n * p.dtype.itemsize
            reduce = mp.reduce_dtype or compute
            reduce_row += n * reduce.itemsize
            u.grad_numel += n
    u.grad_reduce_bytes = reduce_row
    if alias:
        u.unsharded = 0
        u.rs_buffers = 0
    else:
        u.unsharded = shard * row_bytes
        u.rs_buffers = shard * reduce_row + (reduce_row if shard > 1 else 0)
        u.reduce_row = reduce_row
    if shard > 1:
        if isinstance(u.reshard, bool):
            regather = 1.0 if u.reshard else 0.0
        else:  # within the post-forward group of k ranks
            k = u.reshard
            regather = (k - 1) / k * shard / (shard - 1)
        u.ag_backward = round(frac * u.unsharded * regather)
        u.ag_send = round(frac * u.unsharded) + u.ag_backward
        u.reduce_send = round(frac * shard * reduce_row)
    if replicate > 1:
        u.reduce_send += round(2 * (replicate - 1) / replicate * reduce_row)


def _muon_owner_bytes(units: list[_Unit]) -> int:
    """What a Muon owner rank holds at once in the optimizer step (bfloat16).

    See [Note: owner compute for whole-matrix optimizers]
    (``fsdp_compose/whole_matrix/_exchange.py``): the exchange's nine buffers
    of at most ``R`` elements each, ``R`` being ``ROUND_NUMEL`` or one larger
    matrix, plus the round being computed (``<= R``); plus the Newton–Schulz
    temporaries of the largest matrix (``m <= n`` its sides): the Gram matrix
    ``X Xᵀ``, its square and ``b A + c A²`` (``m²`` each) and the product
    ``B X`` and next iterate (``m n`` each). Taken for the largest
    matrix on every rank: an upper bound for the rank that owns it.
    """
    from ..whole_matrix._exchange import ROUND_NUMEL

    largest: tuple[int, ...] = (0, 0)
    for u in units:
        for p in u.profile.params:
            if p.trainable and len(p.shape) == 2 and p.numel > largest[0] * largest[1]:
                largest = p.shape
    m, n = sorted(largest) if largest != (0, 0) else (0, 0)
    round_numel = max(ROUND_NUMEL, m * n) if m else 0
    bf16 = 2
    return bf16 * (10 * round_numel + 3 * m * m + 2 * m * n)
