"""Optimizer steps on the local shards: the same update, without DTensor dispatch.

[Note: local optimizer steps]
The optimizer holds sharded ``DTensor`` parameters, so each of its elementwise ops
(``mul_``, ``lerp_``, ``addcdiv_``, ...) goes through DTensor's Python dispatch,
which on the CPU costs several times the op itself for small tensors (BENCHMARKS.md,
"Hot-path overhead"). torch's FSDP2 pays that on every step. For optimizers whose
update is elementwise per parameter (SGD, Adam, AdamW, ...), updating the DTensors
is exactly updating their local tensors (every rank holds a different shard or an
identical replica; no op mixes elements of different positions), so fsdp_compose
runs ``step()`` on the local tensors: parameters, gradients and optimizer states are
swapped for their local tensors for the duration of the step and swapped back
afterwards (``try/finally``). State created by the step (the first one) is wrapped
into DTensors laid out like its parameter, exactly as the DTensor path creates it,
so ``optimizer.state_dict()``, ``torch.distributed.checkpoint`` and
``get_state_dict`` see the same objects either way; results are bit-identical.
Adam, AdamW and SGD skip the swap from their second step on: they call torch's
functional update on lists of local tensors (see [Note: direct local updates] in
``_optim_direct.py``).

It applies only where that equivalence holds: the optimizer's class is exactly
one of torch's elementwise optimizers (a subclass may add non-elementwise logic,
such as a norm), ``differentiable`` is off, it is not being compiled, and every
DTensor it holds is a parameter sharded by fsdp_compose (for the direct updates,
per parameter: one fsdp_compose did not shard is left to torch's ``step``, on
the DTensor path). Anything else keeps the DTensor path. It is off by default (FSDP2's behaviour): the user turns it on
per optimizer with :func:`enable_sharded_step`.

[Note: sharded steps run inside step hooks]
``optimizer.step`` itself is never replaced: LR schedulers mark it
(``_wrapped_by_lr_sched``) and warn when the mark is gone, and users and
libraries introspect or wrap it. Instead, an optimizer passed to
:func:`enable_sharded_step` gets one step pre-hook and one step post-hook of its
own. The pre-hook runs after the pre-hooks registered before the call (they
may change gradients or learning rates, exactly as before torch's own update);
register further hooks before calling it. It runs the sharded
update (the elementwise swap above, or the whole-matrix step of
``fsdp_compose.whole_matrix`` for ``torch.optim.Muon`` and
``torch.optim.Adafactor``) and then hides the parameters it updated from the
body of torch's ``step``: each param group's ``"params"`` list is replaced, for
the duration of the step, by a list of the parameters it did not update (often
empty), so torch's loop over the group never sees them, state counters
included. One list per group costs less than setting each parameter's ``.grad``
to ``None`` and back. The post-hook, the first of the post-hooks, puts the
groups' own lists back before any user post-hook sees them (and so does the
next pre-hook, should a step raise before its post-hooks). A ``closure`` is evaluated by the
pre-hook (under ``enable_grad``, before the update, as torch does) and replaced
by one returning its loss, so ``step(closure)`` returns the same value.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from . import _runtime as runtime
from . import _tool_compat
from ._optim_direct import DIRECT

#: A sharded update for one optimizer class: it updates the parameters it can
#: (their states included) and returns them; torch's own ``step`` then skips them.
StepHandler = Callable[[torch.optim.Optimizer], "list[torch.Tensor]"]

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


@dataclass
class _Record:
    """An accelerated optimizer's hook handles and the param groups' own lists
    while its pre-hook swapped them."""

    pre_id: int
    post_id: int
    swapped: list[tuple[dict[str, Any], list[torch.Tensor]]] = field(default_factory=list)


_records: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Record] = weakref.WeakKeyDictionary()


def _handler(optimizer: torch.optim.Optimizer) -> StepHandler | None:
    """The sharded update for ``optimizer``'s exact class, if there is one."""
    cls = type(optimizer)
    if cls in _ELEMENTWISE:
        return _elementwise_step
    if cls is getattr(torch.optim, "Muon", None):
        from .whole_matrix._muon import muon_step

        return muon_step
    if cls is getattr(torch.optim, "Adafactor", None):
        from .whole_matrix._adafactor import adafactor_step

        return adafactor_step
    return None


