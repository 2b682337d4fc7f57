"""Estimator accuracy: predicted (``fsdp_compose.plan.estimate``) vs measured peak memory.

    python benchmarks/estimator_accuracy.py                 # the BENCHMARKS.md table
    python benchmarks/estimator_accuracy.py --quick         # a few rows

For each case, ``W`` fresh rank processes (``harness.run_job``, gloo, one thread
each) build the model on the meta device, apply ``fsdp_compose.auto_wrap`` with
the case's settings, materialize their shards, create the optimizer, run a
warm-up step and then measure one step with torch's allocated-bytes tracker
(``torch.distributed._tools.mem_tracker.MemTracker``, the model and optimizer
state counted): the quantity ``torch.cuda.max_memory_allocated`` reports on a
GPU, the largest over ranks. The estimate is computed once, in this process, on
the meta device, for the same case. Ratio = measured / predicted.

Models (``MODELS``): the examples' GPT, a Hugging Face Llama built from a config
(no download), and the GPT with its LM head tied to the token embedding.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
from torch import nn

_HERE = os.path.dirname(os.path.abspath(__file__))
_EXAMPLES = os.path.join(os.path.dirname(_HERE), "examples")
for _p in (_HERE, _EXAMPLES):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from gpt import GPT, GPTConfig


@dataclass(frozen=True)
class Case:
    """One measured configuration."""

    model: str  # key of MODELS
    world_size: int
    reshard: bool | int = True
    bf16: bool = False
    offload: bool = False
    checkpoint: bool = False
    optimizer: str = "adamw"
    batch: int = 2
    seq: int = 256

    @property
    def label(self) -> str:
        extra = [
            x
            for x, on in (("bf16", self.bf16), ("offload", self.offload), ("AC", self.checkpoint))
            if on
        ]
        if self.optimizer != "adamw":
            extra.append(self.optimizer)
        return f"{self.model} W={self.world_size} reshard={self.reshard}" + (
            " " + " ".join(extra) if extra else ""
        )


def _gpt(tied: bool, scale: str) -> nn.Module:
    if scale == "test":
        cfg = GPTConfig(
            vocab_size=4096, block_size=128, n_layer=3, n_head=4, n_embd=256, tie_weights=tied
        )
    else:
        cfg = GPTConfig(
            vocab_size=8192, block_size=256, n_layer=4, n_head=6, n_embd=384, tie_weights=tied
        )
    with torch.device("meta"):
        return GPT(cfg)


def _llama(scale: str) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    # (hidden, layers, heads, kv heads, MLP, vocab, positions)
    sizes = (256, 3, 4, 2, 688, 4096, 128) if scale == "test" else (384, 4, 6, 2, 1024, 8192, 256)
    hidden, layers, heads, kv_heads, mlp, vocab, positions = sizes
    cfg = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=mlp,
        vocab_size=vocab,
        max_position_embeddings=positions,
    )
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


MODELS = {
    "gpt": lambda scale: _gpt(False, scale),
    "llama": _llama,
    "tied": lambda scale: _gpt(True, scale),
}


def build_meta(name: str, scale: str = "bench") -> nn.Module:
    """The model ``name`` on the meta device (``scale``: ``bench`` or ``test``)."""
    return MODELS[name](scale)


def _policy(model: nn.Module) -> Any:
    return getattr(model, "_no_split_modules", None) or ["Block"]


def _policies(case: Case) -> tuple[Any, Any]:
    from fsdp_compose import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if case.bf16
        else MixedPrecisionPolicy()
    )
    return mp, (CPUOffloadPolicy(pin_memory=False) if case.offload else OffloadPolicy())


def predict(case: Case, scale: str = "bench") -> Any:
    """The estimator's :class:`MemoryEstimate` for ``case``."""
    from fsdp_compose.plan import estimate

    model = build_meta(case.model, scale)
    mp, offload = _policies(case)
    return estimate(
        model,
        batch=case.batch,
        seq=case.seq,
        world_size=case.world_size,
        policy=_policy(model),
        reshard_after_forward=case.reshard,
        activation_checkpointing=case.checkpoint,
        mp_policy=mp,
        offload_policy=offload,
        optimizer=case.optimizer,
        device="cpu",
    )


def _optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-3)
    if name == "sgd_momentum":
        return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def materialize(model: nn.Module) -> None:
    """Gives a meta-device model (sharded or not) CPU storage and random weights."""
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.normal_(0.0, 0.02)
        for b in model.buffers():  # e.g. rotary frequencies: recompute as the model would
            b.zero_()


