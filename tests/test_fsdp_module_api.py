"""The ``FSDPModule`` API, method by method, each against FSDP2's semantics.

Runtime setters checked directly: ``set_reshard_after_forward`` for evaluation,
``set_reshard_after_backward`` and ``set_requires_gradient_sync`` with
``recurse=False``, explicit prefetch lists on a module that owns no parameters and
empty lists, settings made on a non-root module before the first forward,
and ``set_separate_reduce_scatter_group``. Custom collectives and the
communication-allocator settings are in ``test_custom_comms.py``.

The setters that change gradient reduction or backward unsharding
(``set_gradient_divide_factor``, ``set_all_reduce_hook``,
``set_reduce_scatter_unused_params``, ``set_unshard_in_backward``): each job shards
the same model with fsdp_compose and with torch's own FSDP2, applies the setter to
both, runs one forward/backward on every rank's slice of the batch and checks the
reduced gradients against

* the closed-form expectation from a single-process reference (the per-rank
  gradients summed, divided as the setter says), and
* torch's FSDP2 given the same setter (the semantics fsdp_compose copies),

plus the collectives fsdp_compose issued.
Both sides run with ``set_force_sum_reduction_for_comms(True)`` (SUM, then a
separate division): gloo has no PREMUL_SUM for FSDP2's custom divide factor
otherwise. The setting matters for the all-reduce hook, which then receives the
summed gradient; ``test_all_reduce_hook_input_as_torch_default`` checks that with
the default (FSDP2's ``ReduceOp.AVG`` for float32) the hook receives the average,
as under FSDP2.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
from dist_utils import run_distributed
from gpt import GPT, GPTConfig, loss_fn, make_batch
from helpers import (
    collective_log,
    full,
    gpt_train_step,
    local_slice,
    max_param_diff,
    rank_world,
    sharded_gpt,
)
from models import TINY_GPT, Wrapper
from torch.distributed.device_mesh import init_device_mesh

from fsdp_compose import FSDPModule, fully_shard, trace

_TIMELINE = trace.Timeline()  # one per rank process, cleared by each recording
TINY = TINY_GPT


def _eval_job() -> dict:
    """Evaluation between training steps: with ``set_reshard_after_forward(False)``
    each unit is gathered once for several no-grad forwards (FSDP2's documented
    eval pattern); training afterwards sees the optimizer's updates."""
    rank, world = rank_world()
    cfg = GPTConfig(**TINY)
    torch.manual_seed(0)
    ref = GPT(cfg)
    model = sharded_gpt(ref)
    opts = (
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        torch.optim.AdamW(ref.parameters(), lr=1e-2),
    )
    x, _ = make_batch(cfg, 2 * world, 100)
    out: dict = {"diffs": [gpt_train_step(model, ref, opts, cfg, 0)]}

    def evaluate() -> tuple[int, float]:
        with torch.no_grad(), collective_log(model) as log:
            outs = [model(local_slice(x, rank, world)) for _ in range(3)]
        expected = ref(x)[rank * 2 : rank * 2 + 2]
        # After a no-grad forward, parameters are the shards again (an optimizer
        # built now must get those), although the data stays gathered.
        sharded = all(hasattr(p, "placements") for p in model.parameters())
        assert sharded, "model.parameters() after an evaluation must be the sharded DTensors"
        return log.kinds()["all_gather"], max((o - expected).abs().max().item() for o in outs)

    out["default_gathers"], out["default_err"] = evaluate()  # the root stays gathered
    model.set_reshard_after_forward(False)
    out["eval_gathers"], out["eval_err"] = evaluate()
    model.set_reshard_after_forward(True)
    model.set_reshard_after_forward(False, recurse=False)  # the root's usual setting
    # The last evaluation left blocks unsharded; the optimizer step below changes
    # their shards, which the next forward must notice.
    out["diffs"] += [gpt_train_step(model, ref, opts, cfg, s) for s in (1, 2)]
    out["param_diff"] = max_param_diff(model, ref)[0]
    return out


