"""The collectives the tools issue: whole-matrix optimizers, exports, the scaler.

[Note: tools' collectives]
Every collective fsdp_compose issues goes through the runtime's launch path, the
tools' too, so that what observes a root (debug mode, the timeline, the tests'
collective logs) sees the collectives issued for its parameters: a Muon exchange
that one rank skips is the hang debug mode exists to name. A tool makes one
:class:`ToolCollectives` per operation: its process group, a label naming the
operation (``muon.exchange``, ``grad_scaler.found_inf``), and the root it serves,
found from one of its parameters or modules in the runtime's own maps
(:func:`events_for`; never from attributes on tensors). Each method makes the
torch.distributed call the tool would make alone, with the same arguments, on the
current stream (``CommDebugMode`` and the profiler see the same calls), inside a
``record_function`` label (``FSDP::all_to_all (muon.exchange)``), and
reports ``issue``/``complete``/``wait_begin``/``wait_end`` to the root's
observers. A tool working on no root's parameters reports to nobody. Where the
sizes differ between ranks (an all-to-all's splits, sends to one rank), the tool
passes ``total_numel``, a size every rank of the group knows the same, which is
what debug mode compares.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ._collectives import PendingCollective, launch
from ._events import CollectiveKind, Events
from ._hooks import state_of
from ._ownership import unit_of

__all__ = ["ToolCollectives", "events_for"]

_OPS: dict[str, Any] = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


def events_for(owner: object) -> Events | None:
    """The events of the root that owns ``owner``: a sharded parameter (its unit's
    root), or a module annotated with ``fully_shard`` or holding one (the first in
    ``modules()`` order); ``None`` for anything else."""
    if isinstance(owner, nn.Module):
        for module in owner.modules():
            state = state_of(module)
            if state is not None:
                return state.settings.events
        return None
    unit = unit_of(owner)
    return None if unit is None else unit.events


class ToolCollectives:
    """The collectives of one tool operation labelled ``label`` on ``group``
    (``None``: the default group), reported to the observers of the root that owns
    ``owner`` (a sharded parameter or a module; see [Note: tools' collectives]).

    Args:
        label (str): the operation, as the profiler and observers name it.
        group (Optional[ProcessGroup]): the group, passed as is to torch.distributed.
        owner (object): what the collectives serve, to find its root's observers.
    """

    __slots__ = ("events", "group", "label")

    def __init__(self, label: str, group: dist.ProcessGroup | None = None, owner: object = None):
        self.label, self.group = label, group
        self.events = None if owner is None else events_for(owner)

    def _group(self) -> dist.ProcessGroup:
        group = self.group if self.group is not None else dist.group.WORLD
        assert group is not None, "a tool's collective needs an initialized process group"
        return group

    def _launch(
        self, kind: CollectiveKind, issue: Callable[[], Any], numels: tuple[int, int],
        dtype: torch.dtype, **how: Any,
    ) -> PendingCollective:  # fmt: skip
        """Issues this operation's ``kind`` through the runtime's launch path
        (:func:`~fsdp_compose._runtime._collectives.launch`; ``how``: its keywords)."""
        return launch(kind, self.label, self._group(), self.events, issue, numels, dtype, **how)

    def size(self) -> int:
        return dist.get_world_size(self.group)

    def ranks(self) -> list[int]:
        """The global ranks of the group, by group rank."""
        if self.group is None:
            return list(range(dist.get_world_size()))
        return dist.get_process_group_ranks(self.group)

    def all_reduce(
        self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False
    ) -> PendingCollective:
        """``dist.all_reduce(tensor, op)`` in place (``op``: sum, max, min, product)."""
        # A sum is the call a tool makes without an op.
        op_kwarg = {} if op == "sum" else {"op": _OPS[op]}
        group = self.group

        def issue() -> dist.Work | None:
            return dist.all_reduce(tensor, group=group, async_op=async_op, **op_kwarg)

        numels = (tensor.numel(), tensor.numel())
        return self._launch(
            "all_reduce", issue, numels, tensor.dtype, blocking=not async_op,
            op="" if op == "sum" else op,
        )  # fmt: skip

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        *,
        total_numel: int,
    ) -> PendingCollective:
        """``dist.all_to_all_single``, asynchronous; ``total_numel``: the elements the
        whole group exchanges (the same on every rank)."""
        group = self.group

        def issue() -> dist.Work | None:
            return dist.all_to_all_single(
                output, input, output_split_sizes, input_split_sizes, group=group, async_op=True
            )

        numels = (input.numel(), output.numel())
        return self._launch("all_to_all", issue, numels, input.dtype, total_numel=total_numel)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by group rank (``dist.all_gather_object``)."""
        out: list[Any] = [None] * self.size()
        group = self.group

        def issue() -> None:
            dist.all_gather_object(out, obj, group=group)

        self._launch("all_gather_object", issue, (1, len(out)), torch.uint8, blocking=True)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Global rank ``src``'s ``obj`` on every rank (``dist.broadcast_object_list``)."""
        box, group = [obj], self.group

        def issue() -> None:
            dist.broadcast_object_list(box, src=src, group=group)

        self._launch("broadcast_object", issue, (1, 1), torch.uint8, blocking=True)
        return box[0]

    def send_recv(
        self,
        sends: Sequence[tuple[torch.Tensor, int]],
        recvs: Sequence[tuple[torch.Tensor, int]],
        *,
        total_numel: int,
        dtype: torch.dtype,
    ) -> None:
        """This rank's part of one exchange of the group: blocking ``dist.send`` of each
        (tensor, global rank) of ``sends`` in order, then ``dist.recv`` into each of
        ``recvs`` (a tensor that is not contiguous through a buffer of its shape).
        Every rank of the group calls it, those with nothing to do too (the exchange
        is one collective to the observers); ``total_numel``: the elements the whole
        exchange moves (the same on every rank)."""

        def issue() -> None:
            for tensor, dst in sends:
                dist.send(tensor, dst=dst)
            for tensor, src in recvs:
                if tensor.is_contiguous():
                    dist.recv(tensor, src=src)
                else:
                    buf = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
                    dist.recv(buf, src=src)
                    tensor.copy_(buf)

        numels = (sum(t.numel() for t, _ in sends), sum(t.numel() for t, _ in recvs))
        self._launch("send_recv", issue, numels, dtype, blocking=True, total_numel=total_numel)
