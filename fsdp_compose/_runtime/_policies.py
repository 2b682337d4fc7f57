"""User-facing policy objects, mixed precision and offloading: frozen dataclasses
validated on construction, so a bad policy fails where it is written."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy"]


def _check_float_dtype(name: str, dtype: object) -> None:
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"MixedPrecisionPolicy.{name} must be a torch.dtype or None, got {dtype!r}")
    if not dtype.is_floating_point:
        raise ValueError(
            f"MixedPrecisionPolicy.{name} must be a floating-point dtype "
            f"(e.g. torch.bfloat16 or torch.float32), got {dtype}"
        )


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Configures module-level mixed precision for one :func:`fully_shard` unit.

    Unlike autocast, the casts happen at unit boundaries: parameters are
    all-gathered and used in ``param_dtype``, so forward and backward compute (and
    saved activations) are in that dtype. The sharded parameters, and hence the
    optimizer, stay in their original dtype.

    Attributes:
        param_dtype (Optional[torch.dtype]): dtype of the unsharded parameters, the
            all-gather and compute. ``None`` keeps the original dtype. (Default: ``None``)
        reduce_dtype (Optional[torch.dtype]): dtype in which gradients are reduced
            (and accumulated without gradient sync); they are stored on the sharded
            parameters in their original dtype. ``None`` follows the installed
            torch's FSDP2: from 2.15, the parameters' original dtype; up to 2.14,
            ``param_dtype``. Gradients of several dtypes in one unit are reduced in
            their promoted dtype. (Default: ``None``)
        output_dtype (Optional[torch.dtype]): if set, floating-point forward outputs
            of the unit are cast to this dtype. (Default: ``None``)
        cast_forward_inputs (bool): whether floating-point forward inputs are cast
            to ``param_dtype``. (Default: ``True``)
        grad_dtype (Optional[torch.dtype]): keyword-only; torch main's (FSDP2 2.16's)
            gradient dtype, on every torch. If set, autograd computes and accumulates
            the unsharded parameters' gradients in this dtype (their ``grad_dtype``),
            they are reduced in it unless ``reduce_dtype`` is set, and the sharded
            gradients are stored in it whatever the parameters' own dtype (fp32
            gradients for bf16 parameters, say), also across ``module.to(...)``,
            ``.cpu()``, ``.bfloat16()``. (Default: ``None``: the behaviour above)
        param_dtype_override_fn (Optional[Callable[[nn.Parameter], Optional[torch.dtype]]]):
            keyword-only; torch 2.15's per-parameter override of ``param_dtype``, on
            every torch. :func:`fully_shard` calls it once per managed parameter:
            the parameter's original dtype keeps it in that dtype, ``None`` or
            ``param_dtype`` uses ``param_dtype``, any other dtype raises
            ``ValueError``. It must agree across ranks. (Default: ``None``)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    param_dtype_override_fn: Callable[[nn.Parameter], torch.dtype | None] | None = field(
        default=None, kw_only=True
    )
    grad_dtype: torch.dtype | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            _check_float_dtype(name, getattr(self, name))
        grad_dtype = self.grad_dtype  # ValueError for any non-float, as torch main
        if grad_dtype is not None and not (
            isinstance(grad_dtype, torch.dtype) and grad_dtype.is_floating_point
        ):
            raise ValueError(
                f"MixedPrecisionPolicy.grad_dtype must be a floating-point dtype (e.g. "
                f"torch.float32) or None, got {grad_dtype!r}"
            )
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(
                "MixedPrecisionPolicy.cast_forward_inputs must be a bool, "
                f"got {self.cast_forward_inputs!r}"
            )
        if self.param_dtype_override_fn is not None and not callable(self.param_dtype_override_fn):
            raise TypeError(
                "MixedPrecisionPolicy.param_dtype_override_fn must be callable "
                f"(nn.Parameter -> torch.dtype | None), got {self.param_dtype_override_fn!r}"
            )

    def _resolve_for_param(self, param: nn.Parameter) -> MixedPrecisionPolicy:
        """This policy for one parameter, ``param_dtype_override_fn`` applied."""
        if self.param_dtype_override_fn is None:
            return self
        override = self.param_dtype_override_fn(param)
        if override is not None and not isinstance(override, torch.dtype):
            raise ValueError(
                "param_dtype_override_fn must return a torch.dtype or None but got "
                f"{type(override)}"
            )
        if override is not None and override not in (self.param_dtype, param.dtype):
            raise ValueError(
                "param_dtype_override_fn must return None, param_dtype, or the parameter's "
                f"original dtype but got {override} for a parameter with dtype {param.dtype} "
                f"and param_dtype {self.param_dtype}"
            )
        param_dtype = self.param_dtype if override is None else override
        return replace(self, param_dtype=param_dtype, param_dtype_override_fn=None)


@dataclass(frozen=True)
class OffloadPolicy:
    """The default offload policy: nothing is offloaded."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keeps sharded parameters, gradients and optimizer states in CPU memory.

    On an accelerator mesh, sharded parameters are copied to the device just before
    their all-gather and reduced gradients to the host right after their
    reduce-scatter; the optimizer step runs on the CPU. On a CPU mesh it changes nothing.

    Attributes:
        pin_memory (bool): whether to pin the host copies of sharded parameters and
            gradients (faster, asynchronous copies; page-locked memory). (Default: ``True``)
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"CPUOffloadPolicy.pin_memory must be a bool, got {self.pin_memory!r}")
