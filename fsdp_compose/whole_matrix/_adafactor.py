"""``torch.optim.Adafactor`` on parameters sharded by ``fully_shard``.

[Note: sharded Adafactor]
Adafactor factors the second moment of a matrix into a row factor (the mean of
``g²`` over each row) and a column factor (the mean over each column), and
scales each step by the parameter's and the update's RMS. With rows sharded, the
row factor and every elementwise op are local, and what crosses ranks is small:
per matrix, the column sums of ``g²`` (``n`` numbers), the sum of the row factor,
and two squared norms. These go in two all-reduces per shard group and step
(float64, before and after the update is formed), so no matrix moves at all. The
row factor is stored as a DTensor sharded like its parameter, the column factor
(of a 2-D parameter) replicated; for parameters of more than two dimensions,
dim 0 is a batch dimension of the factorization and both factors are sharded.

The result is torch's single-device Adafactor up to the order of the sums
(~1e-7 relative; the DTensor path cannot run it at all: torch 2.13's sharding
propagation rejects the in-place ``square_`` of a partial norm).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from .. import _runtime as runtime
from .. import _tool_compat
from ._agree import DigestCache, Members, add_member, agree_and_prune
from ._exchange import Layouts, ShardLayout
from ._muon import PLAN_CACHE_SIZE, _ours


@dataclass
class _OptimizerCache:
    """Per optimizer: parameters' layouts and the digests the ranks compare (see
    [Note: ranks agree on the matrices before the exchange])."""

    layouts: Layouts = field(default_factory=Layouts)
    digests: DigestCache = field(default_factory=lambda: DigestCache(PLAN_CACHE_SIZE))


_caches: weakref.WeakKeyDictionary[torch.optim.Optimizer, _OptimizerCache] = (
    weakref.WeakKeyDictionary()
)


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _state_like(
    p: DTensor, local: torch.Tensor, shape: list[int], *, replicate: bool = False
) -> DTensor:
    placements = [Replicate()] * p.device_mesh.ndim if replicate else list(p.placements)
    return DTensor.from_local(
        local,
        p.device_mesh,
        placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=_contiguous(shape),
    )


def _contiguous(shape: list[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


class _Job:
    """One parameter's step, in the phases between the two all-reduces."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        group: dict[str, Any],
        p: DTensor,
        layout: ShardLayout,
    ) -> None:
        self.group, self.p, self.layout = group, p, layout
        self.param = runtime.local_tensor(p)
        assert isinstance(p.grad, DTensor)  # a parameter sharded by fully_shard
        grad = runtime.local_tensor(p.grad)
        self.grad = -grad if group["maximize"] else grad
        self.state = optimizer.state[p]
        self.rows_sharded = p.ndim == 2 and layout.world > 1  # column statistics cross ranks
        self.update: torch.Tensor | None = None
        if len(self.state) == 0:
            self._init_state()

    def _init_state(self) -> None:
        p, state = self.p, self.state
        state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
        if p.ndim > 1:
            row_shape = [*p.shape[:-1], 1]
            local_row = [*self.grad.shape[:-1], 1]
            state["row_var"] = _state_like(p, self.grad.new_zeros(local_row), row_shape)
            col_shape = [*p.shape[:-2], 1, p.shape[-1]]
            if p.ndim == 2:  # the column factor spans every rank's rows
                state["col_var"] = _state_like(
                    p, self.grad.new_zeros([1, p.shape[-1]]), col_shape, replicate=True
                )
            else:
                local_col = [*self.grad.shape[:-2], 1, p.shape[-1]]
                state["col_var"] = _state_like(p, self.grad.new_zeros(local_col), col_shape)
        else:
            state["variance"] = runtime.dtensor_from_local(
                torch.zeros_like(self.grad, memory_format=torch.preserve_format),
                _tool_compat.dtensor_spec(p),
            )

    def first_phase(self) -> list[torch.Tensor]:
        """Local statistics; returns the partial sums to all-reduce."""
        state, grad = self.state, self.grad
        state["step"] += 1
        self.step = state["step"].item()
        self.one_minus_beta2 = self.step ** self.group["beta2_decay"]
        sums = [self.param.double().square().sum().reshape(1)]
        if self.p.ndim > 1:
            row_var = runtime.local_tensor(state["row_var"])
            row_mean = torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1))
            row_var.lerp_(row_mean, self.one_minus_beta2)
            if self.rows_sharded:
                sums.append(grad.double().square().sum(dim=0))
                sums.append(row_var.double().sum().reshape(1))
        return sums

    def second_phase(self, totals: list[torch.Tensor], eps1: float) -> torch.Tensor:
        """Forms the update; returns the partial squared norm of it."""
        group, state, grad = self.group, self.state, self.grad
        lr = _lr(group)
        rho = min(lr, 1 / (self.step**0.5))
        self.alpha = (
            max(group["eps"][1], math.sqrt(totals[0].item()) / (self.p.numel() ** 0.5)) * rho
        )
        if group["weight_decay"] != 0:
            self.param.mul_(1 - lr * group["weight_decay"])
        if self.p.ndim > 1:
            row_var = runtime.local_tensor(state["row_var"])
            col_var = runtime.local_tensor(state["col_var"])
            if self.rows_sharded:
                m = self.p.shape[0]
                col_var.lerp_(
                    (totals[1] / m).to(col_var.dtype).reshape(col_var.shape), self.one_minus_beta2
                )
                row_mean = torch.tensor(totals[2].item() / m, dtype=row_var.dtype).clamp_(min=eps1)
            else:
                col_mean = torch.norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2))
                col_var.lerp_(col_mean, self.one_minus_beta2)
                row_mean = row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1)
            estimate = (row_var @ col_var).div_(row_mean)
        else:
            variance = runtime.local_tensor(state["variance"])
            variance.lerp_(grad * grad, self.one_minus_beta2)
            estimate = variance.clone()
        self.update = estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(grad)
        return self.update.double().square().sum().reshape(1)

    def apply(self, update_sq: float) -> None:
        assert self.update is not None
        denom = max(1.0, math.sqrt(update_sq) / ((self.p.numel() ** 0.5) * self.group["d"]))
        self.param.add_(self.update, alpha=-self.alpha / denom)
        self.update = None


