"""Moving whole matrices to their owner ranks and their results back.

[Note: owner compute for whole-matrix optimizers]
A parameter sharded by ``fully_shard`` is a ``Shard(0)`` DTensor: each rank of
the shard group holds a block of rows (``torch.chunk`` layout, so the last ranks
may hold fewer rows or none). An update that needs the whole matrix (Muon's
Newton–Schulz orthogonalization, a Shampoo preconditioner) runs once per matrix,
on one *owner* rank of the shard group:

* Owners are chosen by longest-processing-time-first on the cost ``m·n·min(m, n)``
  (the flops of a Newton–Schulz iteration) plus, for a tall matrix, the extra
  passes of its transposed view (:data:`TALL_EXTRA` per element), the same on
  every rank because it depends on shapes only. Without that term, LPT gives
  every tall ``(4d, d)`` matrix of a transformer to one rank and every wide
  ``(d, 4d)`` one to another (equal flops, ties to the lowest rank), and the
  first does more work: a strided first iteration and a transposed copy of
  each result.
* Matrices move in *rounds*: round ``b`` holds every owner's next matrices
  (heaviest first), up to ``ROUND_NUMEL`` elements per owner (at least one
  matrix). One ``all_to_all_single`` gathers the round's matrices, each to its
  owner, and one sends each rank its rows of the results: two collectives per
  round. Each matrix crosses the network once each way: ``2·(W-1)/W`` of its
  bytes in the exchange's dtype.
* Copies: a rank's own rows never enter the collectives (their split is 0): it
  writes them (the caller's ``fill``, e.g. Muon's Nesterov ``lerp`` rounding
  straight to bfloat16) into its own full matrix, and applies its rows of its
  own results from the result itself. The rows for other owners are written in
  place into the send buffer. The owner copies the other ranks' rows from the
  receive buffer into the full matrix and its results' rows into the return's
  send buffer, except where those rows form one block of a round's only
  matrix (this rank's rows first or last, as always at ``W=2``): then the
  block of the full matrix *is* the receive buffer and the block of the
  result the send buffer, which saves copies against concatenating every piece.
* The gather of round ``b+1`` is posted before round ``b``'s is waited for (its
  rows are written while round ``b``'s travel) and is in flight while the owner
  computes round ``b``; the return of round ``b`` is in flight while it computes
  round ``b+1``. Each round's splits, offsets and row ranges are computed once
  per plan (:class:`_Round`), so a step's Python only walks lists.
* Memory, beyond the shards and the optimizer state, in the exchange's dtype
  (bfloat16 for Muon), with ``R = max(ROUND_NUMEL, largest m·n)``: at its peak
  (after posting round ``b``'s return, before applying round ``b-1``'s) a rank
  holds round ``b+1``'s full inputs, receive and send buffers, and for rounds
  ``b`` and ``b-1`` each the results, the return's send buffer and the returned
  rows: nine buffers, each at most ``R`` (a row buffer holds about ``1/W`` of
  ``W`` owners' rounds); while it waits for round ``b``'s gather, round ``b``'s
  and ``b+1``'s inputs, receive and send buffers and round ``b-1``'s return:
  nine again. So at most ``9·R`` elements (36 MiB in bfloat16 at the default
  ``ROUND_NUMEL`` when no matrix exceeds 2^21 elements; fewer where a send
  buffer is a view of the result), plus the computation's inputs and
  temporaries while it runs (round ``b``'s inputs, ``≤ R``; for Newton–Schulz
  the Gram matrix and its polynomial, ``min(m, n)²`` each, and the next
  iterate, ``m·n``). Buffers are reused from step to step (see [Note:
  exchange buffers are reused]): between steps a rank keeps at most ``9·R``
  elements of them (the pool's limit, which a step's buffers fit in), and
  during a step the pool's free buffers come on top of the live ones above
  (at most ``9·R`` more; in steady state a step takes back what the previous
  one gave).
* Why rounds of this size: on gloo a collective costs more than the copies it
  saves, so these rounds beat one matrix per owner and round with no copy at
  all (more rounds), point-to-point ``isend``/``irecv`` straight into each
  matrix's row blocks (more messages and wake-ups; ``send`` on the calling
  thread waits on gloo's I/O thread) and smaller rounds (the overlap saves less
  than the extra collectives cost). BENCHMARKS.md has the measurements.
* HSDP: owners are chosen within each shard group; every replica group repeats
  the same work on its identical data, which costs no communication across
  replicas (the alternative, splitting the owners over all ranks, would need the
  results broadcast over the replicate dimension).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .. import _runtime as runtime
from .. import _tool_compat
from ._agree import RoundOutcomes


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
    local = runtime.local_tensor(t)
    if tuple(local.shape) != (end - start, *t.shape[1:]):
        raise ValueError(
            f"fsdp_compose: {what} holds a local shard of shape {tuple(local.shape)} where rows "
            f"[{start}, {end}) of {tuple(t.shape)} were expected (torch.chunk layout)."
        )
    return layout


class Layouts:
    """Parameters' layouts, each worked out (mesh lookups: too slow for every step)
    once per parameter and spec: a DTensor's spec is replaced, not mutated, when
    its mesh, placements or shape change. Holds one entry per parameter seen
    (by id), pruned to the parameters of the latest :meth:`prune`."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[Any, torch.Size, ShardLayout]] = {}

    def __len__(self) -> int:
        return len(self._known)

    def of(self, p: DTensor, what: str) -> ShardLayout:
        spec, local_shape = _tool_compat.dtensor_spec(p), runtime.local_tensor(p).shape
        known = self._known.get(id(p))
        if known is None or known[0] is not spec or known[1] != local_shape:
            known = self._known[id(p)] = (spec, local_shape, layout_of(p, what))
        return known[2]

    def prune(self, live: set[int]) -> None:
        """Forgets parameters not in ``live`` (ids) once there are many of them."""
        if len(self._known) > 2 * len(live) + 16:
            self._known = {k: v for k, v in self._known.items() if k in live}


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


