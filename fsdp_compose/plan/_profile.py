"""What one forward/backward of the model needs, measured on the meta device.

:func:`profile_model` runs the (unwrapped) model once on the meta device, with
parameters substituted through ``torch.func.functional_call`` so the model
itself is never modified or materialized, and records for every module that a
plan may make a unit:

* the parameters it manages (shapes and dtypes, after inner units took theirs);
* the bytes autograd saves for backward while it runs (its activations), in
  execution order, parameters excluded;
* the bytes of its forward inputs (what activation checkpointing keeps instead);
* its forward + backward FLOPs (``torch.utils.flop_counter``);

and, for the whole step, the allocation trace: every storage allocated and freed,
in order, with the units' boundaries ([Note: the allocation trace]), which the
estimate replays.

[Note: activations from saved tensors]
The memory a training step holds for activations is the set of tensors autograd
saved for backward. ``saved_tensors_hooks`` sees every one of them; views of one
tensor share a storage, so storages are counted once, and the parameters'
storages are skipped (they are the unit's unsharded parameters, accounted for
separately). On the meta device this costs no memory and little time, so the
same run works for a 70B-parameter model at any sequence length.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

ROOT = ""

#: fn(model, batch, seq) -> scalar loss; runs one forward on the meta device.
StepFn = Callable[[nn.Module, int, int], torch.Tensor]


@dataclass
class ParamInfo:
    """One managed parameter."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    trainable: bool

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def shard_numel(self, world: int) -> int:
        """Padded per-rank elements: ``ceil(rows / world)`` rows of dim 0."""
        if not self.shape:
            return 1
        rows = self.shape[0]
        return -(-rows // world) * (self.numel // rows if rows else 0)


@dataclass
class ModuleProfile:
    """What one unit candidate (a module, or the root's remainder) needs."""

    fqn: str
    params: list[ParamInfo] = field(default_factory=list)
    saved_bytes: int = 0
    input_bytes: int = 0
    flops: float = 0.0


@dataclass
class ModelProfile:
    """Profiles by module, and the forward order of activation segments."""

    modules: dict[str, ModuleProfile]
    forward_order: list[str]  # module fqns in the order their forwards ran
    #: the step's storage allocations and frees, with unit boundaries
    #: (``[Note: the allocation trace]``)
    events: list[tuple[Any, ...]] = field(default_factory=list)


def default_step(model: nn.Module, batch: int, seq: int) -> torch.Tensor:
    """One language-model step on token ids: ``cross_entropy(logits, ids)``.

    Works for models that take ``(batch, seq)`` token ids and return logits (a
    tensor, an object with ``.logits``, or a tuple whose first item is logits).
    """
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    out = model(ids)
    logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if logits is None and isinstance(out, (tuple, list)):
        logits = out[0]
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            f"the default step expects the model to return logits, got {type(out).__name__}; "
            "pass step_fn=fn(model, batch, seq) -> loss"
        )
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids.reshape(-1))


def profile_model(
    model: nn.Module,
    unit_modules: Sequence[str],
    *,
    batch: int,
    seq: int,
    compute_dtype: torch.dtype | None,
    step_fn: StepFn = default_step,
) -> ModelProfile:
    """Profiles ``model`` for units made of ``unit_modules`` (bottom-up order).

    Args:
        model: the model; its parameters may be on the meta device.
        unit_modules: fqns of the modules that become units, children first.
        batch, seq: the per-rank micro-batch.
        compute_dtype: ``MixedPrecisionPolicy.param_dtype`` (``None``: as built).
        step_fn: runs the forward and returns the loss.
    """
    named = dict(model.named_modules())
    candidates = [*unit_modules, ROOT]
    profiles = {fqn: ModuleProfile(fqn) for fqn in candidates}
    owner_of: dict[int, str] = {}  # which unit candidate manages each parameter
    for fqn in candidates:
        for p in named[fqn].parameters():
            if id(p) not in owner_of:
                owner_of[id(p)] = fqn
                profiles[fqn].params.append(ParamInfo(tuple(p.shape), p.dtype, p.requires_grad))
    substitutes = _substitutes(model, compute_dtype)
    param_storages = {
        substitutes[name].untyped_storage()._cdata for name, _ in model.named_parameters()
    }
    # the parameters' and buffers' storages exist before the step: not allocations
    trace = _AllocTrace({t.untyped_storage()._cdata for t in substitutes.values()})
    for name, p in model.named_parameters():
        if substitutes[name].requires_grad:
            substitutes[name].register_post_accumulate_grad_hook(trace.grad_hook(owner_of[id(p)]))

    stack: list[str] = [ROOT]
    order: list[str] = []
    counted: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in param_storages and key not in counted:
            counted.add(key)
            nbytes = t.untyped_storage().nbytes()
            profiles[stack[-1]].saved_bytes += nbytes
        return t

    handles = _boundary_hooks(named, unit_modules, profiles, trace, stack, order)
    flops = FlopCounterMode(display=False, custom_mapping=_attention_flop_formulas())
    try:
        with flops, torch.device("meta"), _FusedAttention(), trace:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                step = _Step(model, step_fn, batch, seq)
                loss = torch.func.functional_call(
                    step, {f"model.{k}": v for k, v in substitutes.items()}, (), strict=False
                )
            trace.events.append(("loss", ROOT))
            if loss.requires_grad:
                loss.backward()
    finally:
        trace.stop()
        for h in handles:
            h.remove()
    _assign_flops(flops.get_flop_counts(), unit_modules, profiles)
    return ModelProfile(
        modules=profiles,
        forward_order=list(dict.fromkeys(order)),
        events=trace.events,
    )


