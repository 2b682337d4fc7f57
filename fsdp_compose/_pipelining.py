"""Pipeline parallelism: ``torch.distributed.pipelining`` stages built on fsdp_compose.

A pipeline schedule (GPipe, 1F1B, interleaved 1F1B, ...) runs one forward and one
``backward()`` per microbatch. Each such backward is a complete autograd pass, so
by default every unit reduce-scatters its gradients once per *microbatch*: correct
(gradients are summed over microbatches either way) but ``n_microbatches`` times
the communication. torch's ``PipelineStage`` avoids this for torch's own
``FSDPModule`` only: it turns gradient sync off for all but the last microbatch's
backward. :class:`PipelineStage` does the same for fsdp_compose modules through the
public :class:`~fsdp_compose.FSDPModule` API, so each unit reduces once per step.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

from ._runtime import FSDPModule

__all__ = ["PipelineStage"]


def _outermost_fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    """The FSDPModules in ``module``'s subtree not nested in another one: the
    modules whose ``set_*(recurse=True)`` calls cover every unit of the stage."""
    found: list[FSDPModule] = []

    def visit(m: nn.Module) -> None:
        if isinstance(m, FSDPModule):
            found.append(m)
            return
        for child in m.children():
            visit(child)

    visit(module)
    return found


def _prepare_microbatch_backward(modules: list[FSDPModule], is_last: bool) -> None:
    for m in modules:
        # Microbatches before the last accumulate unsharded gradients locally and
        # keep the parameters gathered for the next microbatch's backward; the
        # last one reduces the sum once and frees everything.
        m.set_requires_gradient_sync(is_last)
        m.set_reshard_after_backward(is_last)
        m.set_is_last_backward(is_last)


class PipelineStage(_TorchPipelineStage):
    """A :class:`torch.distributed.pipelining.PipelineStage` whose module contains
    fsdp_compose units: gradients are reduce-scattered once per schedule step.

    A drop-in replacement (same constructor) for torch's ``PipelineStage`` when the
    stage module, or modules inside it, were annotated with
    :func:`~fsdp_compose.fully_shard`. Before each microbatch's backward it calls,
    on every outermost :class:`~fsdp_compose.FSDPModule` of the stage,
    ``set_requires_gradient_sync(last)``, ``set_reshard_after_backward(last)`` and
    ``set_is_last_backward(last)``, where ``last`` is ``True`` only for the last
    microbatch of the step (as the schedule reports it). The earlier microbatches
    therefore accumulate unsharded gradients without communication and keep the
    parameters gathered; the last one reduces each unit once. After a step all
    three settings are ``True`` again. When the stage module is itself an
    ``FSDPModule``, torch's stage code takes its FSDP2 path: every microbatch
    accumulates, and the schedule's gradient-reduction action ends backward with
    :meth:`~fsdp_compose.FSDPModule.finalize_backward` (manual finalization, as
    torch 2.15's own stage does), which this class also does on older torch.

    Works with schedules that run a full backward per microbatch (``ScheduleGPipe``,
    ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``). Schedules
    that split backward into input and weight passes (zero-bubble schedules) are
    not supported: fsdp_compose reduces a unit's gradients when backward through
    it completes, which the input pass does without computing weight gradients.

    Like torch's, the schedule divides gradients by the number of microbatches
    (``scale_grads=True``) after the reduction, so with a mean loss per microbatch
    the gradients equal those of the mean loss over the data-parallel batch.
    """

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self.submod, FSDPModule) and self.has_backward:
            # As torch 2.15's stage does: the schedule's reduce-grad action ends backward.
            self.submod.set_manual_backward_finalization(True)
        return super().forward_one_chunk(*args, **kwargs)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        if isinstance(self.submod, FSDPModule) and self.has_backward:
            # torch's stage recognises the unit as an FSDPModule; before 2.15 it would
            # finalize through FSDP2's private state, so this does it publicly.
            self.submod.set_requires_gradient_sync(True)
            self.submod.set_reshard_after_backward(True)
            self.submod.finalize_backward()
            self.submod.set_manual_backward_finalization(False)
        if grad_scale_factor != 1:
            self.scale_grads(grad_scale_factor)

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict[str, Any], last_backward: bool = False
    ) -> Any:
        if backward_type != "full":
            raise NotImplementedError(
                f"fsdp_compose.PipelineStage supports schedules with a full backward per "
                f"microbatch (GPipe, 1F1B, interleaved 1F1B, looped BFS); this schedule runs "
                f"a split {backward_type!r} backward (zero-bubble), during which fsdp_compose "
                "cannot tell when a unit's weight gradients are complete."
            )
        _prepare_microbatch_backward(_outermost_fsdp_modules(self.submod), last_backward)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
