"""The scheduler: prefetch order (implicit and explicit), overlap of reductions,
the unsharded-memory limit, order changes, and the per-rank timeline."""

from __future__ import annotations

import copy
import json
import os

import torch
import torch.nn as nn
from dist_utils import run_distributed
from gpt import GPT, GPTConfig, loss_fn, make_batch
from helpers import gpt_batches, max_param_diff, rank_world, train_side_by_side
from models import TINY_GPT, Wrapper

from fsdp_compose import FSDPModule, fully_shard, trace

_TIMELINE = trace.Timeline()  # one per rank process, cleared by each recording
TINY = TINY_GPT


def _step_events(step: int) -> list[dict]:
    return [e for e in _TIMELINE.events() if e.get("args", {}).get("step") == step and "ts" in e]


def _first(events: list[dict], name: str, after: float = -1.0) -> dict:
    for e in sorted(events, key=lambda e: e["ts"]):
        if e["name"] == name and e["ts"] > after:
            return e
    raise AssertionError(f"no event {name!r} after {after}")


def _end(e: dict) -> float:
    return e["ts"] + e.get("dur", 0.0)


def _train_traced(model: nn.Module, ref: nn.Module, cfg: GPTConfig, steps: int) -> list[float]:
    _TIMELINE.clear()
    with trace.recording(model, timeline=_TIMELINE):
        return train_side_by_side(model, ref, steps, gpt_batches(cfg), loss_fn)["loss_diffs"]


def _depth_job() -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(**TINY)
    ref = GPT(cfg)
    model = copy.deepcopy(ref)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.set_prefetch_depth(forward=2, backward=2)
    diffs = _train_traced(model, ref, cfg, steps=3)
    ev = _step_events(3)
    root_fwd = _first(ev, "forward root")
    fwd0 = _first(ev, "forward blocks.0")
    ag = {k: _first(ev, f"all_gather blocks.{k}") for k in range(3)}
    back_start = _first(ev, "backward root")["ts"]
    fwd2_end = _end(_first(ev, "forward blocks.2"))
    ag_bwd = {k: _first(ev, f"all_gather blocks.{k}", after=fwd2_end) for k in range(3)}
    bwd2 = _first(ev, "backward blocks.2", after=back_start)
    return {
        "diffs": diffs,
        # two units ahead: the root's pre-forward gathers blocks.0 and blocks.1,
        # blocks.0's gathers blocks.2
        "forward": [ag[0]["ts"] < root_fwd["ts"], ag[1]["ts"] < root_fwd["ts"], ag[2]["ts"] < fwd0["ts"]],
        # blocks.2's pre-backward gathers blocks.1 and blocks.0
        "backward": [ag_bwd[1]["ts"] < bwd2["ts"], ag_bwd[0]["ts"] < bwd2["ts"]],
    }


def test_prefetch_depth() -> None:
    for r in run_distributed(_depth_job, 2):
        assert max(r["diffs"]) < 1e-5
        assert all(r["forward"]) and all(r["backward"]), r


def _order_job(explicit: bool) -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(**TINY)
    ref = GPT(cfg)
    model = copy.deepcopy(ref)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    b0, b1, b2 = model.blocks
    if explicit:
        model.set_modules_to_forward_prefetch([b0, b1])  # both at the root's pre-forward
        b2.set_modules_to_backward_prefetch([b0])  # skip b1: it is gathered on demand
    diffs = _train_traced(model, ref, cfg, steps=3)
    ev = _step_events(3)  # steady state: order recorded in earlier steps
    out: dict = {"diffs": diffs, "param_diff": max_param_diff(model, ref)[0]}
    fwd = {k: _first(ev, f"forward blocks.{k}") for k in range(3)}
    ag_fwd = {k: _first(ev, f"all_gather blocks.{k}") for k in range(3)}
    root_fwd = _first(ev, "forward root")
    back_start = _first(ev, "backward root")["ts"]
    bwd = {k: _first(ev, f"backward blocks.{k}", after=back_start) for k in range(3)}
    ag_bwd = {k: _first(ev, f"all_gather blocks.{k}", after=_end(fwd[2])) for k in range(3)}
    rs = {k: _first(ev, f"reduce_scatter blocks.{k}") for k in range(3)}
    if not explicit:
        # forward: unit k+1's all-gather is issued before unit k's forward finishes
        # (in fact before it starts: it is issued at k's pre-forward)
        out["fwd_prefetch"] = [ag_fwd[k + 1]["ts"] < _end(fwd[k]) for k in range(2)]
        out["fwd_prefetch_early"] = [ag_fwd[k + 1]["ts"] < fwd[k]["ts"] for k in range(2)]
        # backward: unit k-1's all-gather is issued before unit k's backward finishes
        out["bwd_prefetch"] = [ag_bwd[k - 1]["ts"] < _end(bwd[k]) for k in (2, 1)]
    else:
        out["fwd_explicit"] = [ag_fwd[0]["ts"] < root_fwd["ts"], ag_fwd[1]["ts"] < root_fwd["ts"],
                               ag_fwd[1]["ts"] < fwd[0]["ts"]]
        # b2's backward prefetches b0, so b0's gather comes before b1's
        out["bwd_explicit"] = ag_bwd[0]["ts"] < ag_bwd[1]["ts"] < _end(bwd[1])
    # reduce-scatter of unit k is issued before the backward of unit k-1 finishes
    # and runs while it computes
    out["rs_overlap"] = [rs[k]["ts"] < _end(bwd[k - 1]) for k in (2, 1)]
    return out