def test_eval_with_reshard_after_forward_false() -> None:
    for r in run_distributed(_eval_job, 2):
        assert r["default_gathers"] == 1 + 3 * 3, r  # root once, 3 blocks x 3 forwards
        assert r["eval_gathers"] == 3, r  # the root is still gathered; each block once
        assert r["default_err"] < 1e-5 and r["eval_err"] < 1e-5, r
        assert max(r["diffs"]) < 1e-5 and r["param_diff"] < 1e-4, r


def _no_recurse_job() -> dict:
    """``recurse=False`` applies to the root's own unit only."""
    rank, world = rank_world()
    cfg = GPTConfig(**TINY)
    torch.manual_seed(0)
    ref = GPT(cfg)
    model = sharded_gpt(ref)
    opts = (
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        torch.optim.AdamW(ref.parameters(), lr=1e-3),
    )
    out: dict = {}
    model.set_reshard_after_backward(False, recurse=False)
    with collective_log(model) as log:
        out["diffs"] = [gpt_train_step(model, ref, opts, cfg, 0)]
    out["first_root_gathers"] = log.counts()[("all_gather", "root")]
    # The root kept its parameters through backward, so they are plain tensors...
    out["root_plain_after_backward"] = not hasattr(model.lm_head.weight, "placements")
    out["block_sharded_after_backward"] = hasattr(model.blocks[0].attn.q.weight, "placements")
    with collective_log(model) as log:
        out["diffs"].append(gpt_train_step(model, ref, opts, cfg, 1))
    # ...but the optimizer changed the shards, so the root gathers fresh data.
    out["second_root_gathers"] = log.counts()[("all_gather", "root")]

    model.set_requires_gradient_sync(False, recurse=False)
    x, y = make_batch(cfg, 2 * world, 2)
    with collective_log(model) as log:
        loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    counts = log.counts()
    out["no_sync_root_rs"] = counts[("reduce_scatter", "root")]
    out["no_sync_block_rs"] = [counts[("reduce_scatter", f"blocks.{k}")] for k in range(3)]
    return out


def test_setters_with_recurse_false() -> None:
    for r in run_distributed(_no_recurse_job, 2):
        assert max(r["diffs"]) < 1e-5 and r["first_root_gathers"] == 1, r
        assert r["root_plain_after_backward"] and r["block_sharded_after_backward"], r
        assert r["second_root_gathers"] == 1, r
        assert r["no_sync_root_rs"] == 0 and r["no_sync_block_rs"] == [1, 1, 1], r


def _prefetch_events(step: int) -> list[str]:
    return [
        e["args"]["unit"]
        for e in _TIMELINE.events()
        if e.get("cat") == "prefetch" and e["args"].get("step") == step
    ]


def _explicit_prefetch_job() -> dict:
    """Explicit lists on a root without parameters, and an empty list."""
    cfg = GPTConfig(**TINY)
    torch.manual_seed(0)
    ref = GPT(cfg)
    inner = copy.deepcopy(ref)
    for block in inner.blocks:
        fully_shard(block)
    fully_shard([inner.tok_emb, inner.pos_emb])
    fully_shard([inner.ln_f, inner.lm_head])
    model = Wrapper(inner)
    fully_shard(model)
    assert isinstance(model, FSDPModule) and model._fsdp_state().unit is None
    b0, b1, b2 = inner.blocks
    model.set_modules_to_forward_prefetch([b0, b1])
    model.set_modules_to_backward_prefetch([b2])  # runs at the start of backward
    b0.set_modules_to_forward_prefetch([])  # no prefetch from blocks.0's forward
    opts = (
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        torch.optim.AdamW(ref.parameters(), lr=1e-3),
    )
    wrapped_ref = Wrapper(ref)
    diffs = []
    _TIMELINE.clear()
    with trace.recording(model, timeline=_TIMELINE):
        for step in range(3):
            diffs.append(gpt_train_step(model, wrapped_ref, opts, cfg, step))
        events = _prefetch_events(3)
    return {"diffs": diffs, "param_diff": max_param_diff(inner, ref)[0], "prefetched": events}


