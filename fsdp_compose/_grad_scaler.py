"""Loss scaling whose skip-or-step decision agrees across ranks.

[Note: found_inf with sharded gradients]
``torch.amp.GradScaler`` checks each gradient for inf/nan and skips
``optimizer.step()`` when it finds one. With sharded gradients every rank only
sees its own shard, so the check must be combined over ranks, or a rank whose
shard overflowed skips the step while the others take it and the replicas of the
model silently diverge.

For ``DTensor`` gradients torch's dispatcher all-reduces ``found_inf`` (max) over
the mesh dims on which the gradients are sharded: that serves an optimizer whose
gradients are all DTensors, on FSDP and on HSDP (the replicas' shards are the
output of one all-reduce, so an overflow is on every replica), and there
``torch.amp.GradScaler`` is enough. What it cannot do, with fsdp_compose as with
torch's ``fully_shard`` (``tests/test_clip_and_scaler.py`` shows both): an
optimizer that mixes DTensor gradients with plain, rank-local ones (ignored
parameters, modules left unsharded) makes it raise ("got mixed torch.Tensor and
DTensor"), and with one optimizer per kind an inf in a plain gradient on one rank
skips the step on that rank only.

:class:`ShardedGradScaler` makes the decision global instead: it unscales the
local tensors of every gradient (no collective per group) and all-reduces one
flag per ``unscale_`` over a whole process group (by default every rank), so an
inf on any rank, in any kind of gradient, skips the step on every rank.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import _runtime as runtime
from . import _tool_compat

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """A :class:`torch.amp.GradScaler` for sharded (``DTensor``) gradients whose
    inf/nan check is agreed on by every rank of ``process_group``.

    Use it exactly like ``torch.amp.GradScaler`` (``scale``, ``unscale_``,
    ``step``, ``update``): the only difference is that when any rank finds an
    inf or nan in any of its gradients, every rank skips ``optimizer.step()``
    and backs off the scale, so the ranks stay in lockstep. Needed when an
    optimizer holds plain (rank-local) gradients next to DTensor ones; with
    DTensor gradients only, ``torch.amp.GradScaler`` agrees as well (see
    [Note: found_inf with sharded gradients]). It replaces FSDP1's
    ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` and costs
    one one-element all-reduce per ``unscale_``.

    Example::

        >>> scaler = ShardedGradScaler("cuda")
        >>> with torch.autocast("cuda", dtype=torch.float16):  # or MixedPrecisionPolicy
        ...     loss = loss_fn(model(x), y)
        >>> scaler.scale(loss).backward()
        >>> scaler.unscale_(optim)                        # optional, e.g. to clip
        >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        >>> scaler.step(optim)
        >>> scaler.update()

    Args:
        device (str): device type of the scale (and of the loss): ``"cuda"``,
            ``"cpu"``, ... (Default: ``"cuda"``)
        init_scale (float): initial scale factor. (Default: ``2.0**16``)
        growth_factor (float): factor by which the scale grows after
            ``growth_interval`` steps without inf/nan. (Default: ``2.0``)
        backoff_factor (float): factor by which the scale shrinks on a step with
            inf/nan. (Default: ``0.5``)
        growth_interval (int): consecutive clean steps before the scale grows.
            (Default: ``2000``)
        enabled (bool): ``False`` makes every method a pass-through.
            (Default: ``True``)
        process_group (Optional[ProcessGroup]): the ranks that must agree, i.e.
            every rank that steps an optimizer over the same model.
            ``None`` means the default (world) group. (Default: ``None``)
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.process_group = process_group

    # Overrides torch.amp.GradScaler's hook that unscale_() (and the inf check of
    # step() without unscale_) call; its signature is unchanged since torch 2.3.
    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        grouped: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list)
        )
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    if not allow_fp16 and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    # The local shard shares storage with the DTensor: unscaling it
                    # in place unscales the gradient the optimizer will read.
                    local = runtime.local_tensor(grad) if isinstance(grad, DTensor) else grad
                    if local.is_sparse:
                        if local.dtype == torch.float16:
                            # duplicates could overflow only once summed: check coalesced
                            local = local.coalesce()
                            param.grad = local
                        local = local._values()
                    grouped[local.device][local.dtype].append(local)

            found_per_device: dict[torch.device, torch.Tensor] = {}
            for device, by_dtype in grouped.items():
                found = found_inf if found_inf.device == device else found_inf.to(device, copy=True)
                scale = inv_scale if inv_scale.device == device else inv_scale.to(device)
                for grads in by_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, scale)
                found_per_device[device] = found
            self._agree_on_found_inf(optimizer, found_per_device, found_inf.device)
        return found_per_device

    def _agree_on_found_inf(
        self,
        optimizer: torch.optim.Optimizer,
        found_per_device: dict[torch.device, torch.Tensor],
        scale_device: torch.device,
    ) -> None:
        """Replaces every rank's per-device flags by the max over all ranks.

        Every rank takes part, even one without gradients, so that the collective
        is always matched.
        """
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        assert group is not None, "ShardedGradScaler needs an initialized process group"
        device = _communication_device(group, scale_device)
        flag = torch.zeros((), dtype=torch.float32, device=device)
        for found in found_per_device.values():
            flag += found.to(device)
        # Through the runtime (see [Note: tools' collectives]), reported to the root
        # of the optimizer's first sharded parameter, if any.
        owner = next(
            (p for g in optimizer.param_groups for p in g["params"] if runtime.owner_of(p)), None
        )
        runtime.ToolCollectives("grad_scaler.found_inf", group, owner=owner).all_reduce(flag, "max")
        for found in found_per_device.values():
            found.copy_(flag)


def _communication_device(group: dist.ProcessGroup, scale_device: torch.device) -> torch.device:
    """Where the one-element flag is all-reduced over ``group``: next to the scale,
    unless the scale is on the CPU and the group has no CPU backend (NCCL only)."""
    if scale_device.type != "cpu":
        return scale_device
    backend = _tool_compat.backend_name(group)
    if "gloo" in backend or "mpi" in backend or "cpu" in backend or not torch.cuda.is_available():
        return scale_device
    return torch.device("cuda", torch.cuda.current_device())