def test_implicit_prefetch_order_and_overlap() -> None:
    for r in run_distributed(_order_job, 2, False):
        assert max(r["diffs"]) < 1e-5 and r["param_diff"] < 1e-4
        assert all(r["fwd_prefetch"]) and all(r["fwd_prefetch_early"]), r
        assert all(r["bwd_prefetch"]), r
        assert all(r["rs_overlap"]), r


def test_explicit_prefetch_changes_order() -> None:
    for r in run_distributed(_order_job, 2, True):
        assert max(r["diffs"]) < 1e-5 and r["param_diff"] < 1e-4
        assert all(r["fwd_explicit"]), r
        assert r["bwd_explicit"], r
        assert all(r["rs_overlap"]), r


def _limit_job(limit_units: int | None) -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(**TINY)
    ref = GPT(cfg)
    inner = copy.deepcopy(ref)
    fully_shard([inner.tok_emb, inner.pos_emb])
    for block in inner.blocks:
        fully_shard(block)
    fully_shard([inner.ln_f, inner.lm_head])
    model = Wrapper(inner)
    fully_shard(model)
    units = model._fsdp_state().scheduler  # not created before the first forward
    assert units is None
    measured = [m._fsdp_state().unit for m in [inner.tok_emb, *inner.blocks, inner.ln_f]]
    for unit in measured:
        unit.lazy_init()  # the size is known once the layout is (it reads no lazy state)
    unit_bytes = [unit.unsharded_nbytes for unit in measured]
    if limit_units is not None:
        model.set_unsharded_memory_limit(max(unit_bytes) * limit_units)
    diffs = _train_traced(model, Wrapper(ref), cfg, steps=3)
    alive: set[str] = set()
    max_alive, max_total, prefetches = 0, 0, 0
    for e in sorted(_TIMELINE.events(), key=lambda e: e.get("ts", 0)):
        cat = e.get("cat", "")
        if cat == "memory_alloc":
            alive.add(e["args"]["unit"])
            max_total = max(max_total, e["args"]["total_bytes"])
        elif cat == "memory_free":
            alive.discard(e["args"]["unit"])
        elif cat == "prefetch":
            prefetches += 1
        max_alive = max(max_alive, len(alive))
    return {"diffs": diffs, "param_diff": max_param_diff(model.gpt, ref)[0], "max_alive": max_alive,
            "max_total": max_total, "budget": None if limit_units is None else max(unit_bytes) * limit_units,
            "prefetches": prefetches}


def test_memory_limit_one_unit() -> None:
    for r in run_distributed(_limit_job, 2, 1):
        assert max(r["diffs"]) < 1e-5 and r["param_diff"] < 1e-4
        assert r["max_alive"] == 1, r  # never two units' parameters at once
        assert r["max_total"] <= r["budget"], r


def test_memory_limit_larger_budget_prefetches() -> None:
    for r in run_distributed(_limit_job, 2, 3):
        assert max(r["diffs"]) < 1e-5 and r["param_diff"] < 1e-4
        assert r["prefetches"] > 0 and 2 <= r["max_alive"] <= 3, r
        assert r["max_total"] <= r["budget"], r
    unlimited = run_distributed(_limit_job, 2, None)[0]
    assert unlimited["max_alive"] >= 2 and unlimited["prefetches"] > 0


