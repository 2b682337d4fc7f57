"""gloo's collectives issued fast: on the ProcessGroup object directly, an
all-gather as one broadcast per rank, and a reduce-scatter as one all-to-all
(the algorithms of [Note: all-gather on gloo] and [Note: reduce-scatter on
gloo] in ``_collectives.py``).

Used only for groups whose CPU backend really is ``ProcessGroupGloo``
(:func:`serves_cpu_with_gloo`), see [Note: collectives per backend].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from . import _compat

# [Note: issuing gloo collectives]
# On the CPU, torch.distributed's Python wrappers (argument checks, group
# translation, coalescing bookkeeping) cost about as much as the collective's own
# issue for small tensors: 16-24 us of ~60 us per call (measured, torch 2.13).
# With hundreds of small units per step that is most of the per-unit overhead, so
# gloo collectives are issued on the ProcessGroup object directly. Accelerator
# backends keep the wrappers: they decide which stream the collective runs on.
# Only for groups whose CPU backend is a ProcessGroupGloo (serves_cpu_with_gloo):
# a group without one (torch's threaded test group, a CUDA-only group) has nothing
# to issue on, see [Note: collectives per backend] in _collectives.py.
_direct_gloo_ok = True


_W = TypeVar("_W")


def _issue_gloo(direct: Callable[[], _W], fallback: Callable[[], _W | None]) -> _W:
    global _direct_gloo_ok
    if _direct_gloo_ok:
        try:
            return direct()
        except (AttributeError, TypeError):  # pragma: no cover - binding changed
            _direct_gloo_ok = False
    work = fallback()
    assert work is not None
    return work


def gloo_all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup
) -> dist.Work:
    """Asynchronous all-gather on a gloo ``group`` (see [Note: issuing gloo collectives])."""
    return _issue_gloo(
        lambda: group._allgather_base(output, input),
        lambda: _compat.all_gather_into_tensor(output, input, group, async_op=True),
    )


class WorkGroup:
    """Several ``Work`` objects behaving as one: ``wait`` waits for all of them and
    ``get_future`` completes when all have."""

    __slots__ = ("_works",)

    def __init__(self, works: list[dist.Work]) -> None:
        self._works = works

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return torch.futures.collect_all([work.get_future() for work in self._works])


def gloo_all_gather_by_broadcast(output: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
    """Asynchronous all-gather on a gloo ``group`` as one broadcast per rank, each
    straight into its row of ``output`` (this rank's row already holds its input).
    See [Note: all-gather on gloo]."""
    rows = output.view(group.size(), -1)

    def direct() -> WorkGroup:
        works = []
        for root in range(group.size()):
            opts = dist.BroadcastOptions()
            opts.rootRank = root
            opts.rootTensor = 0
            works.append(group.broadcast([rows[root]], opts))
        return WorkGroup(works)

    def fallback() -> WorkGroup:
        ranks = dist.get_process_group_ranks(group)
        return WorkGroup(
            [
                dist.broadcast(rows[root], ranks[root], group=group, async_op=True)  # type: ignore[misc]
                for root in range(group.size())
            ]
        )

    # A WorkGroup has the part of Work's interface the collectives use (wait,
    # get_future), so callers treat it as one.
    return _issue_gloo(direct, fallback)  # type: ignore[return-value]


def gloo_all_to_all_single(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup
) -> dist.Work:
    """Asynchronous even all-to-all on a gloo ``group`` (see [Note: issuing gloo collectives])."""
    return _issue_gloo(
        lambda: group.alltoall_base(output, input, [], []),
        lambda: dist.all_to_all_single(output, input, group=group, async_op=True),
    )


def serves_cpu_with_gloo(group: dist.ProcessGroup) -> bool:
    """Whether CPU tensors on ``group`` go to a real ``ProcessGroupGloo`` (possibly
    inside torch's debug wrapper), so that the gloo-only paths apply.

    Asks the group for its CPU backend object rather than comparing names: the
    threaded test group, the ``fake`` backend, MPI, UCC and vendor backends
    register other classes (or no CPU backend at all), and a group created with
    ``"cpu:gloo,cuda:nccl"`` is gloo for its CPU tensors.
    """
    gloo_class = getattr(dist, "ProcessGroupGloo", None)
    if gloo_class is None:  # torch built without gloo
        return False
    try:
        backend = group._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return False  # no backend object for the CPU (e.g. a Python-level ProcessGroup)
    # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the backend to check collectives first
    backend = getattr(backend, "wrapped_pg", backend)
    return isinstance(backend, gloo_class)


class _SumAfter:
    """The all-to-all of a reduce-scatter (see [Note: reduce-scatter on gloo]):
    ``wait`` waits for it and sums the received chunks into the output."""

    __slots__ = ("_output", "_received", "_work")

    def __init__(self, work: dist.Work, received: torch.Tensor, output: torch.Tensor) -> None:
        self._work = work
        self._received = received
        self._output = output

    def wait(self) -> bool:
        self._work.wait()
        output = self._output
        rows = self._received.view(-1, output.numel())
        if rows.size(0) == 2:  # a binary add is about twice as fast as a 2-row sum (same bits)
            torch.add(rows[0], rows[1], out=output)
        else:
            torch.sum(rows, dim=0, out=output)
        return True

    def get_future(self) -> torch.futures.Future:
        return self._work.get_future()


def reduce_scatter_by_all_to_all(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup
) -> dist.Work:
    """Asynchronous sum reduce-scatter on a gloo ``group`` as one all-to-all and a
    local sum at ``wait`` (see [Note: reduce-scatter on gloo])."""
    received = torch.empty_like(input)
    work = gloo_all_to_all_single(received, input, group)
    # Has the part of Work's interface the collectives use (wait, get_future).
    return _SumAfter(work, received, output)  # type: ignore[return-value]