def test_explicit_prefetch_from_module_without_params() -> None:
    for r in run_distributed(_explicit_prefetch_job, 2):
        assert max(r["diffs"]) < 1e-5 and r["param_diff"] < 1e-4, r
        prefetched = r["prefetched"]
        # forward: the root's list (blocks.0, blocks.1); blocks.0's empty list adds
        # nothing; blocks.1 prefetches blocks.2 implicitly
        assert prefetched[:3] == ["gpt.blocks.0", "gpt.blocks.1", "gpt.blocks.2"], prefetched
        assert prefetched.count("gpt.blocks.2") >= 2, prefetched  # again from the root's backward


def _settings_and_groups_job() -> dict:
    """Settings made on a block before the first forward reach the scheduler, and
    reduce-scatters use a group of their own when asked."""
    cfg = GPTConfig(**TINY)
    torch.manual_seed(0)
    ref = GPT(cfg)
    model = sharded_gpt(ref)
    model.blocks[0].set_reduce_scatter_max_input_buffers(2)
    model.set_separate_reduce_scatter_group()
    groups: dict[str, set[int]] = {"all_gather": set(), "reduce_scatter": set()}
    with collective_log(model) as log:
        opts = (
            torch.optim.AdamW(model.parameters(), lr=1e-3),
            torch.optim.AdamW(ref.parameters(), lr=1e-3),
        )
        diffs = [gpt_train_step(model, ref, opts, cfg, step) for step in range(2)]
    for info in log.issued:
        groups.setdefault(info.kind, set()).add(id(info.group))
    return {
        "diffs": diffs,
        "param_diff": max_param_diff(model, ref)[0],
        "max_inflight": model._fsdp_state().scheduler.settings.max_inflight_reductions,
        "ag_groups": len(groups["all_gather"]),
        "rs_groups": len(groups["reduce_scatter"]),
        "disjoint": not groups["all_gather"] & groups["reduce_scatter"],
    }


def test_settings_before_first_forward_and_separate_reduce_scatter_group() -> None:
    for r in run_distributed(_settings_and_groups_job, 2):
        assert max(r["diffs"]) < 1e-5 and r["param_diff"] < 1e-4, r
        assert r["max_inflight"] == 2, r
        assert r["ag_groups"] == 1 and r["rs_groups"] == 1 and r["disjoint"], r


# -- setters that change gradient reduction or backward unsharding ------------

WORLD = 2
TOL = 1e-6


class _EmbedBranch(nn.Module):
    """An embedding (its backward does not read its weight), a trunk, and in the
    root's unit a branch that only some ranks use and a parameter no rank uses."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.trunk = nn.Linear(8, 8)
        self.branch = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.spare = nn.Parameter(torch.ones(3))

    def forward(self, idx: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(self.emb(idx).mean(1)))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


def _shard(model: nn.Module, shard: Callable[..., object], mesh: object = None) -> list[FSDPModule]:
    for child in (model.emb, model.trunk):  # the branch and spare stay in the root's unit
        shard(child, mesh=mesh)
    shard(model, mesh=mesh)
    return [m for m in model.modules() if hasattr(m, "set_gradient_divide_factor")]


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, 11, (4, 5), generator=gen), torch.randn(4, generator=gen)


def _loss(model: nn.Module, rank: int, use_branch: bool) -> torch.Tensor:
    idx, y = _batch(rank)
    return (model(idx, use_branch) - y[:, None]).pow(2).mean()


def _reference_grad_sum(
    base: nn.Module, world: int, branch_ranks: set[int]
) -> dict[str, torch.Tensor | None]:
    """Sum over ranks of each rank's local gradient, on one process."""
    ref = copy.deepcopy(base)
    for r in range(world):
        _loss(ref, r, r in branch_ranks).backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        n: None if p.grad is None else full(p.grad).detach().clone()
        for n, p in model.named_parameters()
    }


