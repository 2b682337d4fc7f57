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
updated in place through their local tensors. Foreach Adam on CPU tensors runs
torch's ops itself, the same ops in the same order per tensor (see
[Note: foreach Adam on the CPU]).

[Note: cached update lists]
Building Adam's lists (a dozen attribute reads and checks per parameter) costs
about a tenth of the update on small parameters, so each group's lists are kept
from one step to the next, less the gradients (a backward after
``zero_grad(set_to_none=True)`` makes new ones: their local tensors are read
every step). Before each step every object the lists were built from is
compared by identity, which costs a few pointer comparisons per tensor: the
optimizer's ``state`` (``load_state_dict`` replaces it, and a pre-hook drops the
lists at once so the old states are freed), the group dict and its parameters
(``add_param_group``, a parameter replaced in the list), each parameter's state
dict and state tensors (a state replaced in its dict), the local tensor each
DTensor holds (``torch.utils.swap_tensors``), and which parameters have a
gradient. Any difference rebuilds the lists; hyperparameters are read from the
group every step, never cached.

[Note: foreach Adam on the CPU]
On the CPU a foreach op is a loop running the single-tensor op on each tensor of
its lists, so torch's multi-tensor Adam makes about ten passes over all the
parameters, gradients and states, one op after the other: once they outgrow the
CPU caches every pass reads them from memory again. It also takes the square
roots of all ``exp_avg_sq`` into new tensors at once and frees them together at
the end of the step; depending on the heap's state glibc gives that memory back
to the operating system, and the next step faults every page in again.

Where ``foreach=True`` would run torch's multi-tensor Adam on CPU tensors (not
capturable, no amsgrad, real parameters, no gradient scaler),
:func:`_foreach_adam_cpu` runs the same ops with the same scalars, in the same
order on each tensor, so every tensor's result is bit-identical: the small
tensors (below ``_LARGE`` bytes) together, as torch does, and each large one on
its own, all its ops in a row while its tensors are still in cache, its square
root freed before the next one is allocated (the heap reuses it). Anything else
calls torch's function.

This copy of torch's op sequence is right only while it agrees with the installed
torch (2.11 through 2.15 are supported). So before it first serves a variant of the
update (no weight decay, decoupled or L2; ``maximize`` or not) in a process,
:func:`_agrees_with_torch` runs it and torch's function for two steps on a tensor
below ``_LARGE`` bytes and one above, and compares the bits; where they differ (a
torch whose multi-tensor Adam changed), that variant calls torch's function from
then on, bit-identical again at the old speed.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

# The functional updates torch's own step calls (public in their modules' __all__).
from torch.optim.adam import adam as _adam
from torch.optim.sgd import sgd as _sgd

from . import _runtime as runtime

_ADAM_STATES = ("exp_avg", "exp_avg_sq")

#: Parameters of at least this many bytes get their foreach Adam update one at a
#: time on the CPU (see [Note: foreach Adam on the CPU]).
_LARGE = 1 << 16


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


@dataclass
class _AdamLists:
    """One param group's lists for Adam's update, less the gradients, and the
    objects they were built from (see [Note: cached update lists])."""

    group: dict[str, Any]
    params: list[torch.Tensor]  # the group's parameters when built
    names: tuple[str, ...]  # the states each updated parameter has, "step" first
    updated: list[torch.Tensor]  # the parameters with a gradient, in order
    idle: list[torch.Tensor]  # the parameters without one (skipped ones excluded)
    dicts: list[dict[str, Any]]  # ``optimizer.state[p]`` of each updated parameter
    sources: list[list[torch.Tensor]]  # updated, then each state's tensors (DTensors)
    tensors: list[list[torch.Tensor]]  # their local tensors, in the same order
    steps: list[torch.Tensor]
    has_complex: bool
    on_cpu: bool = True  # every parameter
    large: list[int] = field(default_factory=list)  # positions of those of _LARGE bytes or more
    small: list[int] = field(default_factory=list)  # the others
    # How the local tensor of each of ``sources`` is read: without an isinstance
    # check per tensor where all are DTensors (the common case).
    local_of: Callable[[torch.Tensor], torch.Tensor] = runtime.local_tensor


