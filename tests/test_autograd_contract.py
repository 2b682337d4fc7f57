"""Backward through unusual graphs, the scenarios of torch's
``test_fully_shard_autograd.py``, against torch's FSDP2 in the same job.

torch's file builds its reference on CUDA, so its scenarios run here directly on 2
gloo ranks, each with both libraries from the same seed: a forward output left out of
the loss after a few steps (a unit whose output gets no gradient), a unit never
called in forward, a unit whose output is detached (its backward never runs, its
prefetch goes unused) and whose weight changes outside the optimizer between steps,
two backward passes through one forward's graph (or ``torch.autograd.grad`` first;
or a third after two microbatches' backwards), and activations passed between units
inside a namedtuple, a dict or a (nested) dataclass, also in bf16 (hooks and casts
must find the tensors inside containers: the dataclass cases are from torch's
mixed-precision file). Per step the losses, the
sizes of the all-gathers and reduce-scatters in issue order (counted by replacing
``torch.distributed``'s functions, as torch's tests do) and, at the end, the
parameters are bit-identical to FSDP2's.
The optimizer is SGD where torch's file uses Adam, whose update hides a gradient
scaled by a constant.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from dist_utils import run_distributed
from helpers import against_fsdp2, collectives_by_size, fake_process_group
from torch.distributed.fsdp import MixedPrecisionPolicy

DIM = 24
Pair = collections.namedtuple("Pair", "x y")


@dataclasses.dataclass
class _Activation:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class _Nested:
    inner: _Activation
    z: torch.Tensor


class _TwoLinears(nn.Module):
    """Two outputs, or (``second=False``) one, with ``lin2`` never called."""

    def __init__(self, second: bool) -> None:
        super().__init__()
        self.lin1, self.lin2, self.second = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), second

    def forward(self, x: torch.Tensor) -> Any:
        y = torch.relu(self.lin1(x))
        return (y, torch.relu(self.lin2(x))) if self.second else y


class _InContainer(nn.Module):
    """A block whose input and output are ``kind`` containers holding the activation."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin1, self.lin2, self.kind = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), kind

    def forward(self, inp: Any) -> Any:
        x = inp["x"] if self.kind == "dict" else inp.inner.x if self.kind == "nested" else inp.x
        x = torch.relu(self.lin2(torch.relu(self.lin1(x))))
        if self.kind == "dataclass":
            return _Activation(x, self.lin1(inp.y))  # both fields carry gradients
        if self.kind == "nested":
            return _Nested(_Activation(x, inp.inner.y), self.lin2(inp.z))
        return {"x": x} if self.kind == "dict" else Pair(x, inp.y)


def _unused_output(shard: Callable[..., Any], reshard: bool | int) -> Any:
    model = _TwoLinears(second=True)
    shard(model.lin1, reshard_after_forward=reshard)
    shard(model, reshard_after_forward=reshard)
    # Both outputs in the loss for two steps, then only the first.
    return model, lambda x, step: (lambda a, b: (a * b).sum() if step < 2 else a.sum())(*model(x))


def _unused_module(shard: Callable[..., Any], reshard: bool | int) -> Any:
    model = _TwoLinears(second=False)
    for module in (model.lin1, model.lin2, model):
        shard(module, reshard_after_forward=reshard)
    return model, lambda x, step: model(x).sum()


class _DetachedThird(nn.Module):
    """Three blocks and a head; the third block's output is detached, so its backward
    never runs (the root's backward prefetches it all the same)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(3))
        self.head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[1](self.blocks[0](x))
        return self.head(x + self.blocks[2](x).detach())


def _detached_updated(shard: Callable[..., Any]) -> Any:
    model = _DetachedThird()
    for module in (*model.blocks, model):
        shard(module)

    def loss(x: torch.Tensor, step: int) -> torch.Tensor:
        with torch.no_grad():  # changed outside the optimizer (an EMA, a load)
            model.blocks[2].weight.mul_(0.5)  # type: ignore[operator]
        return model(x).sum()

    return model, loss


class _WithAuxiliary(nn.Module):
    """Three blocks and a head, returning the output and the first block's output."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first = x = self.blocks[0](x)
        for block in self.blocks[1:]:
            x = block(x)
        return self.head(x), first


