"""``torch.optim.Muon`` on parameters sharded by ``fully_shard``: the single-device result.

[Note: sharded Muon]
Muon's update for a matrix parameter is, per step: the momentum buffer
``B ← lerp(B, G, 1-μ)`` and the update ``U = lerp(G, B, μ)`` (Nesterov) or ``B``;
``O = NS(U)``, a Newton–Schulz orthogonalization of the *whole* matrix in
bfloat16; then ``θ ← θ·(1 - γλ)`` and ``θ ← θ - γ'·O`` with ``γ'`` adjusted from
the full shape. Everything except ``NS`` is elementwise, so it runs on the local
rows, with the same ops as torch, which makes it bit-identical position by
position. ``NS`` runs once per matrix on its owner (see [Note: owner compute for
whole-matrix optimizers]): ``U`` travels in bfloat16, because ``NS`` starts by
rounding its input to bfloat16 (the owner's input is then exactly the matrix a
single device would round), and ``O`` comes back in bfloat16, the dtype ``NS``
produces. The owner runs the same sequence of ops as torch on the same
contiguous matrix, so the whole step matches single-device Muon bit for bit
(tested at 2, 3 and 4 ranks with uneven shards).

Through DTensor dispatch instead, every Newton–Schulz matmul redistributes on
every rank and sums partial products in another order (1e-3 away from
single-device Muon after one step), at twice the time of one process.

Before anything changes, the ranks of each shard group check that they hold
the same matrices (see [Note: ranks agree on the matrices before the
exchange]); a Newton–Schulz that raises on its owner makes every rank raise
(see [Note: a failing computation on its owner]).

Differences from torch, all refused or documented: the momentum buffer is a
DTensor sharded like its parameter (as the DTensor path makes it); for a bfloat16
parameter with ``nesterov=False`` torch's ``NS`` divides the momentum buffer in
place by its norm (its input is the buffer itself); here the buffer is left as
the momentum recurrence defines it.
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .. import _runtime as runtime
from .. import _tool_compat
from ._agree import DigestCache, Members, add_member, agree_and_prune
from ._exchange import BufferPool, ExchangePlan, Layouts, ShardLayout

#: Exchange plans kept per optimizer (least recently used evicted first). A plan
#: depends on which matrices have gradients, so a model whose set of matrices with
#: gradients changes from step to step (experts, frozen layers) would otherwise
#: keep one plan per set; the plans of a shard group share one buffer pool, so
#: the pool's memory does not grow with the number of plans.
PLAN_CACHE_SIZE = 8


@dataclass
class _OptimizerCache:
    """What :func:`muon_step` keeps per optimizer: each parameter's layout (by id,
    checked against its spec), the exchange plans and the digests of the matrix
    lists the ranks compare (see [Note: ranks agree on the matrices before the
    exchange]), both bounded by :data:`PLAN_CACHE_SIZE`."""

    layouts: Layouts = field(default_factory=Layouts)
    plans: OrderedDict[Any, ExchangePlan] = field(default_factory=OrderedDict)
    digests: DigestCache = field(default_factory=lambda: DigestCache(PLAN_CACHE_SIZE))

    def plan(self, key: Any, layout: ShardLayout, shapes: list[tuple[int, int]]) -> ExchangePlan:
        """The cached plan for ``key``, or a new one sharing its group's buffer pool."""
        plan = self.plans.get(key)
        if plan is not None:
            self.plans.move_to_end(key)
            return plan
        plan = ExchangePlan.build(layout, shapes)
        for other in reversed(self.plans.values()):
            if other.layout.group is layout.group:
                plan.pool = other.pool
                break
        self.plans[key] = plan
        while len(self.plans) > PLAN_CACHE_SIZE:
            self.plans.popitem(last=False)
        return plan


_caches: weakref.WeakKeyDictionary[torch.optim.Optimizer, _OptimizerCache] = (
    weakref.WeakKeyDictionary()
)