def _max_diff(
    a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]
) -> tuple[float, str]:
    """Largest |a - b| over the names of ``a``; inf where only one side has a gradient."""
    worst, where = 0.0, ""
    for name, ga in a.items():
        gb = b[name]
        if (ga is None) != (gb is None):
            return float("inf"), f"{name} (None on one side only: {ga is None}, {gb is None})"
        if ga is not None:
            d = (ga - gb).abs().max().item()
            if d > worst:
                worst, where = d, name
    return worst, where


def _setter_job(setter: str, hsdp: bool = False, torch_default_reduction: bool = False) -> dict:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    rank, world = rank_world()
    torch.manual_seed(0)
    base = _EmbedBranch()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    seen: dict[str, list[torch.Tensor]] = {"ours": [], "theirs": []}
    branch_ranks = set(range(world))
    mesh = None
    if hsdp:  # 2 replicas of world / 2 shards
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    modules = {
        "ours": _shard(ours, fully_shard, mesh),
        "theirs": _shard(theirs, torch_fully_shard, mesh),
    }
    for side, mods in modules.items():
        for m in mods:
            if not torch_default_reduction:
                # SUM, then divide: the FSDP2 setting gloo supports for a custom
                # divide factor (FSDP2 otherwise issues PREMUL_SUM); both sides' all-
                # reduce hooks then see the sum
                m.set_force_sum_reduction_for_comms(True)
            if setter == "gradient_divide_factor":
                m.set_gradient_divide_factor(3.0)
            elif setter == "all_reduce_hook":
                # a hook that reads its input and changes it in place
                def hook(t: torch.Tensor, side: str = side) -> None:
                    seen[side].append(t.detach().clone())
                    t.mul_(2.0)

                m.set_all_reduce_hook(hook)
        if setter == "reduce_scatter_unused_params":
            branch_ranks = {0}
            (ours if side == "ours" else theirs).set_reduce_scatter_unused_params(True)  # recurses
        if setter.startswith("unshard_in_backward"):
            model = ours if side == "ours" else theirs
            model.emb.set_unshard_in_backward(False)
            if setter.endswith("no_prefetch"):
                model.trunk.set_modules_to_backward_prefetch([])

    counts: dict[str, dict] = {}
    with collective_log(ours) as log:
        _loss(ours, rank, rank in branch_ranks).backward()
        rs_sizes = [(i.label, i.input_numel) for i in log.issued if i.kind == "reduce_scatter"]
        counts = dict(log.kinds())
        log.clear()
        # forward, then count the backward's collectives on their own
        loss = _loss(ours, rank, rank in branch_ranks)
        log.clear()
        loss.backward()
        backward_counts = dict(log.kinds())
    for p in ours.parameters():
        p.grad = None
    seen["ours"].clear()
    _loss(ours, rank, rank in branch_ranks).backward()
    _loss(theirs, rank, rank in branch_ranks).backward()

    ref_sum = _reference_grad_sum(base, world, branch_ranks)
    divide = {"gradient_divide_factor": 3.0, "all_reduce_hook": world / 2.0}.get(
        setter, float(world)
    )
    expected = {n: None if g is None else g / divide for n, g in ref_sum.items()}
    if setter == "reduce_scatter_unused_params":
        expected["spare"] = torch.zeros(3)  # joins the reduce-scatter with zeros
    hook_diff = None
    if setter == "all_reduce_hook":
        assert len(seen["ours"]) == len(seen["theirs"]), (len(seen["ours"]), len(seen["theirs"]))
        # the units' reductions may complete in another order: pair them by size
        # (each unit's reduce-scatter output has its own size in this model)
        pairs = zip(*(sorted(seen[side], key=torch.Tensor.numel) for side in ("ours", "theirs")))
        hook_diff = max(
            float("inf") if a.shape != b.shape else (a - b).abs().max().item() for a, b in pairs
        )
    return {
        "vs_reference": _max_diff(expected, _grads(ours)),
        "vs_torch": _max_diff(_grads(theirs), _grads(ours)),
        "torch_vs_reference": _max_diff(expected, _grads(theirs)),
        "counts": counts,
        "backward_counts": backward_counts,
        "rs_sizes": rs_sizes,
        "hook_calls": len(seen["ours"]),
        "hook_diff": hook_diff,
    }