def training_step(model: Any, optim: Any, case: Case, seed: int) -> Any:
    """One training step of ``model`` on random tokens of ``case``'s shape (the
    gradients kept between steps: ``zero_grad(set_to_none=False)``)."""
    import torch.nn.functional as F

    vocab = model.cfg.vocab_size if hasattr(model, "cfg") else model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)

    def step() -> None:
        ids = torch.randint(0, vocab, (case.batch, case.seq), generator=gen)
        out = model(ids)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids.reshape(-1))
        del out, logits
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=False)

    return step


def measure_rank(
    case_dict: dict[str, Any], scale: str = "bench", plan: Any = None, steps: int = 1
) -> dict[str, int]:
    """Runs ``steps`` training steps on this rank (process group already up);
    returns the measured peak of allocated tensor bytes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compose import auto_wrap

    case = Case(**case_dict)
    torch.manual_seed(0)
    model = build_meta(case.model, scale)
    mp, offload = _policies(case)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if plan is None:
        auto_wrap(
            model,
            _policy(model),
            mesh=mesh,
            reshard_after_forward=case.reshard,
            mp_policy=mp,
            offload_policy=offload,
            activation_checkpointing=case.checkpoint,
        )
    else:
        auto_wrap(model, plan=plan, mesh=mesh, mp_policy=mp, offload_policy=offload)
    materialize(model)
    optim = _optimizer(model, case.optimizer)
    step = training_step(model, optim, case, seed=dist.get_rank())

    # One warm-up step first: it creates the optimizer states and the gradients
    # (kept: set_to_none=False). The measured step then runs under torch's own
    # allocated-bytes tracker (the quantity torch.cuda.max_memory_allocated
    # reports on a GPU), with the model and optimizer state counted as live.
    step()
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optim)
    peak = 0
    started = time.perf_counter()
    sent = [0.0]
    for i in range(steps):
        # The first measured step also counts the bytes sent (an observer of the
        # collectives: Python numbers, nothing the tracker sees).
        with tracker, _bytes_sent(model, sent) if i == 0 else contextlib.nullcontext():
            step()
        peak = max(
            peak, int(sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values()))
        )
        tracker.reset_mod_stats()
    step_s = (time.perf_counter() - started) / steps
    return {"measured": peak, "step_s": step_s, "sent": sent[0]}


@contextlib.contextmanager
def _bytes_sent(model: Any, sent: list[float]) -> Iterator[None]:
    """Adds to ``sent[0]`` the bytes this rank sends in the block, the ring ideal of
    each collective."""
    from fsdp_compose import Observer

    class _Sent(Observer):
        def on_collective(self, event: str, info: Any) -> None:  # type: ignore[override]
            if event != "issue":
                return
            w = info.group_size
            if info.kind == "all_gather":
                sent[0] += info.output_bytes * (w - 1) / w
            elif info.kind == "reduce_scatter":
                sent[0] += info.input_bytes * (w - 1) / w
            else:
                sent[0] += 2 * info.input_bytes * (w - 1) / w

    observer = _Sent()
    model.register_observer(observer)
    try:
        yield
    finally:
        model.unregister_observer(observer)


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def measure_job(config: dict[str, Any]) -> dict[str, Any]:
    """``worker.py`` entry point (``kind: "estimate"``)."""
    if config.get("calibrate"):
        return calibrate_bandwidth()
    plan = plan_from_dict(config["plan"]) if config.get("plan") else None
    return measure_rank(
        config["case"], config.get("scale", "bench"), plan=plan, steps=config.get("steps", 1)
    )


def plan_to_dict(plan: Any) -> dict[str, Any]:
    return {
        "prefetch_depth": plan.prefetch_depth,
        "units": [[list(u.modules), u.reshard_after_forward, u.checkpoint] for u in plan.units],
    }


def plan_from_dict(d: dict[str, Any]) -> Any:
    from fsdp_compose.plan import ShardingPlan, UnitPlan

    return ShardingPlan(
        tuple(UnitPlan(tuple(m), r, c) for m, r, c in d["units"]), d["prefetch_depth"]
    )


def calibrate_bandwidth(nbytes: int = 16 << 20, repeats: int = 5) -> dict[str, Any]:
    """Bytes/s one rank sends in an all-gather over the default group (gloo), and
    the fraction of that all-gather's time that passes while the rank computes
    (``overlap``: 1 when it costs compute nothing, 0 when compute and it take turns)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    chunk = torch.ones(nbytes // 4 // world)
    out = torch.empty(chunk.numel() * world)
    dist.all_gather_into_tensor(out, chunk)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_gather_into_tensor(out, chunk)
    elapsed = (time.perf_counter() - start) / repeats
    sent = (world - 1) / world * out.numel() * 4

    a = torch.randn(256, 256)

    def compute(n: int) -> float:
        begin = time.perf_counter()
        for _ in range(n):
            torch.mm(a, a)
        return time.perf_counter() - begin

    n = max(1, round(elapsed / (compute(20) / 20)))  # compute about as long as one all-gather
    overlaps = []
    for _ in range(repeats):
        dist.barrier()
        alone = compute(n)
        dist.barrier()
        begin = time.perf_counter()
        work = dist.all_gather_into_tensor(out, chunk, async_op=True)
        compute(n)
        work.wait()  # type: ignore[union-attr]
        both = time.perf_counter() - begin
        overlaps.append(min(1.0, max(0.0, (alone + elapsed - both) / elapsed)))
    # gloo's worker drops its reference to the last collective's tensors a moment
    # after the wait returns: free them only after every rank is past it.
    dist.barrier()
    time.sleep(0.2)
    del chunk, out
    return {
        "measured": 0,
        "bandwidth": sent / elapsed,
        "overlap": sorted(overlaps)[len(overlaps) // 2],
        "step_s": elapsed,
    }


def run_case(case: Case, scale: str = "bench", steps: int = 1) -> dict[str, Any]:
    """Measures ``case`` on fresh ranks (allocated tensor bytes, torch's
    ``MemTracker``) and compares with the estimate. ``steps``: the measured
    steps after the warm-up one (the peak over all of them)."""
    from harness import run_job

    est = predict(case, scale)
    ranks = run_job(
        {
            "kind": "estimate",
            "impl": "fsdp_compose",
            "world_size": case.world_size,
            "case": asdict(case),
            "scale": scale,
            "steps": steps,
        },
        timeout_s=900,
    )
    measured = max(r["measured"] for r in ranks)
    return {
        "case": case.label,
        "predicted": est.peak_bytes_per_rank,
        "measured": measured,
        "ratio": measured / est.peak_bytes_per_rank,
        "peak_at": est.peak_at,
        "step_s": max(r["step_s"] for r in ranks),
    }


def cases(quick: bool) -> list[Case]:
    out: list[Case] = []
    worlds = (1, 2, 4, 8)
    for model in ("gpt", "llama", "tied"):
        for w in worlds:
            out.append(Case(model, w))
    for w in (2, 8):
        out.append(Case("gpt", w, reshard=False))
        out.append(Case("llama", w, reshard=False))
    out.append(Case("gpt", 8, reshard=2))
    out.append(Case("gpt", 8, reshard=4))
    for w in (1, 4):
        out.append(Case("gpt", w, bf16=True))
        out.append(Case("llama", w, bf16=True))
        out.append(Case("gpt", w, offload=True))
        out.append(Case("gpt", w, checkpoint=True))
    out.append(Case("gpt", 4, optimizer="sgd"))
    if quick:
        out = [c for c in out if c.world_size in (1, 4) and c.model == "gpt"][:4]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a few cases only")
    parser.add_argument(
        "--cases", nargs="+", metavar="LABEL", help="only the cases whose label starts so"
    )
    parser.add_argument(
        "--steps", type=int, default=1, help="measured steps after the warm-up one (default 1)"
    )
    args = parser.parse_args()
    rows = []
    print("| case | predicted (MiB) | measured (MiB) | measured / predicted | predicted peak at |")
    print("| --- | ---: | ---: | ---: | --- |")
    selected = [
        c for c in cases(args.quick) if not args.cases or c.label.startswith(tuple(args.cases))
    ]
    for case in selected:
        r = run_case(case, steps=args.steps)
        rows.append(r)
        print(
            f"| {r['case']} | {r['predicted'] / 2**20:.1f} | {r['measured'] / 2**20:.1f} | "
            f"{r['ratio']:.3f} | {r['peak_at']} |",
            flush=True,
        )
    ratios = [r["ratio"] for r in rows]
    print(
        f"\n{len(rows)} cases; measured/predicted from {min(ratios):.3f} to {max(ratios):.3f}; "
        f"{sum(abs(x - 1) <= 0.05 for x in ratios)} within 5%"
    )


if __name__ == "__main__":
    main()
