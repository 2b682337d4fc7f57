"""User-facing policy objects, mixed precision and offloading: frozen dataclasses
validated on construction, so a bad policy fails where it is written."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    all-gathered and used in ``param_dtype``, so forward and backward compute in
    that dtype and low-precision activations are saved for backward. The sharded
    parameters (and hence the optimizer) stay in their original dtype.

    Attributes:
        param_dtype (Optional[torch.dtype]): dtype of the unsharded parameters, and
            so of the all-gather and of forward/backward compute. ``None`` keeps the
            original dtype. (Default: ``None``)
        reduce_dtype (Optional[torch.dtype]): dtype in which gradients are reduced
            (reduce-scatter, and all-reduce for HSDP). ``None`` reduces in the
            compute dtype. With :meth:`FSDPModule.set_requires_gradient_sync`
            ``(False)`` gradients are also accumulated in this dtype. Reduced
            gradients are stored on the sharded parameters in their original
            dtype. (Default: ``None``)
        output_dtype (Optional[torch.dtype]): if set, floating-point forward outputs
            of the unit are cast to this dtype. (Default: ``None``)
        cast_forward_inputs (bool): whether floating-point forward inputs are cast
            to ``param_dtype``. (Default: ``True``)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        _check_float_dtype("param_dtype", self.param_dtype)
        _check_float_dtype("reduce_dtype", self.reduce_dtype)
        _check_float_dtype("output_dtype", self.output_dtype)
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(
                "MixedPrecisionPolicy.cast_forward_inputs must be a bool, "
                f"got {self.cast_forward_inputs!r}"
            )


@dataclass(frozen=True)
class OffloadPolicy:
    """The default offload policy: nothing is offloaded."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keeps sharded parameters, gradients and optimizer states in CPU memory.

    On an accelerator mesh, each sharded parameter is copied host-to-device just
    before its all-gather, and each reduced gradient device-to-host right after
    its reduce-scatter; the optimizer step then runs on the CPU. On a CPU mesh the
    policy is accepted and changes nothing (everything already lives on the CPU).

    Attributes:
        pin_memory (bool): whether to pin the host copies of sharded parameters and
            gradients, which makes the copies asynchronous and faster at the cost
            of page-locked host memory. (Default: ``True``)
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"CPUOffloadPolicy.pin_memory must be a bool, got {self.pin_memory!r}")
