"""FSDPModule's runtime setters, checked directly (each against FSDP2's semantics):
``set_reshard_after_forward`` for evaluation, ``set_reshard_after_backward`` and
``set_requires_gradient_sync`` with ``recurse=False``, explicit prefetch lists on
a module that owns no parameters and empty lists, settings made on a non-root
module before the first forward, ``set_separate_reduce_scatter_group``, and
``set_custom_all_gather`` / ``set_custom_reduce_scatter``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dist_utils import run_distributed
from gpt import GPT, GPTConfig, loss_fn, make_batch
from helpers import collective_log, local_slice, max_param_diff, mean_across_ranks, rank_world
from models import TINY_GPT, Wrapper

from fsdp_compose import FSDPModule, fully_shard, trace

_TIMELINE = trace.Timeline()  # one per rank process, cleared by each recording
TINY = TINY_GPT


def _sharded_gpt(ref: GPT) -> GPT:
    model = copy.deepcopy(ref)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _train_step(model: nn.Module, ref: nn.Module, opts: tuple, cfg: GPTConfig, step: int) -> float:
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


def _eval_job() -> dict:
    """Evaluation between training steps: with ``set_reshard_after_forward(False)``
    each unit is gathered once for several no-grad forwards (FSDP2's documented
    eval pattern); training afterwards sees the optimizer's updates."""
    rank, world = rank_world()
    cfg = GPTConfig(**TINY)
    torch.manual_seed(0)
    ref = GPT(cfg)
    model = _sharded_gpt(ref)
    opts = (torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2))
    x, _ = make_batch(cfg, 2 * world, 100)
    out: dict = {"diffs": [_train_step(model, ref, opts, cfg, 0)]}

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
    out["diffs"] += [_train_step(model, ref, opts, cfg, s) for s in (1, 2)]
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
    model = _sharded_gpt(ref)
    opts = (torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3))
    out: dict = {}
    model.set_reshard_after_backward(False, recurse=False)
    with collective_log(model) as log:
        out["diffs"] = [_train_step(model, ref, opts, cfg, 0)]
    out["first_root_gathers"] = log.counts()[("all_gather", "root")]
    # The root kept its parameters through backward, so they are plain tensors...
    out["root_plain_after_backward"] = not hasattr(model.lm_head.weight, "placements")
    out["block_sharded_after_backward"] = hasattr(model.blocks[0].attn.q.weight, "placements")
    with collective_log(model) as log:
        out["diffs"].append(_train_step(model, ref, opts, cfg, 1))
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
    return [e["args"]["unit"] for e in _TIMELINE.events()
            if e.get("cat") == "prefetch" and e["args"].get("step") == step]


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
    opts = (torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3))
    wrapped_ref = Wrapper(ref)
    diffs = []
    _TIMELINE.clear()
    with trace.recording(model, timeline=_TIMELINE):
        for step in range(3):
            diffs.append(_train_step(model, wrapped_ref, opts, cfg, step))
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
    model = _sharded_gpt(ref)
    model.blocks[0].set_reduce_scatter_max_input_buffers(2)
    model.set_separate_reduce_scatter_group()
    groups: dict[str, set[int]] = {"all_gather": set(), "reduce_scatter": set()}
    with collective_log(model) as log:
        opts = (torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3))
        diffs = [_train_step(model, ref, opts, cfg, step) for step in range(2)]
    for info in log.issued:
        groups.setdefault(info.kind, set()).add(id(info.group))
    return {
        "diffs": diffs, "param_diff": max_param_diff(model, ref)[0],
        "max_inflight": model._fsdp_state().scheduler.settings.max_inflight_reductions,
        "ag_groups": len(groups["all_gather"]), "rs_groups": len(groups["reduce_scatter"]),
        "disjoint": not groups["all_gather"] & groups["reduce_scatter"],
    }


def test_settings_before_first_forward_and_separate_reduce_scatter_group() -> None:
    for r in run_distributed(_settings_and_groups_job, 2):
        assert max(r["diffs"]) < 1e-5 and r["param_diff"] < 1e-4, r
        assert r["max_inflight"] == 2, r
        assert r["ag_groups"] == 1 and r["rs_groups"] == 1 and r["disjoint"], r


