"""Helpers shared by the distributed test jobs (run inside rank processes)."""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_compose
from fsdp_compose import CollectiveInfo, Observer


class CollectiveLog(Observer):
    """Records every collective fsdp_compose issues for the models it observes."""

    def __init__(self) -> None:
        self.issued: list[CollectiveInfo] = []

    def on_collective(self, event: str, info: CollectiveInfo) -> None:  # type: ignore[override]
        if event == "issue":
            self.issued.append(info)

    def counts(self) -> Counter[tuple[str, str]]:
        return Counter((i.kind, i.label) for i in self.issued)

    def kinds(self) -> Counter[str]:
        return Counter(i.kind for i in self.issued)

    def clear(self) -> None:
        self.issued.clear()


@contextlib.contextmanager
def collective_log(*modules: nn.Module) -> Iterator[CollectiveLog]:
    """Logs the collectives of ``modules`` (root ``FSDPModule``s) inside the block."""
    assert modules, "collective_log(model): pass the root module(s)"
    log = CollectiveLog()
    for m in modules:
        assert isinstance(m, fsdp_compose.FSDPModule), type(m)
        m.register_observer(log)
    try:
        yield log
    finally:
        for m in modules:
            m.unregister_observer(log)


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int) -> Iterator[None]:
    """This process as ``rank`` of ``world_size`` on torch's ``fake`` backend
    (collectives return at once without communicating): dry runs at any size."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_param_diff(model: nn.Module, ref: nn.Module, rename: Any = None) -> tuple[float, str]:
    """Largest |param - reference param| and where; ``rename`` maps the model's
    parameter names to the reference's (e.g. dropping a wrapper's prefix)."""
    worst, where = 0.0, ""
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        d = (
            (full(p.detach()) - ref_params[rename(name) if rename else name].detach())
            .abs()
            .max()
            .item()
        )
        if d > worst:
            worst, where = d, name
    return worst, where


def max_grad_diff(
    model: nn.Module, ref: nn.Module, skip: tuple[str, ...] = (), rename: Any = None
) -> float:
    """Largest |grad - reference grad| over parameters that have a gradient
    (``rename`` as in :func:`max_param_diff`)."""
    worst = 0.0
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        ref_p = ref_params[rename(name) if rename else name]
        if p.grad is None or any(s in name for s in skip):
            assert ref_p.grad is None or any(s in name for s in skip), name
            continue
        d = (full(p.grad) - ref_p.grad).abs().max().item()
        worst = max(worst, d)
    return worst


def mean_across_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def local_slice(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = x.size(0) // world
    return x[rank * per : (rank + 1) * per]


def clone_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def rank_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def assert_close(actual: float, expected: float, tol: float, what: str) -> None:
    assert abs(actual - expected) <= tol, f"{what}: {actual} vs {expected} (tol {tol})"


def summary(**kw: Any) -> dict[str, Any]:
    return kw


def gpt_batches(cfg: Any, per_rank: int = 2) -> Any:
    """``step -> (x, y)``: the global GPT batch of ``per_rank`` rows per rank."""
    from gpt import make_batch

    return lambda step: make_batch(cfg, per_rank * dist.get_world_size(), step)


def train_side_by_side(
    model: nn.Module,
    ref: nn.Module,
    steps: int,
    batch: Any,
    loss_fn: Any,
    *,
    lr: float = 1e-3,
    params: Any = None,
    grad_skip: tuple[str, ...] = (),
    log: CollectiveLog | None = None,
    before_model: Any = None,
    after_backward: Any = None,
    rename: Any = None,
) -> dict[str, Any]:
    """The tests' parity loop: trains the sharded ``model`` on this rank's slice of
    each global batch ``batch(step) -> (x, y)`` and the unsharded ``ref`` on the
    whole batch, side by side, with AdamW over ``params(module)`` (default: all
    parameters).

    ``log`` (if given) is cleared before the model's forward of every step, so it
    holds the model's collectives of the step; ``before_model(step)`` runs just
    before the model's forward, ``after_backward(step, x, y)`` after both
    backwards, before the optimizer steps (where step-0 checks go); ``rename`` maps
    the model's parameter names to the reference's (wrappers' prefixes).
    Returns ``loss_diffs`` (per step, |mean over ranks of the loss - reference
    loss|), ``grad_diff`` (step 0, largest |grad - reference grad| outside
    ``grad_skip``) and ``param_diff``/``where`` after the last step.
    """
    rank, world = rank_world()
    chosen = params or (lambda m: m.parameters())
    opt = torch.optim.AdamW(chosen(model), lr=lr)
    ref_opt = torch.optim.AdamW(chosen(ref), lr=lr)
    loss_diffs, grad_diff = [], None
    for step in range(steps):
        x, y = batch(step)
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        if log is not None:
            log.clear()
        if before_model is not None:
            before_model(step)
        loss = loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world))
        loss.backward()
        if step == 0:
            grad_diff = max_grad_diff(model, ref, skip=grad_skip, rename=rename)
        if after_backward is not None:
            after_backward(step, x, y)
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
        loss_diffs.append(abs(mean_across_ranks(loss.item()) - ref_loss.item()))
    diff, where = max_param_diff(model, ref, rename)
    return {"loss_diffs": loss_diffs, "grad_diff": grad_diff, "param_diff": diff, "where": where}


def tensor_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    """For assert messages: shapes, dtypes and the largest |a - b|."""
    if a.shape != b.shape:
        return f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    if a.numel() == 0:
        return "both empty"
    d = (a.double() - b.double()).abs()
    return f"max |diff| {d.max().item():.3g} at {tuple(int(i) for i in torch.unravel_index(d.argmax(), d.shape))} ({a.dtype} vs {b.dtype})"


def sharded_gpt(ref: nn.Module) -> nn.Module:
    """A copy of the example GPT ``ref`` with each block and the root sharded."""
    model = copy.deepcopy(ref)
    for block in model.blocks:  # type: ignore[union-attr]
        fsdp_compose.fully_shard(block)
    fsdp_compose.fully_shard(model)
    return model


def gpt_train_step(model: nn.Module, ref: nn.Module, opts: tuple, cfg: Any, step: int) -> float:
    """One step of ``model`` on this rank's slice of the batch and of ``ref`` (one
    process) on the whole batch; the loss difference, averaged across ranks."""
    from gpt import loss_fn, make_batch

    rank, world = rank_world()
    x, y = make_batch(cfg, 2 * world, step)
    ref_loss = loss_fn(ref(x), y)
    ref_loss.backward()
    loss = loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world))
    loss.backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()
    return abs(mean_across_ranks(loss.item()) - ref_loss.item())


def against_fsdp2(scenarios: list[tuple[str, Any, dict[str, Any]]], train: Any) -> list[tuple]:
    """Runs each ``(name, build, options)`` scenario with fsdp_compose's and torch's
    ``fully_shard`` (``train(fully_shard, build, options)`` returns losses, collective
    sizes and final parameters) and says, per scenario, which of the three are equal:
    ``(name, same_losses, same_collectives, same_parameters)``."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    results = []
    for name, build, options in scenarios:
        ours = train(fsdp_compose.fully_shard, build, options)
        theirs = train(torch_fully_shard, build, options)
        same_params = len(ours[2]) == len(theirs[2]) and all(
            torch.equal(a, b) for a, b in zip(ours[2], theirs[2])
        )
        results.append((name, ours[0] == theirs[0], ours[1] == theirs[1], same_params))
    return results


@contextlib.contextmanager
def collectives_by_size(
    sizes: list[tuple[Any, ...]], note: Callable[[], Any] | None = None
) -> Iterator[None]:
    """Appends ``(kind, output numel)`` to ``sizes`` for each all-gather and
    reduce-scatter issued inside the block (``(kind, numel, note())`` with ``note``),
    through torch's own patching helpers (as torch's tests count FSDP2's)."""
    from torch.testing._internal.common_fsdp import patch_all_gather, patch_reduce_scatter

    def counted(kind: str, collective: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            numel = (args[0] if args else kwargs["output"]).numel()
            sizes.append((kind, numel) if note is None else (kind, numel, note()))
            return collective(*args, **kwargs)

        return call

    reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    with (
        patch_reduce_scatter(counted("reduce_scatter", reduce_scatter)),
        patch_all_gather(counted("all_gather", all_gather)),
    ):
        yield