def enable_sharded_step(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Runs ``optimizer.step()`` on the local shards of fsdp_compose's parameters
    instead of through DTensor dispatch.

    torch's elementwise optimizers (SGD, Adam, AdamW, ...) update the local
    tensors directly, bit-identical to the DTensor path and several times faster
    on small parameters; ``torch.optim.Muon`` and ``torch.optim.Adafactor`` update
    each whole matrix on one owner rank (``fsdp_compose.whole_matrix``), equal
    to their single-device update. Off by default, as in FSDP2. Only the
    optimizer's exact class qualifies (a subclass may add non-elementwise logic)
    and only while every DTensor it holds is a parameter sharded by fsdp_compose;
    otherwise the step keeps the DTensor path. See [Note: local optimizer steps].

    Args:
        optimizer (torch.optim.Optimizer): built from the sharded model's parameters.

    Returns:
        The same optimizer.
    """
    if _handler(optimizer) is None:
        raise ValueError(
            f"enable_sharded_step: {type(optimizer).__name__} has no sharded step; supported "
            f"are {', '.join(c.__name__ for c in _ELEMENTWISE)}, Muon and Adafactor "
            "(exactly these classes, not subclasses)."
        )
    if not any(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"]):
        raise ValueError(
            f"enable_sharded_step: this {type(optimizer).__name__} holds no parameter sharded by "
            "fsdp_compose; build it from model.parameters() after fully_shard."
        )
    if optimizer not in _records:
        pre = optimizer.register_step_pre_hook(_sharded_step_hook)
        post = optimizer.register_step_post_hook(_give_params_back_hook)
        _move(optimizer, "_optimizer_step_post_hooks", post.id, last=False)
        _records[optimizer] = _Record(pre.id, post.id)
    return optimizer


def _move(optimizer: torch.optim.Optimizer, attr: str, key: int, *, last: bool) -> None:
    # torch keeps per-optimizer hooks in OrderedDicts keyed by handle id and runs
    # them in order (private attributes, unchanged since torch 2.0).
    hooks = getattr(optimizer, attr, None)
    if isinstance(hooks, OrderedDict) and key in hooks:
        hooks.move_to_end(key, last=last)


def _sharded_step_hook(
    optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    handler, record = _handler(optimizer), _records.get(optimizer)
    if handler is None or record is None or torch.compiler.is_compiling():
        return None
    _give_params_back(record)  # a step that raised after this hook never reached the post-hook
    replaced = None
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is not None:
        # torch's step would call the closure before updating; so do we.
        with torch.enable_grad():
            loss = closure()
        args = args[:1] if len(args) > 1 else args
        replaced = (args, {**kwargs, "closure": lambda: loss})
    updated = handler(optimizer)
    if updated:
        done = set(map(id, updated))
        for group in optimizer.param_groups:
            params = group["params"]
            record.swapped.append((group, params))
            group["params"] = [p for p in params if id(p) not in done]
    return replaced


def _give_params_back_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    record = _records.get(optimizer)
    if record is not None:
        _give_params_back(record)


def _give_params_back(record: _Record) -> None:
    for group, params in record.swapped:
        group["params"] = params
    record.swapped.clear()


# ---------------------------------------------------------------------------
# torch's elementwise optimizers on local shards
# ---------------------------------------------------------------------------


def _elementwise_step(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    # The body of torch's step without its hook wrapper (the hooks are running).
    body = getattr(type(optimizer).step, "__wrapped__", None)
    if body is None or torch.compiler.is_compiling():
        return []
    if any(group.get("differentiable", False) for group in optimizer.param_groups):
        return []
    direct = DIRECT.get(type(optimizer))
    updated = None if direct is None else direct(optimizer)
    if updated is not None:
        return updated  # see [Note: direct local updates]
    if not _eligible(optimizer):
        return []
    swap = _LocalSwap(optimizer)
    try:
        body(optimizer)
    finally:
        swap.restore()
    return [p for group in optimizer.param_groups for p in group["params"]]


def _eligible(optimizer: torch.optim.Optimizer) -> bool:
    if torch.compiler.is_compiling():
        return False
    for group in optimizer.param_groups:
        if group.get("differentiable", False):
            return False
        for p in group["params"]:
            if isinstance(p, DTensor) and runtime.owner_of(p) is None:
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
                local = runtime.local_tensor(p)
                grad = p.grad
                local.grad = None if grad is None else runtime.local_tensor(grad)
                old = state.pop(p, None)
                if old is not None:
                    state[local] = {
                        k: runtime.local_tensor(v) if isinstance(v, DTensor) else v
                        for k, v in old.items()
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


def _as_state_of(p: DTensor, local: torch.Tensor, value: Any, old: dict[str, Any] | None) -> Any:
    """The DTensor path's version of a state value the local step left."""
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    if old is not None:
        for previous in old.values():  # updated in place: the original DTensor
            if isinstance(previous, DTensor) and runtime.local_tensor(previous) is value:
                return previous
    if value.dim() > 0 and value.shape == local.shape:
        # Created like the parameter (zeros_like / clone of the gradient): the
        # DTensor path would have made a DTensor with the parameter's layout.
        return runtime.dtensor_from_local(
            value, runtime.dtensor_spec_with_dtype(_tool_compat.dtensor_spec(p), value.dtype)
        )
    return value  # scalars such as ``step`` are plain tensors on both paths
