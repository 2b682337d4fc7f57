"""The step's allocation sequence that the glibc heap model replays.

See [Note: resident memory under glibc's default allocator] in ``_heap.py``:
the storages the model's traced forward and backward allocate and free, with
fsdp_compose's own buffers (all-gather outputs, unsharded parameters, gradient
packing and reduce-scatter buffers, optimizer temporaries) inserted at the unit
boundaries in the order the runtime allocates them, and activation
checkpointing's recomputation rewritten into the sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._host_memory import MIN_BYTES
from ._policy import ShardingPlan
from ._profile import ModelProfile

if TYPE_CHECKING:
    from ._estimate import _Unit


def step_events(
    units: list[_Unit],
    plan: ShardingPlan,
    profile: ModelProfile,
    shard: int,
    *,
    muon_owner_bytes: int,
    adam_like: bool,
    host_buffers: str = "pooled",
    grads_kept: bool = True,
) -> list[tuple[Any, ...]]:
    """The step's allocation sequence: the model's traced storages with
    fsdp_compose's buffers inserted at the unit boundaries
    (``[Note: resident memory under glibc's default allocator]``).
    ``muon_owner_bytes``: what a Muon owner holds in the optimizer step (0 for
    other optimizers); ``adam_like``: the optimizer keeps two states (AdamW's
    temporaries). ``host_buffers``: where fsdp_compose's own buffers are
    (``fsdp_compose.plan.set_host_buffers``): ``"pooled"`` (reused mappings; the
    unsharded storage's pages parked in the pool between reshard and refill),
    ``"mapped"`` (a mapping each) or ``"heap"``. ``grads_kept``: the sharded
    gradients outlive the step (``zero_grad(set_to_none=False)``), so each
    reduce-scatter output is a per-step buffer added to them; else it becomes
    them (counted with the gradients, not here).
    """
    root, blocks = units[0], units[1:]
    by_name = {u.name: u for u in units}
    unit_of = {m: by_name[up.name] for up in plan.units for m in up.modules}
    modules_left = {up.name: len(up.modules) for up in plan.units}
    fwd_index = {u.name: i for i, u in enumerate(blocks)}
    grads_left = {u.name: sum(p.trainable for p in u.profile.params) for u in units}
    grad_keys: dict[str, list[Any]] = {u.name: [] for u in units}
    issued: set[str] = set()  # all-gather output allocated, not yet copied out
    held: set[str] = set()  # unsharded parameters allocated
    post_forward: set[str] = set()
    pending: list[tuple[str, str]] = []
    results: list[tuple[str, str]] = []
    started: set[str] = set()
    out: list[tuple[Any, ...]] = []

    def own(key: Any, nbytes: int) -> tuple[Any, ...]:
        """fsdp_compose's own buffer: from ``MIN_BYTES`` on, outside the heap
        ([Note: per-step host buffers outside the heap] in ``_host_memory.py``)."""
        if host_buffers == "heap" or nbytes < MIN_BYTES:
            return ("a", key, nbytes)
        if host_buffers == "pooled":
            return ("pages" if key[0] == "unsharded" else "pool", key, nbytes)
        return ("map", key, nbytes)

    def gather(u: _Unit) -> None:
        """Issues the all-gather: its output buffer (``W * row``)."""
        if u.name in held or u.name in issued or not u.unsharded:
            return
        size = u.unsharded
        if u.name in post_forward:  # gathers within the post-forward group
            post_forward.discard(u.name)
            out.append(("f", ("post_forward", u.name)))
        issued.add(u.name)
        out.append(own(("gather", u.name), size))

    def wait(u: _Unit) -> None:
        """Copies the gathered rows out into the unsharded parameters' storage."""
        gather(u)
        if u.name in issued:
            issued.discard(u.name)
            held.add(u.name)
            out.append(own(("unsharded", u.name), u.unsharded))
            out.append(("f", ("gather", u.name)))

    def release(u: _Unit) -> None:
        if u.name in held:
            held.discard(u.name)
            out.append(("f", ("unsharded", u.name)))

    def post_backward(u: _Unit) -> None:
        # in the order the real step runs it: reshard, the previous reduction
        # completes, pack (output, gloo's receive buffer), drop the gradients
        nonlocal pending
        out.append(("m", f"reduce {u.name}"))
        release(u)
        out.extend(("f", k) for k in pending)
        pending = []
        packed = ("packed", u.name)
        if u.reduce_row:
            out.append(own(packed, shard * u.reduce_row))
            if shard == 1:  # the packed buffer is the result
                results.append(packed)
            else:  # the outputs are added to the sharded gradients at the end
                # (kept between steps: the first step's outputs, which became them,
                # came from torch.empty, the later steps' come from the pool)
                received, reduced = ("received", u.name), ("reduced", u.name)
                if grads_kept:
                    out.append(own(reduced, u.reduce_row))
                    results.append(reduced)
                # the gloo exchange's receive buffer (``_host_memory.receive_buffer``):
                # from the pool in the pooled mode, else in the heap; at W=2 one row
                nbytes = (1 if shard == 2 else shard) * u.reduce_row
                out.append(
                    own(received, nbytes) if host_buffers == "pooled" else ("a", received, nbytes)
                )
                pending = [packed, received]
        out.extend(("f", k) for k in grad_keys[u.name] if k is not None)
        grad_keys[u.name] = []

    gather(root)
    for b in blocks[: plan.prefetch_depth]:
        gather(b)
    wait(root)
    out.append(("m", "forward, start"))
    checkpointed = {m for up in plan.units if up.checkpoint for m in up.modules}
    for ev in with_recompute(profile.events, checkpointed):
        kind = ev[0]
        if kind in ("a", "f"):
            out.append(ev)
            continue
        u = unit_of.get(ev[1])
        if u is None:
            if kind == "loss":  # the root's pre-backward prefetches the last units
                out.append(("m", "backward, loss"))
                for b in blocks[::-1][: plan.prefetch_depth]:
                    gather(b)
            continue
        if kind == "fp" and u is not root and u.name not in started:
            started.add(u.name)
            out.append(("m", f"forward {u.name}"))
            i = fwd_index[u.name]
            gather(u)
            for nxt in blocks[i + 1 : i + 1 + plan.prefetch_depth]:
                gather(nxt)
            wait(u)
        elif kind == "fo" and u is not root:
            modules_left[u.name] -= 1
            if modules_left[u.name] == 0 and u.reshard is not False:
                if not isinstance(u.reshard, bool):
                    post_forward.add(u.name)
                    out.append(own(("post_forward", u.name), u.unsharded // int(u.reshard)))
                release(u)
        elif kind == "bs" and u is not root:
            out.append(("m", f"backward {u.name}"))
            i = fwd_index[u.name]
            gather(u)
            for prev in reversed(blocks[max(0, i - plan.prefetch_depth) : i]):
                gather(prev)
            wait(u)
        elif kind == "g":
            grad_keys[u.name].append(ev[2])
            grads_left[u.name] -= 1
            if grads_left[u.name] == 0:
                post_backward(u)
    for u in reversed(units):  # units some of whose parameters got no gradient
        if grads_left[u.name] > 0:
            post_backward(u)
    out.extend(("f", k) for k in pending + results)
    for u in units:
        if u.name in issued:
            out.append(("f", ("gather", u.name)))
        release(u)
    out.extend(("f", ("post_forward", name)) for name in post_forward)
    if muon_owner_bytes:
        owner = ("muon owner", "")
        out += [("m", "optimizer step (Muon owner)"), ("a", owner, muon_owner_bytes)]
        out.append(("f", owner))
    if adam_like:
        # torch's (single-tensor, CPU) AdamW: denom = (exp_avg_sq.sqrt() / c).add_(eps)
        # holds two temporaries of the shard at once, one per parameter in turn.
        out.append(("m", "optimizer step"))
        for u in units:
            for i, p in enumerate(u.profile.params):
                if p.trainable:
                    nbytes = p.shard_numel(shard) * p.dtype.itemsize
                    first, second = ("sqrt", u.name, i), ("denom", u.name, i)
                    out += [("a", first, nbytes), ("a", second, nbytes)]
                    out += [("f", first), ("f", second)]
    return out


def with_recompute(events: list[tuple[Any, ...]], checkpointed: set[str]) -> list[tuple[Any, ...]]:
    """The traced step as activation checkpointing runs it for ``checkpointed``
    modules (the trace is taken without it).

    In forward a checkpointed module keeps only its output: what it allocated and
    still held at its end (what autograd saved) is freed there instead of in
    backward. When its backward starts, its forward runs again: the same
    allocations and frees, under new keys; the recomputed output is dropped, and
    the rest lives until the original backward frees it.
    """
    if not checkpointed:
        return events
    first: dict[tuple[str, str], int] = {}
    for i, ev in enumerate(events):
        if ev[0] in ("fp", "fo", "bs") and ev[1] in checkpointed:
            first.setdefault((ev[0], ev[1]), i)
    at_end: dict[int, list[tuple[Any, ...]]] = {}  # after event i: extra events
    renamed: dict[Any, Any] = {}
    for fqn in checkpointed:
        if ("fp", fqn) not in first or ("fo", fqn) not in first or ("bs", fqn) not in first:
            continue
        segment = events[first[("fp", fqn)] + 1 : first[("fo", fqn)]]
        allocated = [ev[1] for ev in segment if ev[0] == "a"]
        freed = {ev[1] for ev in segment if ev[0] == "f"}
        kept = [k for k in allocated if k not in freed]
        output = kept[-1] if kept else None
        start = first[("bs", fqn)]
        # freed before this module's backward: not saved for it (recomputed, dropped)
        early = {ev[1] for ev in events[first[("fo", fqn)] : start] if ev[0] == "f"}
        saved = [k for k in kept if k != output and k not in early]
        at_end.setdefault(first[("fo", fqn)], []).extend(("f", k) for k in saved)
        recompute: list[tuple[Any, ...]] = []
        for ev in segment:
            if ev[0] == "a":
                recompute.append(("a", ("recompute", ev[1]), ev[2]))
            elif ev[0] == "f" and ev[1] in allocated:
                recompute.append(("f", ("recompute", ev[1])))
        recompute += [("f", ("recompute", k)) for k in kept if k not in saved]
        at_end.setdefault(start, []).extend(recompute)
        renamed.update({k: ("recompute", k) for k in saved})
    out: list[tuple[Any, ...]] = []
    for i, ev in enumerate(events):
        out.append(("f", renamed[ev[1]]) if ev[0] == "f" and ev[1] in renamed else ev)
        out.extend(at_end.get(i, ()))
    return out
