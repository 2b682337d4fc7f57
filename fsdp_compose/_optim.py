"""Optimizer steps on the local shards: the same update, without DTensor dispatch.

[Note: local optimizer steps]
The optimizer holds sharded ``DTensor`` parameters, so each of its elementwise
ops (``mul_``, ``lerp_``, ``addcdiv_``, ...) goes through DTensor's Python
dispatch: about 30 us per op on the CPU, ten times the op itself for small
tensors, or some 40 ms per step for a 17M-parameter GPT with AdamW. torch's
FSDP2 pays that on every step. For optimizers whose update is elementwise per
parameter (SGD, Adam, AdamW, ...), updating the DTensors is exactly updating
their local tensors (every rank holds a different shard or an identical replica;
no op mixes elements of different positions), so fsdp_compose runs ``step()``
on the local tensors: parameters, gradients and optimizer states are swapped for
their local tensors for the duration of the step and swapped back afterwards
(``try/finally``). State created by the step (the first one) is wrapped into
DTensors laid out like its parameter, exactly as the DTensor path creates it, so
``optimizer.state_dict()``, ``torch.distributed.checkpoint`` and
``get_state_dict`` see the same objects either way; results are bit-identical.

It applies only where that equivalence holds: the optimizer's class is exactly
one of torch's elementwise optimizers (a subclass may add non-elementwise logic,
such as a norm), ``differentiable`` is off, it is not being compiled, and every
DTensor it holds is a parameter sharded by fsdp_compose. Anything else keeps the
DTensor path. ``FSDP_COMPOSE_LOCAL_OPTIMIZER_STEP=0`` turns it off.
"""

from __future__ import annotations

import types
import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from . import _compat, _env
from ._sharded_param import SHARDED_BY

_ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
)
_accelerated: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def enabled() -> bool:
    return _env.flag("FSDP_COMPOSE_LOCAL_OPTIMIZER_STEP", True)


def accelerate(optimizer: torch.optim.Optimizer) -> None:
    """Makes later ``optimizer.step()`` calls run on local shards where that is
    exactly equivalent (see [Note: local optimizer steps]). Idempotent."""
    if optimizer in _accelerated or type(optimizer) not in _ELEMENTWISE or not enabled():
        return
    _accelerated.add(optimizer)
    original = optimizer.step  # bound; possibly already wrapped by an LR scheduler

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if not _eligible(self):
            return original(*args, **kwargs)
        swap = _LocalSwap(self)
        try:
            return original(*args, **kwargs)
        finally:
            swap.restore()

    # A bound method, like the attribute it replaces: LR schedulers wrap
    # ``optimizer.step`` through its ``__func__``.
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]


def _eligible(optimizer: torch.optim.Optimizer) -> bool:
    if _compat.is_compiling():
        return False
    for group in optimizer.param_groups:
        if group.get("differentiable", False):
            return False
        for p in group["params"]:
            if isinstance(p, DTensor) and getattr(p, SHARDED_BY, None) is None:
                return False  # a DTensor that is not ours (e.g. tensor parallel only)
    return True


class _LocalSwap:
    """Replaces an optimizer's DTensor parameters, their gradients and states by
    local tensors; :meth:`restore` puts the DTensors back."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        self._groups: list[tuple[dict[str, Any], list[torch.Tensor]]] = []
        self._entries: list[tuple[DTensor, torch.Tensor, dict[str, Any] | None]] = []
        state = optimizer.state
        for group in optimizer.param_groups:
            params = group["params"]
            local_params: list[torch.Tensor] = []
            for p in params:
                if not isinstance(p, DTensor):
                    local_params.append(p)
                    continue
                local = _compat.local_tensor(p)
                grad = p.grad
                local.grad = None if grad is None else _compat.local_tensor(grad)
                old = state.pop(p, None)
                if old is not None:
                    state[local] = {
                        k: _compat.local_tensor(v) if isinstance(v, DTensor) else v for k, v in old.items()
                    }
                self._entries.append((p, local, old))
                local_params.append(local)
            self._groups.append((group, params))
            group["params"] = local_params

    def restore(self) -> None:
        for group, params in self._groups:
            group["params"] = params
        state = self._optimizer.state
        for p, local, old in self._entries:
            local.grad = None
            new = state.pop(local, None)
            if new is None:
                if old is not None:
                    state[p] = old
                continue
            state[p] = {k: _as_state_of(p, local, v, old) for k, v in new.items()}


def _as_state_of(
    p: DTensor, local: torch.Tensor, value: Any, old: dict[str, Any] | None
) -> Any:
    """The DTensor path's version of a state value the local step left."""
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    if old is not None:
        for previous in old.values():  # updated in place: the original DTensor
            if isinstance(previous, DTensor) and _compat.local_tensor(previous) is value:
                return previous
    if value.dim() > 0 and value.shape == local.shape:
        # Created like the parameter (zeros_like / clone of the gradient): the
        # DTensor path would have made a DTensor with the parameter's layout.
        return _compat.dtensor_from_local(value, _compat.dtensor_spec_with_dtype(_compat.dtensor_spec(p), value.dtype))
    return value  # scalars such as ``step`` are plain tensors on both paths