def _lr(group: dict[str, Any]) -> float:
    lr = group["lr"]
    return lr.item() if isinstance(lr, torch.Tensor) else lr


def _all_reduce(
    parts: list[list[torch.Tensor]], layout: ShardLayout, comms: runtime.ToolCollectives
) -> list[list[torch.Tensor]]:
    flat = torch.cat([t for job in parts for t in job])
    if layout.group is not None and layout.world > 1:
        comms.all_reduce(flat)
    out, offset = [], 0
    for job in parts:
        pieces = []
        for t in job:
            pieces.append(flat[offset : offset + t.numel()])
            offset += t.numel()
        out.append(pieces)
    return out


def adafactor_step(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The sharded step of a ``torch.optim.Adafactor`` for the parameters
    ``fully_shard`` sharded; checks everything before changing anything."""
    if (
        getattr(optimizer, "grad_scale", None) is not None
        or getattr(optimizer, "found_inf", None) is not None
    ):
        raise AssertionError("Grad scaling should occur outside of optimizer.step()")
    cache = _caches.get(optimizer)
    if cache is None:
        cache = _caches[optimizer] = _OptimizerCache()
    found: list[tuple[dict[str, Any], DTensor, ShardLayout]] = []
    members: Members = {}
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if not _ours(p):
                continue
            if p.grad is not None:
                if torch.is_complex(p):
                    raise RuntimeError("Adafactor does not support complex parameters")
                if p.grad.is_sparse:
                    raise RuntimeError("Adafactor does not support sparse gradients")
            layout = cache.layouts.of(p, f"Adafactor param_groups[{gi}]['params'][{pi}]")
            add_member(members, layout, gi, pi, p)
            if p.grad is not None:
                found.append((group, p, layout))
    agree_and_prune(
        optimizer, cache.digests, cache.layouts, members, "torch.optim.Adafactor", "adafactor.step"
    )
    if not found:
        return []
    with torch.no_grad():
        by_group: dict[int, list[_Job]] = {}
        for group, p, layout in found:
            by_group.setdefault(id(layout.group), []).append(_Job(optimizer, group, p, layout))
        for jobs in by_group.values():
            layout = jobs[0].layout
            comms = runtime.ToolCollectives("adafactor.step", layout.group, owner=jobs[0].p)
            firsts = _all_reduce([job.first_phase() for job in jobs], layout, comms)
            seconds = []
            for job, totals in zip(jobs, firsts):
                eps1 = job.group["eps"][0]
                eps1 = torch.finfo(job.param.dtype).eps if eps1 is None else eps1
                seconds.append([job.second_phase(totals, eps1)])
            for job, (update_sq,) in zip(jobs, _all_reduce(seconds, layout, comms)):
                job.apply(update_sq.item())
    return [p for _, p, _ in found]