def _substitutes(model: nn.Module, compute_dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Fresh meta tensors (in the compute dtype) for the parameters, so that backward
    fills *their* ``.grad`` and the model stays untouched; the buffers on meta too,
    so that a materialized model profiles as well."""
    substitutes: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():  # tied weights: one entry, functional_call re-ties
        dtype = (
            compute_dtype if compute_dtype is not None and p.dtype.is_floating_point else p.dtype
        )
        substitutes[name] = torch.empty(p.shape, dtype=dtype, device="meta").requires_grad_(
            p.requires_grad
        )
    for name, b in model.named_buffers():
        substitutes[name] = b.to("meta")
    return substitutes


def _boundary_hooks(
    named: dict[str, nn.Module],
    unit_modules: Sequence[str],
    profiles: dict[str, ModuleProfile],
    trace: _AllocTrace,
    stack: list[str],
    order: list[str],
) -> list[Any]:
    """Forward hooks marking each unit candidate's forward in the trace (and its
    backward, through its outputs); they keep ``stack`` (who saves) and ``order``."""

    def pre_hook(fqn: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            stack.append(fqn)
            order.append(fqn)
            trace.events.append(("fp", fqn))
            profiles[fqn].input_bytes += sum(
                t.untyped_storage().nbytes()
                for t in [*args, *kwargs.values()]
                if isinstance(t, torch.Tensor) and t.is_floating_point()
            )

        return hook

    def post_hook(fqn: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            stack.pop()
            trace.events.append(("fo", fqn))
            trace.on_backward_of(fqn, output)

        return hook

    handles = []
    for fqn in unit_modules:
        handles.append(named[fqn].register_forward_pre_hook(pre_hook(fqn), with_kwargs=True))
        handles.append(
            named[fqn].register_forward_hook(post_hook(fqn), with_kwargs=True, always_call=True)
        )
    return handles


def _assign_flops(
    counts: dict[str, Any], unit_modules: Sequence[str], profiles: dict[str, ModuleProfile]
) -> None:
    """Each unit candidate's own FLOPs (units nest: a unit's exclude those of units
    inside it); the root gets the rest."""
    prefix = "_Step.model"  # FlopCounterMode names modules by class and fqn from the top
    total = float(sum(counts.get("Global", {}).values()))
    for fqn in unit_modules:
        profiles[fqn].flops = float(sum(counts.get(f"{prefix}.{fqn}", {}).values()))
    inner = 0.0
    for fqn in unit_modules:
        for other in unit_modules:
            if other != fqn and other.startswith(fqn + "."):
                profiles[fqn].flops -= profiles[other].flops
        inner += profiles[fqn].flops
    profiles[ROOT].flops = max(0.0, total - inner)


class _AllocTrace(TorchDispatchMode):
    """Records every storage the step allocates and when it is freed.

    [Note: the allocation trace]
    Each op's outputs are checked for storages not seen alive before; those are
    allocations (``("a", key, nbytes)``), and a ``weakref.finalize`` on the
    storage records its free (``("f", key)``) when the last tensor using it
    dies, as the real allocator would see it. Unit boundaries are interleaved:
    ``("fp", fqn)`` / ``("fo", fqn)`` around a unit candidate's forward,
    ``("bs", fqn)`` when the gradient of its output first arrives (its
    pre-backward), ``("g", fqn, key)`` when a parameter it manages has its
    gradient accumulated (``key``: that gradient's storage, which fsdp_compose
    frees at the unit's post-backward, after packing it for the reduction), and
    ``("loss", "")`` between forward and backward. The parameters themselves are
    not in the trace: fsdp_compose's buffers stand for them.
    """

    def __init__(self, existing: set[int]) -> None:
        super().__init__()
        self._existing = existing
        self.events: list[tuple[Any, ...]] = []
        self._alive: dict[int, int] = {}  # storage address in torch -> key
        self._next = 0
        self._recording = True
        self._seen_backward: set[str] = set()

    def stop(self) -> None:
        """Ends recording (frees after the step are the caller's cleanup)."""
        self._recording = False

    def _key_of(self, t: torch.Tensor) -> int | None:
        return self._alive.get(t.untyped_storage()._cdata)

    def _record(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        cdata = storage._cdata
        if cdata in self._alive or cdata in self._existing:
            return
        key = self._next
        self._next += 1
        self._alive[cdata] = key
        self.events.append(("a", key, storage.nbytes()))
        weakref.finalize(storage, self._freed, cdata, key)

    def _freed(self, cdata: int, key: int) -> None:
        if self._alive.get(cdata) == key:
            del self._alive[cdata]
        if self._recording:
            self.events.append(("f", key))

    def grad_hook(self, owner: str) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if self._recording and p.grad is not None:
                self.events.append(("g", owner, self._key_of(p.grad)))

        return hook

    def on_backward_of(self, fqn: str, output: Any) -> None:
        """Marks ``fqn``'s pre-backward: the first gradient of one of its outputs."""
        outs = output if isinstance(output, (tuple, list)) else (output,)
        for t in outs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g, fqn=fqn: self._backward_starts(fqn))

    def _backward_starts(self, fqn: str) -> None:
        if self._recording and fqn not in self._seen_backward:
            self._seen_backward.add(fqn)
            self.events.append(("bs", fqn))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if self._recording:
            for t in _tensors(out):
                self._record(t)
        return out


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


class _FusedAttention(torch.overrides.TorchFunctionMode):
    """Runs ``scaled_dot_product_attention`` as the fused kernel real devices use.

    On the meta device torch picks the math fallback, which saves the full
    ``(B, H, S, S)`` attention matrix; the CPU flash kernel and the CUDA
    flash/memory-efficient kernels save only q, k, v, the output and a
    ``(B, H, S)`` log-sum-exp. The CPU flash op has meta kernels and the same
    saved tensors as the CUDA ones, so it stands in for all of them.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _fused_sdpa(*args, **kwargs)
        return func(*args, **kwargs)


def _fused_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    if enable_gqa and k.size(-3) != q.size(-3):
        repeat = q.size(-3) // k.size(-3)
        k, v = k.repeat_interleave(repeat, dim=-3), v.repeat_interleave(repeat, dim=-3)
    if attn_mask is not None and attn_mask.dtype != q.dtype and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.to(q.dtype)
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )[0]
    return out


def _attention_flop_formulas() -> dict[Any, Any]:
    """FLOP formulas for the CPU flash kernel that stands in for the fused ones
    (``_FusedAttention``), torch's counts for the CUDA kernels (QK^T and AV, full
    matrices whether causal or not): without them attention's products count
    nothing and compute is just 6 x params x tokens."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    def forward(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> int:
        return int(sdpa_flop_count(q, k, v))

    def backward(grad_out: Any, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> int:
        return int(sdpa_backward_flop_count(grad_out, q, k, v))

    aten = torch.ops.aten
    return {
        aten._scaled_dot_product_flash_attention_for_cpu: forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: backward,
    }


class _Step(nn.Module):
    """Wraps ``step_fn`` so that ``functional_call`` can swap the parameters."""

    def __init__(self, model: nn.Module, step_fn: StepFn, batch: int, seq: int) -> None:
        super().__init__()
        self.model = model
        self.step_fn, self.batch, self.seq = step_fn, batch, seq

    def forward(self) -> torch.Tensor:
        return self.step_fn(self.model, self.batch, self.seq)