def newton_schulz(
    x: torch.Tensor,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    *,
    use_addmm: bool = True,
    pool: BufferPool | None = None,
) -> torch.Tensor:
    """The quintic Newton–Schulz orthogonalization of ``torch.optim.Muon``, in
    the same op order (so the same bits). ``x`` is a contiguous bfloat16 matrix
    that may be overwritten (normalized in place, and with ``pool`` used as an
    iterate's storage). With ``pool``, the Gram matrix, its polynomial and every
    iterate but the last are written (``out=``, the same kernels) into buffers
    taken from and given back to ``pool`` (see [Note: exchange buffers are
    reused]); the result is always a fresh tensor."""
    a, b, c = coefficients
    tall = x.size(0) > x.size(1)
    y = x.T if tall else x  # iterate on the wide orientation: the Gram matrix is the small one
    y.div_(y.norm().clamp(min=eps))  # spectral norm at most 1
    if pool is None or not use_addmm or steps < 2:
        for _ in range(steps):
            gram = y @ y.T
            if use_addmm:
                poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
                y = torch.addmm(y, poly, y, beta=a)
            else:
                poly = b * gram + c * gram @ gram
                y = a * y + poly @ y
        return y.T if tall else y
    rows, cols = y.shape
    gram = pool.take(rows * rows, x.dtype, x.device).view(rows, rows)
    poly = pool.take(rows * rows, x.dtype, x.device).view(rows, rows)
    # Iterates alternate between a pooled buffer and x's own storage (no longer
    # needed once the first iteration has read it), the last one fresh.
    spare = [pool.take(rows * cols, x.dtype, x.device).view(rows, cols), x.view(rows, cols)]
    for step in range(steps):
        torch.mm(y, y.T, out=gram)
        torch.addmm(gram, gram, gram, beta=b, alpha=c, out=poly)
        if step == steps - 1:
            y = torch.addmm(y, poly, y, beta=a)
        else:
            y = torch.addmm(y, poly, y, beta=a, out=spare[step % 2])
    pool.give(gram)
    pool.give(poly)
    pool.give(spare[0])
    return y.T if tall else y


def adjusted_lr(lr: Any, adjust_lr_fn: str | None, shape: tuple[int, ...]) -> Any:
    """Muon's learning rate for a matrix of ``shape`` (``adjust_lr_fn`` as in torch)."""
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio


def _ours(p: torch.Tensor) -> bool:
    return isinstance(p, DTensor) and runtime.owner_of(p) is not None


def _check_group(group: dict[str, Any]) -> None:
    # torch checks these inside the step, after updating earlier parameters.
    if group["ns_steps"] >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(group["ns_coefficients"]) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")