@functools.cache
def _baseline() -> dict:
    """The same job with no setter called (rank 0's result)."""
    return run_distributed(_setter_job, WORLD, "none")[0]


@pytest.mark.parametrize(
    "setter",
    [
        "gradient_divide_factor",
        "all_reduce_hook",
        "reduce_scatter_unused_params",
        "unshard_in_backward_no_prefetch",
        # with backward prefetch on: the unit before it must not prefetch it
        # either (FSDPParamGroup._prefetch_unshard unshards in the PRE_BACKWARD
        # state, where FSDP2's unshard() returns early for such a unit)
        "unshard_in_backward",
    ],
)
def test_setter_matches_reference_and_torch_fsdp2(setter: str) -> None:
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    method = "set_reduce_scatter_unused_params"  # added to FSDP2 after torch 2.11
    if setter == "reduce_scatter_unused_params" and not hasattr(TorchFSDPModule, method):
        pytest.skip(f"the installed torch's FSDP2 has no {method} to compare with")
    results = run_distributed(_setter_job, WORLD, setter)
    baseline = _baseline()
    for rank, r in enumerate(results):
        for key in ("vs_reference", "vs_torch", "torch_vs_reference"):
            diff, where = r[key]
            assert diff <= TOL, f"rank {rank} {setter}: {key} max |diff| {diff} at {where}"
        # every rank issues the same reduce-scatters (sizes included)
        assert r["rs_sizes"] == results[0]["rs_sizes"], (
            rank,
            r["rs_sizes"],
            results[0]["rs_sizes"],
        )
    r = results[0]
    if setter.startswith("unshard_in_backward"):
        # the embedding's unit is not all-gathered again in backward
        assert (
            r["backward_counts"]["all_gather"] == baseline["backward_counts"]["all_gather"] - 1
        ), (
            r["backward_counts"],
            baseline["backward_counts"],
        )
    else:
        assert r["backward_counts"] == baseline["backward_counts"], (
            r["backward_counts"],
            baseline["backward_counts"],
        )
    if setter == "all_reduce_hook":
        assert r["hook_calls"] == 3, r["hook_calls"]  # once per unit per backward
        assert r["hook_diff"] <= TOL, (
            f"the hook saw other values than under torch's FSDP2: {r['hook_diff']}"
        )


@pytest.mark.parametrize("setter", ["gradient_divide_factor", "all_reduce_hook"])
def test_setter_with_hsdp(setter: str) -> None:
    """HSDP (2 replicas x 2 shards): the divide factor applies to the sum over all
    4 ranks, and the hook sees the all-reduce's output (the sum over replicas of the
    reduce-scatter outputs), as under torch's FSDP2."""
    results = run_distributed(_setter_job, 4, setter, True)
    for rank, r in enumerate(results):
        for key in ("vs_reference", "vs_torch", "torch_vs_reference"):
            diff, where = r[key]
            assert diff <= TOL, f"rank {rank} {setter}: {key} max |diff| {diff} at {where}"
        # one reduce-scatter and one all-reduce per unit in backward
        assert r["backward_counts"] == {"all_gather": 2, "reduce_scatter": 3, "all_reduce": 3}, r[
            "backward_counts"
        ]
        if setter == "all_reduce_hook":
            assert r["hook_calls"] == 3, r["hook_calls"]
            assert r["hook_diff"] <= TOL, (
                f"the hook saw other values than under torch's FSDP2: {r['hook_diff']}"
            )


def test_all_reduce_hook_input_as_torch_default() -> None:
    """What the hook sees, against torch's FSDP2 with its default reduction."""
    for r in run_distributed(_setter_job, WORLD, "all_reduce_hook", False, True):
        assert r["hook_diff"] <= TOL, (
            f"the hook saw other values than under torch's FSDP2: {r['hook_diff']}"
        )