#: Extra cost of a tall matrix (``m > n``) per element, in the units of
#: :func:`newton_schulz_cost`: Newton-Schulz iterates on its transposed view (a
#: strided first iteration) and its result is copied into rows. Measured on one
#: CPU thread (bfloat16, ``(1536, 384)`` against ``(384, 1536)``): 15% more
#: time, about 57 units per element.
TALL_EXTRA = 64


def newton_schulz_cost(shape: tuple[int, int]) -> float:
    """Relative time of Newton–Schulz on an ``(m, n)`` matrix: ``m·n·min(m, n)``
    (the flops of an iteration), plus the transposed view's extra passes for a
    tall matrix (see :data:`TALL_EXTRA`), which LPT would otherwise pile up on one
    rank when tall and wide matrices of the same flops alternate."""
    m, n = shape
    cost = float(m) * n * min(m, n)
    if m > n:
        cost += TALL_EXTRA * m * n
    return cost


#: Elements of full matrices one owner receives per round (4 MiB in bfloat16): a
#: round holds an owner's next matrices up to this size (at least one matrix).
#: Fewer, larger rounds: on gloo each collective costs CPU of its own (see
#: [Note: owner compute for whole-matrix optimizers]).
ROUND_NUMEL = 1 << 21


@dataclass
class ExchangePlan:
    """Owners and rounds for ``(m, n)`` matrices sharded with ``layout``:
    ``rounds[b][r]`` lists the matrices rank ``r`` computes in round ``b``
    (heaviest first)."""

    layout: ShardLayout
    shapes: list[tuple[int, int]]
    owners: list[int]
    rounds: list[list[list[int]]]
    _rounds_cache: list[_Round] | None = field(default=None, repr=False, compare=False)
    pool: BufferPool = field(default_factory=lambda: BufferPool(), repr=False, compare=False)

    @classmethod
    def build(
        cls, layout: ShardLayout, shapes: list[tuple[int, int]], round_numel: int | None = None
    ) -> ExchangePlan:
        budget = ROUND_NUMEL if round_numel is None else round_numel
        costs = [newton_schulz_cost(s) for s in shapes]
        owners = lpt_owners(costs, layout.world)
        chunks: list[list[list[int]]] = [[] for _ in range(layout.world)]
        for i in sorted(range(len(shapes)), key=lambda i: (-costs[i], i)):
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
        me, world = self.layout.rank, self.layout.world
        total = 0
        for i, owner in enumerate(self.owners):
            if owner == me:  # results back to the other ranks
                total += sum(self._numel(r, i) for r in range(world) if r != me)
            else:  # my rows to the owner
                total += self._numel(me, i)
        return total * torch.empty((), dtype=dtype).element_size()

    def _others_block(self, i: int) -> tuple[int, int] | None:
        """Element range of matrix ``i`` that the other ranks' rows fill, when they
        are one contiguous block (this rank's rows at an end, or none)."""
        layout, me = self.layout, self.layout.rank
        m, n = self.shapes[i]
        start, end = layout.rows(me, m)
        if start == end or start == 0:
            return (end * n, m * n) if start == 0 else (0, m * n)
        return (0, start * n) if end == m else None

    def _schedule(self) -> list[_Round]:
        """Each round's splits, offsets and row ranges, computed once per plan (a
        step's Python then only walks these lists)."""
        if self._rounds_cache is None:
            self._rounds_cache = [self._round(rnd) for rnd in self.rounds]
            # Nine rounds' worth of free buffers (see [Note: exchange buffers are reused]).
            sizes = [
                sum(self.shapes[i][0] * self.shapes[i][1] for i in x)
                for r in self.rounds
                for x in r
            ]
            self.pool.limit = 9 * max(sizes, default=0)
        return self._rounds_cache

    def _round(self, rnd: list[list[int]]) -> _Round:
        layout, me, world = self.layout, self.layout.rank, self.layout.world
        others = [r for r in range(world) if r != me]
        mine = rnd[me]
        # Gather: to each other owner, in rank order, my rows of its matrices; the
        # return brings my rows of the results back in the same layout.
        to_owner = [0 if r == me else self._split(me, rnd[r]) for r in range(world)]
        from_rank = [0 if r == me else self._split(r, mine) for r in range(world)]
        my_rows: list[tuple[int, int, int, int]] = []
        offset = 0
        for r in others:
            for i in rnd[r]:
                numel = self._numel(me, i)
                if numel:
                    my_rows.append((i, offset, numel, self.shapes[i][1]))
                    offset += numel
        own: list[tuple[int, int, int, int]] = []
        for k, i in enumerate(mine):
            start, end = layout.rows(me, self.shapes[i][0])
            if end > start:
                own.append((k, i, start, end))
        # The other ranks' rows of my matrices, in the receive (and return) layout.
        others_rows: list[tuple[int, int, int, int, int]] = []
        offset = 0
        for r in others:
            for k, i in enumerate(mine):
                start, end = layout.rows(r, self.shapes[i][0])
                numel = (end - start) * self.shapes[i][1]
                if numel:
                    others_rows.append((k, start, end, offset, numel))
                    offset += numel
        block = self._others_block(mine[0]) if len(mine) == 1 else None
        shapes = [self.shapes[i] for i in mine]
        total = sum(self.shapes[i][0] * self.shapes[i][1] for x in rnd for i in x)
        return _Round(mine, shapes, to_owner, from_rank, my_rows, own, others_rows, block, total)

    def run(
        self,
        fill: Callable[[int, torch.Tensor], None],
        compute: Callable[[int, torch.Tensor], torch.Tensor],
        consume: Callable[[int, torch.Tensor], None],
        *,
        comm_dtype: torch.dtype,
        result_dtype: torch.dtype,
        device: torch.device,
        recycle_inputs: bool = False,
        describe: Callable[[int], str] | None = None,
        comms: runtime.ToolCollectives | None = None,
    ) -> None:
        """For each matrix ``i``: ``compute(i, full)`` on its owner, where ``full``
        is the ``(m, n)`` matrix whose rows every rank wrote with ``fill(i, rows)``
        (``rows``: a contiguous ``comm_dtype`` tensor to overwrite with its local
        rows); then ``consume(i, rows)`` on every rank with its rows of the result
        (``result_dtype``). ``fill`` is called once per matrix this rank holds rows
        of, round by round. See [Note: owner compute for whole-matrix optimizers].
        ``recycle_inputs``: ``compute`` keeps no reference to
        ``full`` (other than through its result), so the buffer is reused
        afterwards (see [Note: exchange buffers are reused]). If ``compute`` raises
        on an owner, every rank raises after the exchange, naming the matrix with
        ``describe(i)`` (see [Note: a failing computation on its owner]).
        ``comms``: the collectives, on the layout's group, labelled with the caller's
        operation (default: ``whole_matrix.exchange``, reported to no root)."""
        layout = self.layout
        if layout.group is None or layout.world == 1:
            for i in range(len(self.shapes)):
                full = torch.empty(self.shapes[i], dtype=comm_dtype, device=device)
                fill(i, full)
                consume(i, compute(i, full).to(result_dtype))
            return

        comms = comms or runtime.ToolCollectives("whole_matrix.exchange", layout.group)
        run = _Exchange(self, comms, fill, consume, comm_dtype, result_dtype, device)
        # See [Note: a failing computation on its owner].
        outcomes = RoundOutcomes(comms, layout.rank, layout.world, device)
        rounds = self._schedule()
        gathering = run.post_gather(rounds[0]) if rounds else None
        returning: tuple[_Round, _Pending, _Posted] | None = None
        for b, rnd in enumerate(rounds):
            assert gathering is not None
            # The next round's gather is posted before this round's is waited for:
            # its rows are written while this round's travel, and it runs while
            # this round computes.
            current = gathering
            gathering = run.post_gather(rounds[b + 1]) if b + 1 < len(rounds) else None
            fulls = run.assemble(rnd, current)
            del current  # this round's send and receive buffers
            results = [
                outcomes.compute(compute, i, full, self.shapes[i], result_dtype)
                for i, full in zip(rnd.mine, fulls)
            ]
            # Inputs go back to the pool unless a result is (a view of) its input.
            for full, result in zip(fulls, results) if recycle_inputs else ():
                if result.untyped_storage().data_ptr() != full.untyped_storage().data_ptr():
                    self.pool.give(full)
            del fulls
            posted = outcomes.post(rnd.mine)
            pending = run.post_return(rnd, results)
            for k, i, start, end in rnd.own:  # my rows, while the others' travel
                if i not in outcomes.errors:
                    consume(i, results[k][start:end])
            if returning is not None:
                run.finish_return(*returning[:2], outcomes.failed_owners(returning[2]))
            returning = (rnd, pending, posted)
        if returning is not None:
            run.finish_return(*returning[:2], outcomes.failed_owners(returning[2]))
        outcomes.raise_if_any(describe or (lambda i: f"matrix {i} (shape {self.shapes[i]})"))