def muon_step(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The sharded step of a ``torch.optim.Muon`` for the parameters ``fully_shard``
    sharded (others are left to torch). Checks everything, the ranks' agreement on
    the matrices included, before changing anything."""
    cache = _caches.get(optimizer)
    if cache is None:
        cache = _caches[optimizer] = _OptimizerCache()
    jobs: list[tuple[dict[str, Any], DTensor, ShardLayout]] = []
    members: Members = {}
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if not _ours(p) or (p.grad is None and p.ndim != 2):
                continue
            what = f"Muon param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)})"
            if p.grad is not None:
                _check_param(p, what)
                _check_group(group)
            layout = cache.layouts.of(p, what)
            add_member(members, layout, gi, pi, p)
            if p.grad is not None:
                jobs.append((group, p, layout))
    agree_and_prune(
        optimizer, cache.digests, cache.layouts, members, "torch.optim.Muon", "muon.exchange"
    )
    if not jobs:
        return []

    # One plan per shard group (usually one); the same on every rank of it.
    by_group: dict[int, list[int]] = {}
    for j, (_, _, layout) in enumerate(jobs):
        by_group.setdefault(id(layout.group), []).append(j)
    for idx in by_group.values():
        key = tuple((id(jobs[j][1]), tuple(jobs[j][1].shape)) for j in idx)
        shapes = [(jobs[j][1].shape[0], jobs[j][1].shape[1]) for j in idx]
        plan = cache.plan(key, jobs[idx[0]][2], shapes)
        _run(optimizer, [jobs[j] for j in idx], plan)
    return [p for _, p, _ in jobs]


def _check_param(p: DTensor, what: str) -> None:
    if p.ndim != 2 or p.grad is None or p.grad.ndim != 2:
        raise ValueError(f"fsdp_compose: {what} is not a 2-D matrix; Muon needs 2-D parameters.")
    if torch.is_complex(p):
        raise RuntimeError("Muon does not support complex parameters")
    if p.grad.is_sparse:
        raise RuntimeError("Muon does not support sparse gradients")
    if not isinstance(p.grad, DTensor) or p.grad.placements != p.placements:
        raise ValueError(f"fsdp_compose: {what} has a gradient not laid out like the parameter.")


def _run(
    optimizer: torch.optim.Optimizer,
    jobs: list[tuple[dict[str, Any], DTensor, ShardLayout]],
    plan: ExchangePlan,
) -> None:
    state = optimizer.state

    def momentum(i: int) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
        """Updates matrix ``i``'s momentum on the local rows: (group, grad, buffer)."""
        group, p, _ = jobs[i]
        dgrad = p.grad
        assert isinstance(dgrad, DTensor)  # checked by muon_step
        grad = runtime.local_tensor(dgrad)
        entry = state[p]
        if "momentum_buffer" not in entry:
            entry["momentum_buffer"] = runtime.dtensor_from_local(
                torch.zeros_like(grad, memory_format=torch.preserve_format),
                _tool_compat.dtensor_spec(dgrad),
            )
        buf = runtime.local_tensor(entry["momentum_buffer"])
        buf.lerp_(grad, 1 - group["momentum"])
        return group, grad, buf

    def fill(i: int, out: torch.Tensor) -> None:
        # torch: update = grad.lerp(buf, momentum) (or buf), then update.bfloat16().
        # Writing the lerp straight into the bfloat16 rows rounds the same float32
        # (or float64, or bfloat16) value once, so the bits are the same; float16
        # would round twice in torch, so it takes the two-step path.
        group, grad, buf = momentum(i)
        if not group["nesterov"]:
            out.copy_(buf)
        elif grad.dtype in (torch.float32, torch.float64, torch.bfloat16):
            torch.lerp(grad, buf, group["momentum"], out=out)
        else:
            out.copy_(grad.lerp(buf, group["momentum"]))

    def compute(i: int, full: torch.Tensor) -> torch.Tensor:
        group = jobs[i][0]
        return newton_schulz(
            full,
            group["ns_coefficients"],
            group["ns_steps"],
            group["eps"],
            use_addmm=group.get("use_addmm", True),
            pool=plan.pool,
        )

    def consume(i: int, rows: torch.Tensor) -> None:
        group, p, _ = jobs[i]
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.dim() != 0:
            lr = lr.squeeze()
        local = runtime.local_tensor(p)
        local.mul_(1 - lr * group["weight_decay"])
        local.add_(rows, alpha=-adjusted_lr(lr, group.get("adjust_lr_fn"), tuple(p.shape)))

    with torch.no_grad():
        # Momentum for shards with no rows: nothing to update, but the state exists
        # on every rank (DCP and state_dict() see the same keys everywhere).
        for i, (_, p, layout) in enumerate(jobs):
            start, end = layout.rows(layout.rank, p.shape[0])
            if start == end and layout.world > 1:
                momentum(i)
        device = runtime.local_tensor(jobs[0][1]).device
        plan.run(
            fill,
            compute,
            consume,
            comm_dtype=torch.bfloat16,
            result_dtype=torch.bfloat16,
            device=device,
            recycle_inputs=True,  # Newton-Schulz keeps nothing of its input
            comms=runtime.ToolCollectives("muon.exchange", plan.layout.group, owner=jobs[0][1]),
            describe=lambda i: (
                f"Muon's parameter of shape {tuple(jobs[i][1].shape)} "
                f"(position {i} among the matrices with gradients of its shard group)"
            ),
        )