@dataclass
class _Cache:
    """An optimizer's lists, one per param group, valid for ``state`` only."""

    state: Any
    groups: list[_AdamLists]


_caches: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Cache] = weakref.WeakKeyDictionary()


def _forget(optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
    # A load_state_dict pre-hook: the loaded states replace the cached ones, which
    # must not stay alive until the next step.
    cache = _caches.get(optimizer)
    if cache is not None:
        cache.state, cache.groups = None, []


def _adam_names(group: dict[str, Any]) -> tuple[str, ...] | None:
    """The states Adam's step reads for ``group``; ``None`` where a hyperparameter
    is a tensor (torch's step validates those; let it)."""
    if torch.is_tensor(group["lr"]) or any(torch.is_tensor(b) for b in group["betas"]):
        return None
    return ("step", *_ADAM_STATES, "max_exp_avg_sq")[: 4 if group["amsgrad"] else 3]


def _adam_lists(state: Any, group: dict[str, Any]) -> _AdamLists | None:
    """The lists Adam's ``step`` builds for ``group``, of local tensors, less the
    gradients; ``None`` where a state is missing or a tensor is not a plain dense one."""
    names = _adam_names(group)
    if names is None:
        return None
    sources: list[list[torch.Tensor]] = [[] for _ in names]
    tensors: list[list[torch.Tensor]] = [[] for _ in names]
    lists = _AdamLists(group, list(group["params"]), names, [], [], [], sources, tensors, [], False)
    for p in group["params"]:
        if _skipped(p):
            continue
        if p.grad is None:
            lists.idle.append(p)
            continue
        s = state.get(p)
        if not s or not all(n in s for n in names):
            return None  # the first step creates the states
        step = s["step"]
        if not torch.is_tensor(step) or isinstance(step, DTensor):
            return None
        for source, out, t in zip(sources, tensors, (p, *(s[n] for n in names[1:]))):
            local = _local(t)
            if local is None:
                return None
            source.append(t)
            out.append(local)
        local_p = tensors[0][-1]
        lists.has_complex |= local_p.is_complex()
        lists.on_cpu &= local_p.device.type == "cpu"
        large = local_p.numel() * local_p.element_size() >= _LARGE
        (lists.large if large else lists.small).append(len(lists.updated))
        lists.steps.append(step)
        lists.updated.append(p)
        lists.dicts.append(s)
    if not all(isinstance(t, DTensor) for source in sources for t in source):
        lists.local_of = _held
    return lists


def _held(t: torch.Tensor) -> torch.Tensor:
    return runtime.local_tensor(t) if isinstance(t, DTensor) else t


def _current_grads(
    lists: _AdamLists, state: Any, group: dict[str, Any]
) -> list[torch.Tensor] | None:
    """The local gradients of ``lists.updated``; ``None`` where ``lists`` no longer
    describes ``group`` or a gradient is not a plain dense tensor (see
    [Note: cached update lists])."""
    params, dicts, is_ = group["params"], lists.dicts, operator.is_
    if (
        lists.group is not group
        or len(params) != len(lists.params)
        or not all(map(is_, params, lists.params))
        or _adam_names(group) != lists.names
        or any(p.grad is not None for p in lists.idle)
        or not all(map(is_, map(state.get, lists.updated), dicts))
        or not all(map(is_, [d.get("step") for d in dicts], lists.steps))
        or not all(map(is_, map(lists.local_of, lists.updated), lists.tensors[0]))
    ):
        return None
    for n, sources, tensors in zip(lists.names[1:], lists.sources[1:], lists.tensors[1:]):
        # A state replaced in its dict, or swapped (``swap_tensors``), is not cached.
        held: list[Any] = [d.get(n) for d in dicts]
        if not all(map(is_, held, sources)) or not all(
            map(is_, map(lists.local_of, held), tensors)
        ):
            return None
    grads = []
    for p in lists.updated:
        grad = p.grad
        local = None if grad is None else _local(grad)
        if local is None:
            return None
        grads.append(local)
    return grads


def _adam_work(
    optimizer: torch.optim.Optimizer,
) -> list[tuple[_AdamLists, list[torch.Tensor]]] | None:
    """Each group's lists and local gradients, the lists kept from the last step
    where still valid; ``None`` where the direct update does not apply."""
    state = optimizer.state
    cache = _caches.get(optimizer)
    if cache is None:
        cache = _caches[optimizer] = _Cache(state, [])
        optimizer.register_load_state_dict_pre_hook(_forget)
    elif cache.state is not state:
        cache.state, cache.groups = state, []
    work = []
    for i, group in enumerate(optimizer.param_groups):
        lists = cache.groups[i] if i < len(cache.groups) else None
        grads = None if lists is None else _current_grads(lists, state, group)
        if lists is None or grads is None:
            lists = _adam_lists(state, group)
            grads = None if lists is None else _current_grads(lists, state, group)
            if lists is None or grads is None:
                cache.groups = []
                return None
        work.append((lists, grads))
    cache.groups = [lists for lists, _ in work]
    return work


def _reproduced(lists: _AdamLists, group: dict[str, Any], grad_scale: Any, found_inf: Any) -> bool:
    """Whether torch's step would run its multi-tensor Adam on CPU tensors, in the
    variant :func:`_foreach_adam_cpu` reproduces."""
    return (
        group["foreach"] is True
        and not group["fused"]
        and not group["capturable"]
        and not group["amsgrad"]
        and not lists.has_complex
        and lists.on_cpu
        and grad_scale is None
        and found_inf is None
        and bool(lists.updated)
        and _agrees_with_torch(group)
    )


# Per variant of the update (weight decay and its kind, maximize): whether the ops of
# _adam_ops give torch's bits in this process (see [Note: foreach Adam on the CPU]).
_agreement: dict[tuple[bool, bool, bool], bool] = {}


def _agrees_with_torch(group: dict[str, Any]) -> bool:
    """Whether :func:`_foreach_adam_cpu` reproduces the installed torch's multi-tensor
    Adam for ``group``'s variant, checked once per process on a small and a large
    tensor over two steps (see [Note: foreach Adam on the CPU])."""
    decay = group["weight_decay"] != 0
    variant = (decay, decay and bool(group["decoupled_weight_decay"]), bool(group["maximize"]))
    agrees = _agreement.get(variant)
    if agrees is None:
        agrees = _agreement[variant] = _compare_with_torch(*variant)
    return agrees


def _compare_with_torch(decay: bool, decoupled: bool, maximize: bool) -> bool:
    """Two steps of torch's multi-tensor Adam and of :func:`_foreach_adam_cpu` on the
    same values, a tensor below ``_LARGE`` bytes and one above: the same bits?"""
    gen = torch.Generator().manual_seed(0)
    sizes = (37, _LARGE // 4 + 11)  # float32 elements
    lr, beta1, beta2, eps, weight_decay = 1e-2, 0.9, 0.99, 1e-8, 0.1 if decay else 0.0
    group: dict[str, Any] = {"lr": lr, "betas": (beta1, beta2), "eps": eps}
    group.update(maximize=maximize, weight_decay=weight_decay, decoupled_weight_decay=decoupled)

    def draw() -> list[torch.Tensor]:
        return [torch.randn(n, generator=gen) for n in sizes]

    ours = [draw(), draw(), [t.abs() for t in draw()]]  # params, exp_avgs, exp_avg_sqs
    theirs = [[t.clone() for t in values] for values in ours]
    steps = [[torch.tensor(0.0) for _ in sizes] for _ in range(2)]
    lists = _AdamLists(group, [], ("step", *_ADAM_STATES), list(ours[0]), [], [], [], ours,
                       steps[0], False, small=[0], large=[1])  # fmt: skip
    with torch.no_grad():
        for _ in range(2):
            grads = draw()
            _foreach_adam_cpu(lists, [g.clone() for g in grads], group)
            params, exp_avgs, exp_avg_sqs = theirs
            _adam(params, grads, exp_avgs, exp_avg_sqs, [], steps[1], foreach=True,
                  capturable=False, differentiable=False, fused=None, grad_scale=None,
                  found_inf=None, has_complex=False, decoupled_weight_decay=decoupled,
                  amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay,
                  eps=eps, maximize=maximize)  # fmt: skip
    return all(torch.equal(a, b) for xs, ys in zip(ours, theirs) for a, b in zip(xs, ys))


def _foreach_adam_cpu(lists: _AdamLists, grads: list[torch.Tensor], group: dict[str, Any]) -> None:
    """torch's multi-tensor Adam (``foreach=True``, not capturable, no amsgrad, real
    tensors) on CPU tensors: the same ops, in the same order on each tensor, as
    ``torch.optim.adam._multi_tensor_adam``, the small tensors together and each
    large one on its own; see [Note: foreach Adam on the CPU]."""
    steps, (beta1, beta2) = lists.steps, group["betas"]
    # torch's CPU steps: one wrapped 1.0 and alpha, the overload its CPU path takes.
    torch._foreach_add_(steps, torch.tensor(1.0, device="cpu"), alpha=1.0)
    counts = [step.item() for step in steps]
    step_sizes = [(group["lr"] / (1 - beta1**t)) * -1 for t in counts]
    roots_by = [(1 - beta2**t) ** 0.5 for t in counts]
    params, exp_avgs, exp_avg_sqs = lists.tensors
    every = (params, grads, exp_avgs, exp_avg_sqs, step_sizes, roots_by)
    if lists.small:
        small = lists.small
        _adam_ops([[values[i] for i in small] for values in every], group)
    for i in lists.large:
        _adam_ops([[values[i]] for values in every], group)


def _adam_ops(values: list[list[Any]], group: dict[str, Any]) -> None:
    """The foreach ops of torch's multi-tensor Adam after the step counts, on
    these tensors (a foreach op on CPU tensors runs the single-tensor op on each):
    ``values`` holds the params, grads, exp_avgs, exp_avg_sqs, step sizes and
    bias corrections of the square roots."""
    params, grads, exp_avgs, exp_avg_sqs, step_sizes, roots_by = values
    lr, (beta1, beta2), decay = group["lr"], group["betas"], group["weight_decay"]
    maximize = group["maximize"]
    grads = list(torch._foreach_neg(grads)) if maximize else grads
    if decay != 0:
        if group["decoupled_weight_decay"]:
            torch._foreach_mul_(params, 1 - lr * decay)
        elif maximize:
            torch._foreach_add_(grads, params, alpha=decay)
        else:
            grads = list(torch._foreach_add(grads, params, alpha=decay))
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    del grads
    roots = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(roots, roots_by)
    torch._foreach_add_(roots, group["eps"])
    torch._foreach_addcdiv_(params, exp_avgs, roots, step_sizes)


def adam_step(optimizer: torch.optim.Optimizer) -> list[torch.Tensor] | None:
    """Adam's or AdamW's update on the local shards (see [Note: direct local updates]);
    returns the parameters it updated, or ``None``, with nothing updated, where it
    does not apply."""
    work = _adam_work(optimizer)
    if work is None:
        return None
    grad_scale = getattr(optimizer, "grad_scale", None)
    found_inf = getattr(optimizer, "found_inf", None)
    updated: list[torch.Tensor] = []
    with torch.no_grad():
        for lists, grads in work:
            group = lists.group
            if _reproduced(lists, group, grad_scale, found_inf):
                _foreach_adam_cpu(lists, grads, group)
                updated += lists.updated
                continue
            params, exp_avgs, exp_avg_sqs, *rest = lists.tensors
            beta1, beta2 = group["betas"]
            _adam(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                rest[0] if rest else [],
                lists.steps,
                foreach=group["foreach"],
                capturable=group["capturable"],
                differentiable=group["differentiable"],
                fused=group["fused"],
                grad_scale=grad_scale,
                found_inf=found_inf,
                has_complex=lists.has_complex,
                decoupled_weight_decay=group["decoupled_weight_decay"],
                amsgrad=group["amsgrad"],
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
            )
            updated += lists.updated
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