# torch 2.13 renamed the single-tensor collectives; older releases have the old names
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _CountingAllGather:
    """A custom all-gather in FSDP2's ``AllGather`` interface that records its calls."""

    def __init__(self) -> None:
        self.allocations: list[int] = []
        self.calls: list[tuple[int, bool, bool]] = []  # (group size, in place, async)

    def allocate(self, size, *, dtype, device):  # type: ignore[no-untyped-def]
        self.allocations.append(int(size[0]))
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):  # type: ignore[no-untyped-def]
        world = group.size()
        row = output_tensor.numel() // world
        in_place = input_tensor.data_ptr() == output_tensor.data_ptr() + (
            dist.get_rank(group) * row * output_tensor.element_size()
        )
        self.calls.append((world, in_place, async_op))
        return _ALL_GATHER(output_tensor, input_tensor, group=group, async_op=async_op)


class _CountingReduceScatter:
    """A custom reduce-scatter in FSDP2's ``ReduceScatter`` interface."""

    def __init__(self) -> None:
        self.allocations: list[int] = []
        self.ops: list[object] = []

    def allocate(self, size, *, dtype, device):  # type: ignore[no-untyped-def]
        self.allocations.append(int(size[0]))
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore[no-untyped-def]
        self.ops.append(op)
        return _REDUCE_SCATTER(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class _WrongSizeAllGather(_CountingAllGather):
    def allocate(self, size, *, dtype, device):  # type: ignore[no-untyped-def]
        return torch.empty(int(size[0]) + 1, dtype=dtype, device=device)


def _custom_comm_job() -> dict:
    """Blocks gather and reduce through user comms (with ``reshard_after_forward=2``
    at 4 ranks, so backward re-gathers within pairs); the root keeps the defaults."""
    rank, world = rank_world()
    cfg = GPTConfig(**TINY)
    torch.manual_seed(0)
    ref = GPT(cfg)
    model = copy.deepcopy(ref)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=2)
    fully_shard(model)
    ag, rs = _CountingAllGather(), _CountingReduceScatter()
    for block in model.blocks:
        block.set_custom_all_gather(ag)
        block.set_custom_reduce_scatter(rs)
    opts = (torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3))
    steps = 3
    with collective_log(model) as log:
        diffs = [_train_step(model, ref, opts, cfg, s) for s in range(steps)]
    out = {
        "diffs": diffs,
        "param_diff": max_param_diff(model, ref)[0],
        "ag_calls": ag.calls,
        "ag_allocations": len(ag.allocations),
        "rs_calls": len(rs.ops),
        "rs_ops_sum": all(op == dist.ReduceOp.SUM for op in rs.ops),
        "rs_allocations": len(rs.allocations),
        "logged": log.kinds(),
        "steps": steps,
        "blocks": cfg.n_layer,
    }
    # None restores the default collectives
    for block in model.blocks:
        block.set_custom_all_gather(None)
        block.set_custom_reduce_scatter(None)
    before = (len(ag.calls), len(rs.ops))
    out["diffs"].append(_train_step(model, ref, opts, cfg, steps))
    out["after_reset"] = (len(ag.calls), len(rs.ops)) == before
    # bad input: clear errors, raised identically on every rank (no hang)
    with pytest.raises(TypeError, match="allocate"):
        model.blocks[0].set_custom_all_gather(object())
    bad = copy.deepcopy(ref)
    for block in bad.blocks:
        fully_shard(block)
    fully_shard(bad)
    bad.blocks[0].set_custom_all_gather(_WrongSizeAllGather())
    x, _ = make_batch(cfg, 2 * world, 0)
    with pytest.raises(ValueError, match=r"blocks\.0's custom all-gather: allocate\(\) returned"):
        bad(local_slice(x, rank, world))
    return out


def test_custom_all_gather_and_reduce_scatter() -> None:
    for r in run_distributed(_custom_comm_job, 4):
        assert max(r["diffs"]) < 1e-5 and r["param_diff"] < 1e-4, r
        n = r["steps"] * r["blocks"]
        # per block and step: the forward gather over 4 ranks, the backward one
        # over the post-forward pair; always in place (FSDP2's contract), async
        assert sorted(c[0] for c in r["ag_calls"]) == [2] * n + [4] * n, r["ag_calls"]
        assert all(in_place and is_async for _, in_place, is_async in r["ag_calls"]), r["ag_calls"]
        assert r["ag_allocations"] == 2 * n
        assert r["rs_calls"] == n and r["rs_ops_sum"] and r["rs_allocations"] == 2 * n, r
        # the custom collectives are still logged (trace, debug checks); the root's
        # default ones too
        assert r["logged"]["all_gather"] == 2 * n + r["steps"], r["logged"]
        assert r["logged"]["reduce_scatter"] == n + r["steps"], r["logged"]
        assert r["after_reset"], r
