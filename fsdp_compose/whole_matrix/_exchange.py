"""Moving whole matrices to their owner ranks and their results back.

[Note: owner compute for whole-matrix optimizers]
A parameter sharded by ``fully_shard`` is a ``Shard(0)`` DTensor: each rank of
the shard group holds a block of rows (``torch.chunk`` layout, so the last ranks
may hold fewer rows or none). An update that needs the whole matrix (Muon's
Newton–Schulz orthogonalization, a Shampoo preconditioner) runs once per matrix,
on one *owner* rank of the shard group:

* Owners are chosen by longest-processing-time-first on the cost ``m·n·min(m, n)``
  (the flops of a Newton–Schulz iteration), the same on every rank because it
  depends on shapes only.
* Matrices move in *rounds*: round ``b`` holds every owner's next matrices
  (heaviest first), up to ``ROUND_NUMEL`` elements per owner (at least one
  matrix). One ``all_to_all_single`` gathers the round's matrices, each to its
  owner (with one matrix per owner the rows arrive in rank order, so the receive
  buffer *is* the full matrix), and one ``all_to_all_single`` sends each rank
  its rows of the results. Each matrix crosses the network once each way:
  ``2·(W-1)/W`` of its bytes in the exchange's dtype.
* The gather of round ``b+1`` and the return of round ``b`` are in flight while
  the owner computes round ``b``. A rank therefore holds the full matrices of at
  most two rounds (``2·ROUND_NUMEL`` elements, or two matrices where one alone is
  larger) and the results of two, plus the function's temporaries.
* HSDP: owners are chosen within each shard group; every replica group repeats
  the same work on its identical data, which costs no communication across
  replicas (the alternative, splitting the owners over all ranks, would need the
  results broadcast over the replicate dimension).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .. import _compat


@dataclass(frozen=True)
class ShardLayout:
    """Where the rows of a sharded matrix live: ``group`` is the shard group,
    ``rank`` this rank's index in it."""

    group: dist.ProcessGroup | None  # None: not sharded (a plain tensor)
    rank: int
    world: int

    def rows(self, rank: int, m: int) -> tuple[int, int]:
        """Rows ``[start, end)`` of an ``m``-row matrix held by ``rank`` (``torch.chunk``)."""
        per = -(-m // self.world) if m else 0
        return min(m, rank * per), min(m, (rank + 1) * per)


_UNSHARDED = ShardLayout(None, 0, 1)


def layout_of(t: torch.Tensor, what: str) -> ShardLayout:
    """The shard layout of a parameter, or a clear error for layouts the owner
    compute does not handle (tensor parallel on another mesh dimension)."""
    if not isinstance(t, DTensor):
        return _UNSHARDED
    mesh: DeviceMesh = t.device_mesh
    placements = tuple(t.placements)
    sharded = [i for i, pl in enumerate(placements) if not pl.is_replicate()]
    # Exactly Shard(0): _StridedShard (FSDP over tensor parallel) is a Shard subclass.
    rows = [pl for pl in placements if type(pl) is Shard and pl.dim == 0]
    if len(sharded) > 1 or len(rows) != len(sharded):
        raise ValueError(
            f"fsdp_compose: {what} has placements {placements}; whole-matrix optimizers on "
            "sharded parameters need the rows sharded on one mesh dimension (Shard(0), as "
            "fully_shard makes them) and every other mesh dimension Replicate. Tensor-parallel "
            "parameters are not supported: give this optimizer the data-parallel-only matrices "
            "and an elementwise optimizer (AdamW) the tensor-parallel ones."
        )
    if not sharded:
        return _UNSHARDED
    dim = sharded[0]
    layout = ShardLayout(mesh.get_group(dim), mesh.get_local_rank(dim), mesh.size(dim))
    start, end = layout.rows(layout.rank, t.shape[0])
    local = _compat.local_tensor(t)
    if tuple(local.shape) != (end - start, *t.shape[1:]):
        raise ValueError(
            f"fsdp_compose: {what} holds a local shard of shape {tuple(local.shape)} where rows "
            f"[{start}, {end}) of {tuple(t.shape)} were expected (torch.chunk layout)."
        )
    return layout


def lpt_owners(costs: list[float], world: int) -> list[int]:
    """Owner of each item: longest processing time first onto the least-loaded
    rank (ties to the lowest rank), the same on every rank."""
    owners = [0] * len(costs)
    heap = [(0.0, r) for r in range(world)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(heap)
        owners[i] = r
        heapq.heappush(heap, (load + costs[i], r))
    return owners


def newton_schulz_cost(shape: tuple[int, int]) -> float:
    m, n = shape
    return float(m) * n * min(m, n)


TRANSPORT = "a2a"


@dataclass
class ExchangePlan:
    """Owners and the exchange order for ``(m, n)`` matrices sharded with ``layout``.

    ``queues[r]`` lists the matrices rank ``r`` computes, in the order it computes
    them (heaviest first); ``order`` lists every matrix by the cost its owner has
    computed before reaching it (then by owner), which is the order in which the
    owners need them and the order in which every rank prepares its rows.
    """

    layout: ShardLayout
    shapes: list[tuple[int, int]]
    owners: list[int]
    queues: list[list[int]]
    order: list[int]

    @classmethod
    def build(cls, layout: ShardLayout, shapes: list[tuple[int, int]]) -> ExchangePlan:
        costs = [newton_schulz_cost(s) for s in shapes]
        owners = lpt_owners(costs, layout.world)
        queues: list[list[int]] = [[] for _ in range(layout.world)]
        start = [0.0] * len(shapes)  # cost its owner computes before this matrix
        load = [0.0] * layout.world
        for i in sorted(range(len(shapes)), key=lambda i: (-costs[i], i)):
            queues[owners[i]].append(i)
            start[i] = load[owners[i]]
            load[owners[i]] += costs[i]
        order = sorted(range(len(shapes)), key=lambda i: (start[i], owners[i], i))
        return cls(layout, shapes, owners, queues, order)

    def _numel(self, rank: int, i: int) -> int:
        m, n = self.shapes[i]
        start, end = self.layout.rows(rank, m)
        return (end - start) * n

    def exchanged_bytes(self, dtype: torch.dtype) -> int:
        """Bytes this rank sends to other ranks in one :meth:`run` (both ways)."""
        me, world = self.layout.rank, self.layout.world
        total = 0
        for i, owner in enumerate(self.owners):
            if owner == me:  # results back to the other ranks
                total += sum(self._numel(r, i) for r in range(world) if r != me)
            else:  # my rows to the owner
                total += self._numel(me, i)
        return total * torch.empty((), dtype=dtype).element_size()

    def run(
        self,
        fill: Callable[[int, torch.Tensor], None],
        compute: Callable[[int, torch.Tensor], torch.Tensor],
        consume: Callable[[int, torch.Tensor], None],
        *,
        comm_dtype: torch.dtype,
        result_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """For each matrix ``i``: ``compute(i, full)`` on its owner, where ``full``
        is the ``(m, n)`` matrix whose rows every rank wrote with ``fill(i, rows)``
        (``rows``: a contiguous ``comm_dtype`` tensor to overwrite with its local
        rows); then ``consume(i, rows)`` on every rank with its rows of the result
        (``result_dtype``). ``fill`` is called once per matrix this rank holds rows
        of, in :attr:`order`. See [Note: owner compute for whole-matrix optimizers]."""
        if self.layout.group is None or self.layout.world == 1:
            for i in range(len(self.shapes)):
                full = torch.empty(self.shapes[i], dtype=comm_dtype, device=device)
                fill(i, full)
                consume(i, compute(i, full).to(result_dtype))
            return
        if TRANSPORT == "p2p":
            _Exchange(self, fill, comm_dtype, result_dtype, device).run(compute, consume)
        else:
            self._run_rounds(fill, compute, consume, comm_dtype, result_dtype, device)

    def _run_rounds(
        self,
        fill: Callable[[int, torch.Tensor], None],
        compute: Callable[[int, torch.Tensor], torch.Tensor],
        consume: Callable[[int, torch.Tensor], None],
        comm_dtype: torch.dtype,
        result_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        layout, me, world = self.layout, self.layout.rank, self.layout.world
        depth = max(len(q) for q in self.queues)
        rounds = [[q[b] if b < len(q) else -1 for q in self.queues] for b in range(depth)]

        def numel(rank: int, i: int) -> int:
            return self._numel(rank, i) if i >= 0 else 0

        def a2a(
            out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
        ) -> dist.Work:
            work = dist.all_to_all_single(
                out, inp, out_splits, in_splits, group=layout.group, async_op=True
            )
            assert work is not None
            return work

        def post_gather(rnd: list[int]) -> tuple[dist.Work, torch.Tensor, torch.Tensor]:
            to_owner = [numel(me, i) for i in rnd]
            from_rank = [numel(r, rnd[me]) for r in range(world)]
            send = torch.empty(sum(to_owner), dtype=comm_dtype, device=device)
            offset = 0
            for i, count in zip(rnd, to_owner):
                if count:
                    fill(i, send[offset : offset + count].view(-1, self.shapes[i][1]))
                    offset += count
            recv = torch.empty(sum(from_rank), dtype=comm_dtype, device=device)
            return a2a(recv, send, from_rank, to_owner), recv, send

        def post_return(
            rnd: list[int], result: torch.Tensor | None
        ) -> tuple[dist.Work, torch.Tensor, torch.Tensor]:
            to_rank = [numel(r, rnd[me]) for r in range(world)]
            from_owner = [numel(me, i) for i in rnd]
            send = (
                result.view(-1)
                if result is not None
                else torch.empty(0, dtype=result_dtype, device=device)
            )
            back = torch.empty(sum(from_owner), dtype=result_dtype, device=device)
            return a2a(back, send, from_owner, to_rank), back, send

        def finish_return(
            pending: tuple[dist.Work, torch.Tensor, torch.Tensor], rnd: list[int]
        ) -> None:
            work, back, _ = pending
            work.wait()
            offset = 0
            for i in rnd:
                count = numel(me, i)
                if count:
                    consume(i, back[offset : offset + count].view(-1, self.shapes[i][1]))
                    offset += count

        gathering = post_gather(rounds[0]) if rounds else None
        returning = None
        for b, rnd in enumerate(rounds):
            assert gathering is not None
            work, recv, _ = gathering
            work.wait()
            gathering = post_gather(rounds[b + 1]) if b + 1 < len(rounds) else None
            result = None
            if rnd[me] >= 0:
                result = compute(rnd[me], recv.view(self.shapes[rnd[me]])).to(result_dtype)
                result = result.contiguous()
            del recv, work
            pending = post_return(rnd, result)
            if returning is not None:
                finish_return(*returning)
            returning = (pending, rnd)
        if returning is not None:
            finish_return(*returning)


class _Exchange:
    """One :meth:`ExchangePlan.run` on a shard group of several ranks: point-to-point
    messages straight into and out of the full matrices' row blocks."""

    def __init__(
        self,
        plan: ExchangePlan,
        fill: Callable[[int, torch.Tensor], None],
        comm_dtype: torch.dtype,
        result_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.plan, self.fill, self.device = plan, fill, device
        self.comm_dtype, self.result_dtype = comm_dtype, result_dtype
        self.group = plan.layout.group
        self.me = plan.layout.rank
        self.position = {i: k for k, i in enumerate(plan.order)}
        self.prepared = 0  # plan.order[:prepared] are filled and posted
        # My matrices: the full input and its receives from the other ranks.
        self.inputs: dict[int, tuple[torch.Tensor, list[dist.Work]]] = {}
        # Other owners' matrices, by position: (i, my rows and their send, the
        # result's rows and their receive).
        self.awaiting: deque[tuple[int, torch.Tensor, dist.Work, torch.Tensor, dist.Work]] = deque()

    def _rows(self, rank: int, i: int) -> tuple[int, int]:
        return self.plan.layout.rows(rank, self.plan.shapes[i][0])

    def _prepare(self, i: int) -> None:
        """Fills my rows of matrix ``i`` and posts their exchange: the receives of
        the other rows into the full matrix (I own it), or the send of my rows to
        its owner and the receive of my rows of its result (another rank owns it)."""
        plan, me = self.plan, self.me
        m, n = plan.shapes[i]
        start, end = self._rows(me, i)
        owner = plan.owners[i]
        if owner == me:
            full = torch.empty((m, n), dtype=self.comm_dtype, device=self.device)
            if end > start:
                self.fill(i, full[start:end])
            works = []
            for r in range(plan.layout.world):
                r_start, r_end = self._rows(r, i)
                if r != me and r_end > r_start:
                    works.append(self._post(dist.irecv, full[r_start:r_end], r, 2 * i))
            self.inputs[i] = (full, works)
        elif end > start:
            rows = torch.empty((end - start, n), dtype=self.comm_dtype, device=self.device)
            self.fill(i, rows)
            sent = self._post(dist.isend, rows, owner, 2 * i)
            back = torch.empty((end - start, n), dtype=self.result_dtype, device=self.device)
            received = self._post(dist.irecv, back, owner, 2 * i + 1)
            self.awaiting.append((i, rows, sent, back, received))

    def _post(
        self, op: Callable[..., dist.Work | None], t: torch.Tensor, peer: int, tag: int
    ) -> dist.Work:
        kw = {"group_src": peer} if op is dist.irecv else {"group_dst": peer}
        work = op(t, group=self.group, tag=tag, **kw)
        assert work is not None
        return work

    def _prepare_through(self, position: int) -> None:
        order = self.plan.order
        while self.prepared <= min(position, len(order) - 1):
            self._prepare(order[self.prepared])
            self.prepared += 1

    def _consume_before(self, position: int, consume: Callable[[int, torch.Tensor], None]) -> None:
        """Applies the results of other owners' matrices placed before ``position``."""
        while self.awaiting and self.position[self.awaiting[0][0]] < position:
            i, _, sent, back, received = self.awaiting.popleft()
            sent.wait()
            received.wait()
            consume(i, back)

    def run(
        self,
        compute: Callable[[int, torch.Tensor], torch.Tensor],
        consume: Callable[[int, torch.Tensor], None],
    ) -> None:
        plan, me = self.plan, self.me
        mine = plan.queues[me]
        returning: list[dist.Work] = []
        result: torch.Tensor | None = None
        for k, i in enumerate(mine):
            # Prepare up to my next matrix: the receives of its rows then overlap
            # with this one's compute, and every rank gets my rows of the matrices
            # its owner needs before then. Every rank has prepared through a
            # matrix's position before it waits on that matrix (no deadlock).
            after = self.position[mine[k + 1]] if k + 1 < len(mine) else len(plan.order)
            self._prepare_through(after)
            full, works = self.inputs.pop(i)
            for work in works:
                work.wait()
            out = compute(i, full).to(self.result_dtype)
            del full
            if not out.is_contiguous():
                out = out.contiguous()
            for work in returning:  # the previous result's sends (receives were posted early)
                work.wait()
            result, returning = out, []
            for r in range(plan.layout.world):
                start, end = self._rows(r, i)
                if r != me and end > start:
                    returning.append(self._post(dist.isend, result[start:end], r, 2 * i + 1))
            start, end = self._rows(me, i)
            if end > start:
                consume(i, result[start:end])
            # Results of matrices placed before my previous one are most likely here.
            self._consume_before(self.position[mine[k - 1]] if k else 0, consume)
        self._prepare_through(len(plan.order))
        self._consume_before(len(plan.order), consume)
        for work in returning:
            work.wait()