class _Conditional(nn.Module):
    """Skips the middle block on odd steps (same decision on every rank)."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt = gpt
        self.step = 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        g = self.gpt
        x = g.tok_emb(idx) + g.pos_emb(torch.arange(idx.size(1)))
        for i, block in enumerate(g.blocks):
            if i == 1 and self.step % 2 == 1:
                continue
            x = block(x)
        self.step += 1
        return g.lm_head(g.ln_f(x))


def _conditional_job() -> dict:
    rank, world = rank_world()
    torch.manual_seed(0)
    cfg = GPTConfig(**TINY)
    ref = _Conditional(GPT(cfg))
    model = copy.deepcopy(ref)
    for block in model.gpt.blocks:
        fully_shard(block)
    fully_shard(model)
    diffs = _train_traced(model, ref, cfg, steps=5)
    ev = _step_events(2)  # step 2 skips blocks.1 but step 1's order had it
    unused = [e for e in ev if e["name"] == "prefetch gpt.blocks.1"]
    freed = [e for e in ev if e["name"] == "unsharded_free gpt.blocks.1"]
    states_clean = all(
        m._fsdp_state().unit.state.value == "sharded" for m in model.modules()
        if isinstance(m, FSDPModule) and m._fsdp_state().unit is not None
    )
    return {"diffs": diffs, "param_diff": max_param_diff(model, ref)[0],
            "mistargeted_prefetch": len(unused), "freed": len(freed), "clean": states_clean}


def test_order_change_stays_correct() -> None:
    for r in run_distributed(_conditional_job, 2):
        assert max(r["diffs"]) < 1e-5 and r["param_diff"] < 1e-4
        assert r["mistargeted_prefetch"] >= 1 and r["freed"] >= 1, r
        assert r["clean"], r


def _trace_export_job(out_dir: str) -> dict:
    rank, world = rank_world()
    torch.manual_seed(0)
    cfg = GPTConfig(**TINY)
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train(steps: int) -> None:
        for step in range(steps):
            x, y = make_batch(cfg, 2, step)
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    _TIMELINE.clear()
    train(1)  # off: records nothing, subscribes nothing
    off = {"events": len(_TIMELINE.events()), "listeners": len(model._fsdp_state().settings.events.on_collective)}
    _TIMELINE.clear()
    with trace.recording(model, timeline=_TIMELINE):
        train(3)
    path = os.path.join(out_dir, f"trace.rank{rank}.json")
    _TIMELINE.export_chrome_trace(path)
    torch.distributed.barrier()
    if rank == 0:
        trace.merge_chrome_traces(
            [os.path.join(out_dir, f"trace.rank{r}.json") for r in range(world)],
            os.path.join(out_dir, "trace.merged.json"),
        )
    return {"off": off, "exposed": _TIMELINE.exposed_communication()}


def test_trace_chrome_json(tmp_path) -> None:
    results = run_distributed(_trace_export_job, 2, str(tmp_path))
    for r in results:
        assert r["off"] == {"events": 0, "listeners": 0}
        exposed = r["exposed"]
        assert set(exposed) >= {2, 3, 4} and all(v >= 0 for v in exposed.values()), exposed
    with open(tmp_path / "trace.merged.json") as f:
        merged = json.load(f)
    events = merged["traceEvents"]
    assert {e["pid"] for e in events if "pid" in e} == {0, 1}
    for e in events:
        assert e["ph"] in {"X", "i", "C", "M"}, e
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float))
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["name"]
    names = {e["name"] for e in events}
    for kind in ("all_gather", "reduce_scatter"):
        assert any(n.startswith(kind) for n in names), (kind, sorted(set(names)))
    assert any(n.startswith("wait ") for n in names), sorted(set(names))
    assert any(n.startswith("forward ") for n in names), sorted(set(names))
    assert any(n.startswith("backward ") for n in names), sorted(set(names))
    threads = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"compute", "comm: all_gather", "comm: reduce_scatter"} <= threads


def _inflight_job() -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(**TINY)
    ref = GPT(cfg)
    model = copy.deepcopy(ref)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    errors = []
    for bad, exc in ((0, ValueError), (True, TypeError)):
        try:
            model.set_reduce_scatter_max_input_buffers(bad)
        except exc:
            errors.append(exc.__name__)
    model.set_reduce_scatter_max_input_buffers(2)
    diffs = _train_traced(model, ref, cfg, steps=3)
    ev = _step_events(3)
    # with two in flight, blocks.2's reduce-scatter is waited only after blocks.1's
    # was issued (with one, before)
    wait2 = _first(ev, "wait reduce_scatter blocks.2")
    issue1 = _first(ev, "reduce_scatter blocks.1")
    return {"diffs": diffs, "param_diff": max_param_diff(model, ref)[0], "errors": errors,
            "deferred_wait": wait2["ts"] > issue1["ts"]}


def test_reduce_scatter_max_input_buffers() -> None:
    for r in run_distributed(_inflight_job, 2):
        assert r["errors"] == ["ValueError", "TypeError"]
        assert max(r["diffs"]) < 1e-5 and r["param_diff"] < 1e-4
        assert r["deferred_wait"], r
