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


#: Elements of full matrices one owner receives per round (2 MiB in bfloat16): a
#: round holds an owner's next matrices up to this size (at least one matrix).
ROUND_NUMEL = 1 << 20


@dataclass
class ExchangePlan:
    """Owners and rounds for a list of ``(m, n)`` matrices sharded with ``layout``."""

    layout: ShardLayout
    shapes: list[tuple[int, int]]
    owners: list[int]
    rounds: list[list[list[int]]]  # rounds[b][owner] = the matrices that owner computes in round b

    @classmethod
    def build(
        cls, layout: ShardLayout, shapes: list[tuple[int, int]], round_numel: int | None = None
    ) -> ExchangePlan:
        budget = ROUND_NUMEL if round_numel is None else round_numel
        owners = lpt_owners([newton_schulz_cost(s) for s in shapes], layout.world)
        chunks: list[list[list[int]]] = [[] for _ in range(layout.world)]
        for i in sorted(range(len(shapes)), key=lambda i: (-newton_schulz_cost(shapes[i]), i)):
            mine = chunks[owners[i]]
            numel = shapes[i][0] * shapes[i][1]
            if not mine or sum(shapes[j][0] * shapes[j][1] for j in mine[-1]) + numel > budget:
                mine.append([])
            mine[-1].append(i)
        depth = max((len(x) for x in chunks), default=0)
        rounds = [[(x[b] if b < len(x) else []) for x in chunks] for b in range(depth)]
        return cls(layout, shapes, owners, rounds)

    def _numel(self, rank: int, i: int) -> int:
        m, n = self.shapes[i]
        start, end = self.layout.rows(rank, m)
        return (end - start) * n

    def _split(self, rank: int, matrices: list[int]) -> int:
        return sum(self._numel(rank, i) for i in matrices)

    def exchanged_bytes(self, dtype: torch.dtype) -> int:
        """Bytes this rank sends to other ranks in one :meth:`run` (both ways)."""
        me, size = self.layout.rank, torch.empty((), dtype=dtype).element_size()
        total = 0
        for rnd in self.rounds:
            total += sum(self._split(me, owned) for r, owned in enumerate(rnd) if r != me)
            total += sum(self._split(r, rnd[me]) for r in range(self.layout.world) if r != me)
        return total * size

    def run(
        self,
        local_rows: Callable[[int], torch.Tensor],
        compute: Callable[[int, torch.Tensor], torch.Tensor],
        consume: Callable[[int, torch.Tensor], None],
        *,
        comm_dtype: torch.dtype,
        result_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """For each matrix ``i``: ``compute(i, full)`` on its owner, where ``full``
        is the row-wise concatenation of every rank's ``local_rows(i)`` cast to
        ``comm_dtype``; then ``consume(i, rows)`` on every rank with its rows of
        the result (``result_dtype``). ``local_rows`` is called once per matrix
        this rank holds rows of. See [Note: owner compute for whole-matrix
        optimizers]."""
        layout, me, world = self.layout, self.layout.rank, self.layout.world
        if layout.group is None or world == 1:
            for i in range(len(self.shapes)):
                rows = local_rows(i).to(comm_dtype, copy=True)  # compute may work in place
                consume(i, compute(i, rows).to(result_dtype))
            return

        def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(numel, dtype=dtype, device=device)

        # Send buffers stay referenced until their collective has completed.
        def post_gather(rnd: list[list[int]]) -> tuple[dist.Work, torch.Tensor, torch.Tensor]:
            # To each owner, in rank order: my rows of each matrix it computes.
            pieces = [
                local_rows(i).reshape(-1) for owned in rnd for i in owned if self._numel(me, i)
            ]
            send = torch.cat([p.to(comm_dtype) for p in pieces]) if pieces else empty(0, comm_dtype)
            in_splits = [self._split(me, owned) for owned in rnd]
            out_splits = [self._split(r, rnd[me]) for r in range(world)]
            recv = empty(sum(out_splits), comm_dtype)
            work = dist.all_to_all_single(
                recv, send, out_splits, in_splits, group=layout.group, async_op=True
            )
            assert work is not None
            return work, recv, send

        def full_matrices(recv: torch.Tensor, owned: list[int]) -> list[torch.Tensor]:
            if len(owned) == 1:  # rows arrive in rank order: the buffer is the matrix
                m, n = self.shapes[owned[0]]
                return [recv.view(m, n)]
            parts: list[list[torch.Tensor]] = [[] for _ in owned]
            offset = 0
            for r in range(world):
                for k, i in enumerate(owned):
                    numel = self._numel(r, i)
                    parts[k].append(recv[offset : offset + numel])
                    offset += numel
            return [torch.cat(p).view(self.shapes[i]) for p, i in zip(parts, owned)]

        def post_return(
            rnd: list[list[int]], results: list[torch.Tensor]
        ) -> tuple[dist.Work, torch.Tensor, torch.Tensor]:
            # To each rank, in rank order: its rows of each result computed here.
            pieces = []
            for r in range(world):
                for i, result in zip(rnd[me], results):
                    start, end = layout.rows(r, self.shapes[i][0])
                    pieces.append(result[start:end].reshape(-1))
            send = torch.cat(pieces) if pieces else empty(0, result_dtype)
            out_splits = [self._split(r, rnd[me]) for r in range(world)]
            in_splits = [self._split(me, owned) for owned in rnd]
            back = empty(sum(in_splits), result_dtype)
            work = dist.all_to_all_single(
                back, send, in_splits, out_splits, group=layout.group, async_op=True
            )
            assert work is not None
            return work, back, send

        def finish_return(
            pending: tuple[dist.Work, torch.Tensor, torch.Tensor], rnd: list[list[int]]
        ) -> None:
            work, back, _ = pending
            work.wait()
            offset = 0
            for owned in rnd:
                for i in owned:
                    numel = self._numel(me, i)
                    consume(
                        i,
                        back[offset : offset + numel].view(
                            numel // self.shapes[i][1], self.shapes[i][1]
                        ),
                    )
                    offset += numel

        gathering = post_gather(self.rounds[0]) if self.rounds else None
        returning: tuple[tuple[dist.Work, torch.Tensor, torch.Tensor], list[list[int]]] | None = (
            None
        )
        for b, rnd in enumerate(self.rounds):
            assert gathering is not None
            work, recv, _ = gathering
            work.wait()
            gathering = post_gather(self.rounds[b + 1]) if b + 1 < len(self.rounds) else None
            results = [
                compute(i, full).to(result_dtype).contiguous()
                for i, full in zip(rnd[me], full_matrices(recv, rnd[me]))
            ]
            del recv, work
            pending = post_return(rnd, results)
            if returning is not None:
                finish_return(*returning)
            returning = (pending, rnd)
        if returning is not None:
            finish_return(*returning)