def _several_backwards(shard: Callable[..., Any], first: str) -> Any:
    """Each step runs a first backward through part (or all) of the forward's graph,
    kept alive, before the step's loss is returned for the second."""
    model = _WithAuxiliary()
    for module in (*model.blocks, model):
        shard(module)

    def loss(x: torch.Tensor, step: int) -> torch.Tensor:
        if first == "input gradient":
            x = x.requires_grad_(True)
        out, early = model(x)
        main, auxiliary = out.sum(), early.pow(2).mean()
        if first == "microbatches":  # two forwards, then their backwards, the last last
            later = model(x.flip(0))[0].sum()
            model.set_is_last_backward(False)  # type: ignore[operator]
            main.backward()
            model.set_is_last_backward(True)  # type: ignore[operator]
            later.backward(retain_graph=True)
            return later  # a third backward, through the last forward's graph
        if first == "input gradient":
            torch.autograd.grad(main, x, retain_graph=True)
            return main
        before, after = (main, auxiliary) if first == "main" else (auxiliary, main)
        before.backward(retain_graph=True)
        return after

    return model, loss


def _containers(shard: Callable[..., Any], kind: str, bf16: bool = False) -> Any:
    blocks = nn.Sequential(*[_InContainer(kind) for _ in range(3)])
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    options = {"mp_policy": policy} if bf16 else {}
    for block in blocks:
        shard(block, **options)
    shard(blocks, **options)

    def loss(x: torch.Tensor, step: int) -> torch.Tensor:
        if kind in ("dataclass", "nested"):
            inner = _Activation(x, torch.ones_like(x))
            out = blocks(inner if kind == "dataclass" else _Nested(inner, x.flip(0)))
            parts = (out.x, out.y) if kind == "dataclass" else (out.inner.x, out.z)
            return sum(part.float().sum() for part in parts)  # type: ignore[return-value]
        out = blocks({"x": x} if kind == "dict" else Pair(x, torch.ones_like(x)))
        return (out["x"] if kind == "dict" else out.x).sum()

    return blocks, loss


SCENARIOS: list[tuple[str, Callable[..., Any], dict[str, Any]]] = [
    ("unused forward output", _unused_output, {"reshard": 2}),
    ("unused forward output, kept", _unused_output, {"reshard": False}),
    ("unused forward module", _unused_module, {"reshard": True}),
    # The prefetch of the detached block is dropped at the end of backward, as by FSDP2:
    # the next forward gathers the parameters as they are then.
    ("detached output, updated between steps", _detached_updated, {}),
    # A backward after the last one ended (retain_graph) prefetches nothing, as FSDP2's.
    ("main loss's backward, then an auxiliary one's", _several_backwards, {"first": "main"}),
    ("auxiliary loss's backward, then the main", _several_backwards, {"first": "auxiliary"}),
    (
        "torch.autograd.grad to the input, then backward",
        _several_backwards,
        {"first": "input gradient"},
    ),
    (
        "two microbatches, then a backward after the last",
        _several_backwards,
        {"first": "microbatches"},
    ),
    ("namedtuple activations", _containers, {"kind": "namedtuple"}),
    ("dict activations", _containers, {"kind": "dict"}),
    ("dataclass activations", _containers, {"kind": "dataclass"}),
    ("nested dataclass activations, bf16", _containers, {"kind": "nested", "bf16": True}),
]


def _train(shard: Callable[..., Any], build: Callable[..., Any], options: dict[str, Any]) -> Any:
    torch.manual_seed(42)
    model, loss_of = build(shard, **options)
    optim = torch.optim.SGD(model.parameters(), lr=1e-2)
    inputs = torch.Generator().manual_seed(1 + dist.get_rank())
    losses: list[float] = []
    sizes: list[tuple[str, int]] = []

    with collectives_by_size(sizes):
        for step in range(4):
            loss = loss_of(torch.rand(2, DIM, generator=inputs), step)
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=bool(step % 2))
            losses.append(loss.item())
    return losses, sizes, [p.full_tensor().detach() for p in model.parameters()]


def test_unusual_graphs_match_fsdp2() -> None:
    for rank_results in run_distributed(against_fsdp2, 2, SCENARIOS, _train, timeout=240.0):
        assert [r[0] for r in rank_results] == [s[0] for s in SCENARIOS]
        for name, losses, collectives, params in rank_results:
            assert losses and collectives and params, (name, losses, collectives, params)


