"""FSDPModule's runtime setters, checked directly (each against FSDP2's semantics):
``set_reshard_after_forward`` for evaluation, ``set_reshard_after_backward`` and
``set_requires_gradient_sync`` with ``recurse=False``, explicit prefetch lists on
a module that owns no parameters and empty lists, settings made on a non-root
module before the first forward, and ``set_separate_reduce_scatter_group``."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from dist_utils import run_distributed
from gpt import GPT, GPTConfig, loss_fn, make_batch
from helpers import collective_log, local_slice, max_param_diff, mean_across_ranks, rank_world
from models import Wrapper

from fsdp_compose import FSDPModule, fully_shard, trace

TINY = dict(vocab_size=97, block_size=16, n_layer=3, n_head=2, n_embd=32)


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
        with torch.no_grad(), collective_log() as log:
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
    with collective_log() as log:
        out["diffs"] = [_train_step(model, ref, opts, cfg, 0)]
    out["first_root_gathers"] = log.counts()[("all_gather", "root")]
    # The root kept its parameters through backward, so they are plain tensors...
    out["root_plain_after_backward"] = not hasattr(model.lm_head.weight, "placements")
    out["block_sharded_after_backward"] = hasattr(model.blocks[0].attn.q.weight, "placements")
    with collective_log() as log:
        out["diffs"].append(_train_step(model, ref, opts, cfg, 1))
    # ...but the optimizer changed the shards, so the root gathers fresh data.
    out["second_root_gathers"] = log.counts()[("all_gather", "root")]

    model.set_requires_gradient_sync(False, recurse=False)
    x, y = make_batch(cfg, 2 * world, 2)
    with collective_log() as log:
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
    return [e["args"]["unit"] for e in trace.events()
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
    with trace.recording():
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
    import fsdp_compose._unit as unit_module

    cfg = GPTConfig(**TINY)
    torch.manual_seed(0)
    ref = GPT(cfg)
    model = _sharded_gpt(ref)
    model.blocks[0].set_reduce_scatter_max_input_buffers(2)
    model.set_separate_reduce_scatter_group()
    groups = {"all_gather": set(), "reduce_scatter": set()}
    real_ag, real_rs = unit_module._collectives.all_gather, unit_module._collectives.reduce_scatter

    def spy(kind: str, real):  # noqa: ANN001, ANN202
        def wrapped(output, inp, group, label):  # noqa: ANN001, ANN202
            groups[kind].add(id(group))
            return real(output, inp, group, label)
        return wrapped

    unit_module._collectives.all_gather = spy("all_gather", real_ag)
    unit_module._collectives.reduce_scatter = spy("reduce_scatter", real_rs)
    try:
        opts = (torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3))
        diffs = [_train_step(model, ref, opts, cfg, step) for step in range(2)]
    finally:
        unit_module._collectives.all_gather, unit_module._collectives.reduce_scatter = real_ag, real_rs
    return {
        "diffs": diffs, "param_diff": max_param_diff(model, ref)[0],
        "max_inflight": model._fsdp_state().scheduler.max_inflight_reductions,
        "ag_groups": len(groups["all_gather"]), "rs_groups": len(groups["reduce_scatter"]),
        "disjoint": not groups["all_gather"] & groups["reduce_scatter"],
    }


def test_settings_before_first_forward_and_separate_reduce_scatter_group() -> None:
    for r in run_distributed(_settings_and_groups_job, 2):
        assert max(r["diffs"]) < 1e-5 and r["param_diff"] < 1e-4, r
        assert r["max_inflight"] == 2, r
        assert r["ag_groups"] == 1 and r["rs_groups"] == 1 and r["disjoint"], r