@dataclass(frozen=True)
class _Round:
    """One round of an :class:`ExchangePlan` as this rank runs it (offsets in
    elements of the flat send and receive buffers)."""

    mine: list[int]  # the matrices this rank computes, and their shapes
    shapes: list[tuple[int, int]]
    to_owner: list[int]  # gather splits: my rows to each rank (the return's receive)
    from_rank: list[int]  # gather splits: each rank's rows of mine (the return's send)
    my_rows: list[tuple[int, int, int, int]]  # (matrix, offset, numel, columns)
    own: list[tuple[int, int, int, int]]  # (index in mine, matrix, first row, end row)
    others_rows: list[tuple[int, int, int, int, int]]  # (index in mine, rows, offset, numel)
    block: tuple[int, int] | None  # a single matrix's other rows: received in place
    total: int  # elements of every owner's matrices of the round (the same on every rank)


_Pending = tuple[runtime.PendingCollective, list[torch.Tensor], list[torch.Tensor]]
_Posted = tuple[torch.Tensor, runtime.PendingCollective]


class _Exchange:
    """The collectives of one :meth:`ExchangePlan.run`: each round's gather to the
    owners and return of the results, on buffers from the plan's pool."""

    def __init__(
        self,
        plan: ExchangePlan,
        comms: runtime.ToolCollectives,
        fill: Callable[[int, torch.Tensor], None],
        consume: Callable[[int, torch.Tensor], None],
        comm_dtype: torch.dtype,
        result_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.plan, self.pool, self.comms = plan, plan.pool, comms
        self.fill, self.consume = fill, consume
        self.comm_dtype, self.result_dtype, self.device = comm_dtype, result_dtype, device

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.pool.take(numel, dtype, self.device)

    def all_to_all(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        total: int,
    ) -> runtime.PendingCollective:
        # This rank's own rows never go through the collective (split 0). ``total``:
        # the elements of the round's matrices, the same on every rank.
        return self.comms.all_to_all_single(out, inp, out_splits, in_splits, total_numel=total)

    def post_gather(self, rnd: _Round) -> _Pending:
        fill, comm_dtype = self.fill, self.comm_dtype
        fulls = [self.empty(m * n, comm_dtype).view(m, n) for m, n in rnd.shapes]
        send = self.empty(sum(rnd.to_owner), comm_dtype)
        for i, offset, numel, n in rnd.my_rows:  # written in place
            fill(i, send[offset : offset + numel].view(-1, n))
        if rnd.block is not None:  # the other ranks' rows land in place
            recv = fulls[0].view(-1)[rnd.block[0] : rnd.block[1]]
        else:
            recv = self.empty(sum(rnd.from_rank), comm_dtype)
        work = self.all_to_all(recv, send, rnd.from_rank, rnd.to_owner, rnd.total)
        # My rows straight into my matrices, while the others' arrive (other memory).
        for k, i, start, end in rnd.own:
            fill(i, fulls[k][start:end])
        return work, [recv, *fulls], [send]

    def assemble(self, rnd: _Round, pending: _Pending) -> list[torch.Tensor]:
        work, (recv, *fulls), (send,) = pending
        work.wait()
        if rnd.block is None:
            for k, start, end, offset, numel in rnd.others_rows:
                fulls[k][start:end].view(-1).copy_(recv[offset : offset + numel])
            self.pool.give(recv)
        self.pool.give(send)
        return fulls

    def post_return(self, rnd: _Round, results: list[torch.Tensor]) -> _Pending:
        if rnd.block is not None:  # the other ranks' rows of the result, in place
            send = results[0].view(-1)[rnd.block[0] : rnd.block[1]]
        else:
            send = self.empty(sum(rnd.from_rank), self.result_dtype)
            for k, start, end, offset, numel in rnd.others_rows:
                send[offset : offset + numel].view(-1, results[k].size(1)).copy_(
                    results[k][start:end]
                )
        back = self.empty(sum(rnd.to_owner), self.result_dtype)
        pending = self.all_to_all(back, send, rnd.to_owner, rnd.from_rank, rnd.total)
        return pending, [back], [send, *results]

    def finish_return(self, rnd: _Round, pending: _Pending, failed: set[int]) -> None:
        """Applies my rows of the round's results, except those of ``failed`` owners."""
        work, (back,), (send, *_) = pending
        work.wait()
        owners = self.plan.owners
        for i, offset, numel, n in rnd.my_rows:
            if not failed or owners[i] not in failed:
                self.consume(i, back[offset : offset + numel].view(-1, n))
        self.pool.give(back)
        if rnd.block is None:
            self.pool.give(send)


class BufferPool:
    """Flat buffers kept from one step to the next, by size, dtype and device.

    [Note: exchange buffers are reused]
    Each step needs the same buffers (full matrices, send, receive and return
    rows, and Newton–Schulz's Gram matrix, polynomial and iterates) in the same
    sizes. Freshly allocated on the CPU, a buffer of a few hundred KiB or more
    comes from ``mmap`` or from heap memory that ``malloc`` gave back to the
    system after the previous step, and is paid for again in page faults on
    some ranks, depending on the heap's layout. Taken from this pool,
    a buffer is one the previous step used. A buffer goes back to the pool only
    once nothing reads or writes it any more (after the collective that used it
    has been waited for; a full matrix only where the caller says its
    computation keeps no reference to it, as Muon's Newton–Schulz does not:
    ``map_full_matrices`` leaves the inputs it hands to user code alone). The pool keeps at most ``limit`` elements of free
    buffers (a buffer given back beyond that is freed); the exchange sets it to
    nine rounds' worth, ``9·R`` (see the memory bound in [Note: owner compute
    for whole-matrix optimizers]), which a step's buffers fit in.
    """

    def __init__(self, limit: int = 0) -> None:
        self.limit = limit
        self._held = 0
        self._free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D buffer of ``numel`` elements, uninitialized."""
        free = self._free.get((numel, dtype, device))
        if free:
            self._held -= numel
            return free.pop()
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, t: torch.Tensor) -> None:
        """Gives back ``t`` (or the buffer it views), taken with :meth:`take`."""
        base = t if t._base is None else t._base
        if self._held + base.numel() > self.limit:
            return
        self._held += base.numel()
        self._free.setdefault((base.numel(), base.dtype, base.device), []).append(base)