def _jvp_job() -> dict:
    """torch.func.jvp through a unit whose first forward (lazy init, gathers) runs
    inside the transform, as in torch's mixed-precision file: the unit's buffers
    stay plain tensors."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_compose import fully_shard

    out = {}
    for name, shard in (("fsdp2", torch_fully_shard), ("fsdp_compose", fully_shard)):
        torch.manual_seed(0)
        encoder, decoder = nn.Linear(16, 32, bias=False), nn.Linear(32, 8, bias=False)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for module in (encoder, decoder):
            shard(module, mp_policy=policy, reshard_after_forward=False)
        x = torch.randn(16, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
        weight = decoder.weight.full_tensor().detach().to(torch.bfloat16)  # type: ignore[operator]
        hidden = encoder(x)
        primal, tangent = torch.ones(8, requires_grad=True), torch.ones(8)

        def decode(_: torch.Tensor, module: nn.Module = decoder, h: torch.Tensor = hidden) -> Any:
            return module(h)

        output, tangent_out = torch.func.jvp(decode, (primal,), (tangent,))
        expected = nn.functional.linear(hidden.detach(), weight)
        out[name] = (
            output.dtype,
            torch.equal(output.detach(), expected),
            torch.equal(tangent_out, torch.zeros_like(output)),
        )
    return out


def test_jvp_through_a_unit_as_fsdp2() -> None:
    for r in run_distributed(_jvp_job, 2):
        assert r["fsdp_compose"] == r["fsdp2"] == (torch.bfloat16, True, True), r


def _jvp_backward_job() -> dict:
    """Backward through the outputs of torch.func.jvp over units that reshard after
    forward: inside the transform the outputs say they need no gradient, yet the
    autograd outside runs through them, so their backward must gather the units again
    (FSDP2 marks such outputs for its pre-backward)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_compose import fully_shard

    out = {}
    for name, shard in (("fsdp2", torch_fully_shard), ("fsdp_compose", fully_shard)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
        shard(model[0])
        shard(model[2])
        shard(model)
        x, tangent = torch.randn(2, 8, requires_grad=True), torch.randn(2, 8)
        for _ in range(2):
            output, tangent_out = torch.func.jvp(model, (x,), (tangent,))
            (output.sum() + tangent_out.sum()).backward()
        out[name] = [p.grad.full_tensor() for p in model.parameters()] + [x.grad]
    return out


def test_backward_through_jvp_outputs_as_fsdp2() -> None:
    for r in run_distributed(_jvp_backward_job, 2):
        assert all(torch.equal(a, b) for a, b in zip(r["fsdp_compose"], r["fsdp2"])), r


class _ChunkedHead(nn.Module):
    """torch's chunked-loss model: the forward may skip the head (tied to the
    embedding), which the loss then calls on each chunk of the hidden states."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.body = nn.Embedding(128, 32), nn.Linear(32, 32, bias=False)
        self.norm, self.head = nn.RMSNorm(32), nn.Linear(32, 128, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        hidden = self.norm(self.body(self.embed(tokens)))
        return hidden if skip_head else self.head(hidden)


# (reshard_after_forward of the body, of the head's group; the head grouped with the
# embedding and the norm, else the norm a unit of its own; micro-batches per step)
_CHUNKED_VARIANTS = {
    "head's group resharded": (True, True, True, 1),
    "body kept gathered": (False, True, True, 1),
    "accumulation over micro-batches": (True, True, True, 2),
    "ungrouped norm, groups kept or partly resharded": (1, False, False, 2),
}


def _chunked_head_job(variants: list[str]) -> dict:
    """The forward skips the head of a grouped unit ([embed, norm, head], or [embed,
    head] with the norm a unit of its own); the head then runs alone on each chunk
    (forward and backward) before the hidden states' backward. The body gathered
    again between the two writes in place into storage autograd saved in the forward
    (an unused prefetch); a chunk's backward reaches only the head's group, whose
    post-backward alone runs (FSDP2's partial path registers no pre-backward hook)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_compose import fully_shard

    out: dict = {}
    for variant in variants:
        body_reshard, group_reshard, grouped, micro_batches = _CHUNKED_VARIANTS[variant]
        for name, shard in (("fsdp2", torch_fully_shard), ("fsdp_compose", fully_shard)):
            torch.manual_seed(42)
            model = _ChunkedHead()
            shard(model.body, reshard_after_forward=body_reshard)
            if grouped:
                shard([model.embed, model.norm, model.head], reshard_after_forward=group_reshard)
            else:
                shard(model.norm, reshard_after_forward=group_reshard)
                shard([model.embed, model.head], reshard_after_forward=group_reshard)
            shard(model)
            optim = torch.optim.SGD(model.parameters(), lr=1e-2)
            tokens = torch.Generator().manual_seed(0)
            values: list[Any] = []
            sizes: list[tuple[str, int]] = []  # collectives in issue order, passes marked
            with collectives_by_size(sizes):
                for _ in range(2):
                    for micro_batch in range(micro_batches):
                        model.set_requires_gradient_sync(micro_batch == micro_batches - 1)
                        hidden = model(torch.randint(0, 128, (2, 16), generator=tokens), True)
                        grads = []
                        for chunk in torch.chunk(hidden.detach(), 4, dim=1):
                            chunk = chunk.contiguous().requires_grad_(True)
                            loss = model.head(chunk).sum()
                            loss.backward()
                            grads.append(chunk.grad)
                            values.append(loss.item())
                        sizes.append(("hidden states' backward", 0))
                        hidden.backward(torch.cat(grads, dim=1))
                    optim.step()
                    optim.zero_grad()
            params = [p.full_tensor().detach() for p in model.parameters()]
            out[variant, name] = (values, sizes, params)
    return out


def _chunked_head_toggle_job() -> dict:
    """torchtitan's ChunkedCELoss: the head's group keeps its parameters through the
    chunk loop (resharding switched off, then ``reshard()`` after it). Collectives
    counted by size, with torch's helpers, as the losses and parameters are."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_compose import fully_shard

    out = {}
    for name, shard in (("fsdp2", torch_fully_shard), ("fsdp_compose", fully_shard)):
        torch.manual_seed(42)
        model = _ChunkedHead()
        shard(model.body)
        shard([model.embed, model.norm, model.head], reshard_after_forward=False)
        shard(model)
        optim = torch.optim.SGD(model.parameters(), lr=1e-2)
        tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
        sizes: list[tuple[str, int]] = []

        with collectives_by_size(sizes):
            for _ in range(2):
                hidden = model(tokens, skip_head=True)
                model.head.set_reshard_after_forward(False)  # type: ignore[operator]
                model.head.set_reshard_after_backward(False)  # type: ignore[operator]
                grads = []
                for chunk in torch.chunk(hidden.detach(), 4, dim=1):
                    chunk = chunk.contiguous().requires_grad_(True)
                    model.head(chunk).sum().backward()
                    grads.append(chunk.grad)
                model.head.set_reshard_after_forward(True)  # type: ignore[operator]
                model.head.set_reshard_after_backward(True)  # type: ignore[operator]
                model.head.reshard()  # type: ignore[operator]
                hidden.backward(torch.cat(grads, dim=1))
                optim.step()
                optim.zero_grad()
        params = [p.full_tensor().detach() for p in model.parameters()]
        out[name] = (sorted(collections.Counter(sizes).items()), params)
    return out


def test_chunked_cross_entropy_toggle_as_fsdp2() -> None:
    # A forward of a module inside the tree (the head alone) prefetches no other unit
    # implicitly, as FSDP2 never does: the same collectives, counted by size.
    for r in run_distributed(_chunked_head_toggle_job, 2):
        (counts, params), (fsdp2_counts, fsdp2_params) = r["fsdp_compose"], r["fsdp2"]
        assert counts == fsdp2_counts, (counts, fsdp2_counts)
        assert all(torch.equal(a, b) for a, b in zip(params, fsdp2_params))


def test_chunked_head_after_a_partial_group_forward_as_fsdp2() -> None:
    # The head run alone takes FSDP2's partial path: its group stays gathered through
    # the chunk's backward (one all-gather per chunk, as FSDP2's), and that backward,
    # reaching no pre-backward hook, leaves the other units as they are: the body kept
    # gathered is not gathered again for the hidden states' backward, and gradients
    # accumulated without sync wait for it. The same collectives in the same order.
    for r in run_distributed(_chunked_head_job, 2, list(_CHUNKED_VARIANTS), timeout=180.0):
        for variant in _CHUNKED_VARIANTS:
            (losses, sizes, params), fsdp2 = r[variant, "fsdp_compose"], r[variant, "fsdp2"]
            assert losses == fsdp2[0], (variant, losses, fsdp2[0])
            assert sizes == fsdp2[1], (variant, sizes, fsdp2[1])
            assert all(torch.equal(a, b) for a, b in zip(params, fsdp2[2])), variant


class _ReturnsView(nn.Module):
    def __init__(self, view: bool) -> None:
        super().__init__()
        self.lin, self.view = nn.Linear(4, 4), view

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        return out.view(-1) if self.view else out


def test_a_unit_returning_a_view_warns_as_fsdp2() -> None:
    """FSDP2 warns when a unit's output is a view (an in-place op on it would drop the
    pre-backward hook); fsdp_compose warns for the same outputs, and only for them."""
    import warnings

    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_compose import fully_shard

    with fake_process_group(2, 0):
        for view in (True, False):
            seen = []
            for shard in (torch_fully_shard, fully_shard):
                model = _ReturnsView(view)
                shard(model)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    model(torch.randn(2, 4, requires_grad=True)).sum().backward()
                seen.append([str(w.message) for w in caught if "returned a view" in str(w.message)])
            assert [len(s) for s in seen] == ([1, 1] if view else [0, 0]), seen
            if view:
                assert "_ReturnsView" in seen[1][0] and "clone()" in seen[1][0], seen
