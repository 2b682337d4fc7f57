"""Adam, AdamW and SGD updates called directly on lists of local shards.

[Note: direct local updates]
For the optimizers whose update is most used (``torch.optim.Adam``, ``AdamW`` and
``SGD``), the sharded step does not run the optimizer's ``step`` at all: it builds
the lists torch's ``step`` would build (parameters with a gradient, their
gradients and states, in the same order), from the local tensors of the DTensors,
and calls the same functional update torch's ``step`` calls
(``torch.optim.adam.adam``, ``torch.optim.sgd.sgd``) with the same group
hyperparameters, ``grad_scale`` and ``found_inf``. The update then runs once per
group on plain tensors (fused, foreach or per tensor as the group says), with no
DTensor wrapper created, no sharding propagation and no state swapped in and out
of ``optimizer.state``; the states stay the DTensors the optimizer holds and are
updated in place through their local tensors. Nothing is cached between steps,
so ``load_state_dict``, new param groups or replaced parameters need no
invalidation.

A step is taken here only when every state it needs already exists (the first
step creates them through the general local path of ``_optim.py``, exactly as
torch's ``step`` does) and every tensor is a plain dense tensor (a tensor
subclass's local shard or a sparse gradient keeps the general path); otherwise
nothing is updated and the caller falls back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

# The functional updates torch's own step calls (public in their modules' __all__).
from torch.optim.adam import adam as _adam
from torch.optim.sgd import sgd as _sgd

from . import _runtime as runtime

_ADAM_STATES = ("exp_avg", "exp_avg_sq")


def _skipped(p: torch.Tensor) -> bool:
    """A DTensor parameter fsdp_compose did not shard (tensor parallel only, say):
    it keeps the DTensor path, through torch's own ``step``."""
    return isinstance(p, DTensor) and runtime.owner_of(p) is None


def _local(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s local tensor (``t`` itself if not a DTensor); ``None`` unless it is a
    plain dense tensor, which the functional updates handle exactly as torch's step."""
    local = runtime.local_tensor(t) if isinstance(t, DTensor) else t
    if type(local) is not torch.Tensor and type(local) is not torch.nn.Parameter:
        return None
    return None if local.is_sparse else local


def _adam_lists(state: Any, group: dict[str, Any], updated: list[torch.Tensor]) -> list[Any] | None:
    """The lists Adam's ``step`` builds for ``group``, of local tensors (the
    parameters they update appended to ``updated``); ``None`` where a state is
    missing or a tensor is not a plain dense one."""
    if torch.is_tensor(group["lr"]) or any(torch.is_tensor(b) for b in group["betas"]):
        return None  # torch's step validates these; let it
    names = (*_ADAM_STATES, "max_exp_avg_sq") if group["amsgrad"] else _ADAM_STATES
    lists: list[list[torch.Tensor]] = [[] for _ in range(2 + len(names))]
    steps: list[torch.Tensor] = []
    has_complex = False
    for p in group["params"]:
        grad = p.grad
        if grad is None or _skipped(p):
            continue
        s = state.get(p)
        step = None if not s else s.get("step")
        if step is None or isinstance(step, DTensor) or not all(n in s for n in names):
            return None  # the first step creates the states
        for out, t in zip(lists, (p, grad, *(s[n] for n in names))):
            local = _local(t)
            if local is None:
                return None
            out.append(local)
        has_complex |= lists[0][-1].is_complex()
        steps.append(step)
        updated.append(p)
    params, grads, exp_avgs, exp_avg_sqs, *rest = lists
    max_sqs = rest[0] if rest else []
    return [params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, has_complex]


def adam_step(optimizer: torch.optim.Optimizer) -> list[torch.Tensor] | None:
    """Adam's or AdamW's update on the local shards (see [Note: direct local updates]);
    returns the parameters it updated, or ``None``, with nothing updated, where it
    does not apply."""
    work: list[tuple[dict[str, Any], list[Any]]] = []
    updated: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        lists = _adam_lists(optimizer.state, group, updated)
        if lists is None:
            return None
        work.append((group, lists))
    grad_scale = getattr(optimizer, "grad_scale", None)
    found_inf = getattr(optimizer, "found_inf", None)
    with torch.no_grad():
        for group, (params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, cplx) in work:
            beta1, beta2 = group["betas"]
            _adam(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                max_sqs,
                steps,
                foreach=group["foreach"],
                capturable=group["capturable"],
                differentiable=group["differentiable"],
                fused=group["fused"],
                grad_scale=grad_scale,
                found_inf=found_inf,
                has_complex=cplx,
                decoupled_weight_decay=group["decoupled_weight_decay"],
                amsgrad=group["amsgrad"],
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
            )
    return updated


def _sgd_lists(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], updated: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor | None]] | None:
    if group["fused"] and getattr(optimizer, "_need_device_dtype_check_for_fused", True):
        return None  # torch's step checks devices once; let it
    with_momentum = group["momentum"] != 0
    params: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    buffers: list[torch.Tensor | None] = []
    for p in group["params"]:
        grad = p.grad
        if grad is None or _skipped(p):
            continue
        local_p, local_g = _local(p), _local(grad)
        if local_p is None or local_g is None:
            return None
        buffer = None
        if with_momentum:
            s = optimizer.state.get(p)
            buffer = None if not s else s.get("momentum_buffer")
            if buffer is None or (buffer := _local(buffer)) is None:
                return None  # created by the first step: the general path makes it a DTensor
            buffers.append(buffer)
        params.append(local_p)
        grads.append(local_g)
        updated.append(p)
    return params, grads, buffers


def sgd_step(optimizer: torch.optim.Optimizer) -> list[torch.Tensor] | None:
    """SGD's update on the local shards (see [Note: direct local updates]);
    returns the parameters it updated, or ``None``, with nothing updated, where it
    does not apply."""
    work: list[tuple[dict[str, Any], Any]] = []
    updated: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        lists = _sgd_lists(optimizer, group, updated)
        if lists is None:
            return None
        work.append((group, lists))
    grad_scale = getattr(optimizer, "grad_scale", None)
    found_inf = getattr(optimizer, "found_inf", None)
    with torch.no_grad():
        for group, (params, grads, buffers) in work:
            # Momentum buffers exist, so the update writes them in place: the
            # optimizer's DTensor states see it without being reassigned.
            _sgd(
                params,
                grads,
                buffers,
                weight_decay=group["weight_decay"],
                momentum=group["momentum"],
                lr=group["lr"],
                dampening=group["dampening"],
                nesterov=group["nesterov"],
                maximize=group["maximize"],
                has_sparse_grad=False,
                foreach=group["foreach"],
                fused=group["fused"],
                grad_scale=grad_scale,
                found_inf=found_inf,
            )
    return updated


#: The optimizers (exact classes) with a direct update.
DIRECT: dict[
    type[torch.optim.Optimizer], Callable[[torch.optim.Optimizer], list[torch.Tensor] | None]
] = {
    torch.optim.Adam: adam_step,
    torch.optim.AdamW: adam_step,
    torch.optim.SGD: sgd_step,
}
