"""torch.optim.Muon on sharded parameters: optimizer step and training step times.

For each world size W and model, one job of W fresh processes (gloo, one thread
each) measures, in alternating order within the same job:

* ``single``: one process's ``torch.optim.Muon`` step on the whole model (rank 0,
  while the other ranks wait in a barrier);
* ``fsdp_compose``: fsdp_compose's sharded Muon step (owner compute);
* ``fsdp2``: torch's FSDP2 + ``torch.optim.Muon`` (DTensor dispatch);

then whole training steps (forward, backward, step) with Muon + AdamW vs AdamW
alone on fsdp_compose, and the same optimizer steps on one process to get
single-device Muon's extra cost. The exchange's bytes come from the plan (what
each rank sends to the others) against ``2·(W-1)/W`` of the fp32 matrix bytes.

``--profile`` adds where one optimizer step's time goes (Linux: per-thread CPU
from ``/proc/self/task``): Newton–Schulz and everything else on the main thread,
gloo's threads (transfers), and the wall time no thread of the rank used; the
same split of one process's step; and each rank's phases (its time to the first
Newton–Schulz and after the last, and where it waits for the exchange).

    python benchmarks/muon.py --worlds 2 4 --models square gpt
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _muon_params(model: Any, kind: str) -> tuple[list[Any], list[Any]]:
    matrices, rest = [], []
    for name, p in model.named_parameters():
        hidden = p.ndim == 2 and not any(s in name for s in ("tok_emb", "pos_emb", "lm_head"))
        (matrices if hidden else rest).append(p)
    return matrices, rest


def _build(kind: str, impl: str) -> Any:
    import torch
    from torch import nn

    if kind == "gpt":
        from workloads import build_gpt

        return build_gpt("small", impl if impl != "single" else "single")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(8)])
    if impl != "single":
        if impl == "fsdp2":
            from torch.distributed.fsdp import fully_shard
        else:
            from fsdp_compose import fully_shard
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    return model


def _forward_backward(model: Any, kind: str, rank: int, world: int) -> None:
    import torch

    if kind == "gpt":
        from gpt import loss_fn
        from workloads import PRESETS, Batches

        x, y = Batches(PRESETS["small"], 8, rank, world).get(0)
        loss_fn(model(x), y).backward()
    else:
        torch.manual_seed(rank)
        model(torch.randn(8, 512)).square().mean().backward()


_CPU: dict[
    str, list[float]
] = {}  # process CPU seconds per step, by label (all threads of the rank)


def _timed(fn: Any, steps: int, sync: bool = True, label: str | None = None) -> float:
    """Median wall seconds of ``fn``; also records its process CPU time under
    ``label`` (robust to other jobs sharing the machine's cores)."""
    import torch.distributed as dist

    times = []
    for _ in range(steps):
        if sync:
            dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - t0)
        if label is not None:
            _CPU.setdefault(label, []).append(time.process_time() - c0)
    return statistics.median(times)


def _thread_cpu() -> dict[str, float]:
    """CPU seconds used so far by this process's threads: the main thread, gloo's
    threads (its work queue and TCP loop) and the others (Linux only)."""
    out = {"main": 0.0, "gloo": 0.0, "other": 0.0}
    task = "/proc/self/task"
    for tid in os.listdir(task):
        try:
            with open(f"{task}/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"{task}/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except OSError:  # the thread ended meanwhile
            continue
        kind = "main" if int(tid) == os.getpid() else "gloo" if "gloo" in name else "other"
        out[kind] += ns / 1e9
    return out


def _profile_steps(
    step: Any, steps: int, ns_module: Any, ns_name: str, sync: bool = True
) -> dict[str, float]:
    """Median per-step split of ``step`` (seconds): Newton–Schulz on the main
    thread (``ns_module.ns_name`` timed), the rest of the main thread, gloo's
    threads, and the wall time not spent on the main thread's CPU."""
    import torch.distributed as dist

    original = getattr(ns_module, ns_name)
    ns_cpu = [0.0]

    def timed(*args: Any, **kwargs: Any) -> Any:
        c0 = time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            ns_cpu[0] += time.thread_time() - c0

    rows: list[dict[str, float]] = []
    setattr(ns_module, ns_name, timed)
    try:
        for _ in range(steps):
            if sync:
                dist.barrier()
            ns_cpu[0] = 0.0
            before, t0 = _thread_cpu(), time.perf_counter()
            step()
            wall, after = time.perf_counter() - t0, _thread_cpu()
            main = after["main"] - before["main"]
            rows.append(
                {
                    "wall": wall,
                    "newton_schulz": ns_cpu[0],
                    "main_rest": main - ns_cpu[0],
                    "gloo_threads": after["gloo"] - before["gloo"],
                    "main_not_on_cpu": wall - main,
                }
            )
    finally:
        setattr(ns_module, ns_name, original)
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


PHASES = ("head", "head_wait", "mid_wait", "tail_wait", "tail", "ns_wall", "ns_cpu", "wall")


def _phase_steps(step: Any, steps: int, ns_module: Any) -> dict[str, float]:
    """Median per-step phases of this rank's sharded step (seconds, wall clock
    unless named cpu): ``head`` from the step's start to its first Newton-Schulz,
    ``tail`` from its last Newton-Schulz to the step's end, and the time spent in
    the exchange's waits before, between and after the Newton-Schulz calls. A
    rank that waits at the tail while the other computes shows the imbalance."""
    import torch.distributed as dist

    original_ns, original_a2a = ns_module.newton_schulz, dist.all_to_all_single
    spans: list[tuple[str, float, float]] = []
    ns_cpu = [0.0]

    def ns(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return original_ns(*args, **kwargs)
        finally:
            spans.append(("ns", t0, time.perf_counter()))
            ns_cpu[0] += time.thread_time() - c0

    class _Timed:
        def __init__(self, work: Any) -> None:
            self.work = work

        def wait(self) -> Any:
            t0 = time.perf_counter()
            try:
                return self.work.wait()
            finally:
                spans.append(("wait", t0, time.perf_counter()))

    def a2a(*args: Any, **kwargs: Any) -> Any:
        return _Timed(original_a2a(*args, **kwargs))

    def reduce(*args: Any, **kwargs: Any) -> Any:
        work = original_reduce(*args, **kwargs)
        return _Timed(work) if kwargs.get("async_op") else work

    original_reduce = dist.all_reduce
    rows = []
    ns_module.newton_schulz, dist.all_to_all_single = ns, a2a
    dist.all_reduce = reduce
    try:
        for _ in range(steps):
            dist.barrier()
            spans.clear()
            ns_cpu[0] = 0.0
            start = time.perf_counter()
            step()
            end = time.perf_counter()
            calls = [(a, b) for kind, a, b in spans if kind == "ns"]
            first, last = (calls[0][0], calls[-1][1]) if calls else (end, end)
            waits = [(a, b) for kind, a, b in spans if kind == "wait"]
            rows.append(
                {
                    "head": first - start,
                    "head_wait": sum(b - a for a, b in waits if b <= first),
                    "mid_wait": sum(b - a for a, b in waits if a >= first and b <= last),
                    "tail_wait": sum(b - a for a, b in waits if a >= last),
                    "tail": end - last,
                    "ns_wall": sum(b - a for a, b in calls),
                    "ns_cpu": ns_cpu[0],
                    "wall": end - start,
                }
            )
    finally:
        ns_module.newton_schulz, dist.all_to_all_single = original_ns, original_a2a
        dist.all_reduce = original_reduce
    return {k: statistics.median(r[k] for r in rows) for k in PHASES}


def _max_over_ranks(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _rank_main(
    rank: int,
    world: int,
    store: str,
    kind: str,
    steps: int,
    repeats: int,
    out: str,
    profile: bool = False,
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    sys.path[:0] = [_REPO, os.path.join(_REPO, "examples"), os.path.join(_REPO, "benchmarks")]
    import harness
    import torch
    import torch.distributed as dist

    harness.init_gloo(rank, world, store, timeout_s=1800)
    from fsdp_compose.whole_matrix import _muon

    models, opts = {}, {}
    for impl in ("fsdp_compose", "fsdp2") + (("single",) if rank == 0 else ()):
        model = _build(kind, impl)
        _forward_backward(
            model, kind, rank if impl != "single" else 0, world if impl != "single" else 1
        )
        matrices, _ = _muon_params(model, kind)
        opt = torch.optim.Muon(matrices, lr=1e-3)
        if impl == "fsdp_compose":
            from fsdp_compose import enable_sharded_step

            enable_sharded_step(opt)  # the whole-matrix step (owner compute)
        models[impl], opts[impl] = model, opt
        opts[impl].step()  # warm-up (creates the momentum buffers)

    result: dict[str, Any] = {"kind": kind, "world": world, "optimizer_step_s": {}}
    samples: dict[str, list[float]] = {"single": [], "fsdp_compose": [], "fsdp2": []}
    for r in range(repeats):
        order = ["single", "fsdp_compose", "fsdp2"]
        for impl in order if r % 2 == 0 else order[::-1]:
            if impl == "single":
                dist.barrier()
                t = (
                    _timed(opts["single"].step, steps, sync=False, label="single")
                    if rank == 0
                    else 0.0
                )
                dist.barrier()
            else:
                t = _timed(opts[impl].step, steps, label=impl)
            samples[impl].append(_max_over_ranks(t))
    result["optimizer_step_s"] = {k: statistics.median(v) for k, v in samples.items()}
    result["optimizer_step_cpu_s"] = {
        k: _max_over_ranks(statistics.median(_CPU[k]) if k in _CPU else 0.0) for k in samples
    }

    plan = next(iter(_muon._caches[opts["fsdp_compose"]].plans.values()))
    sent = torch.tensor([plan.exchanged_bytes(torch.bfloat16)], dtype=torch.float64)
    dist.all_reduce(sent)
    matrix_bytes = sum(4 * p.numel() for p in _muon_params(models["fsdp_compose"], kind)[0])
    result["exchange_bytes_all_ranks"] = sent.item()
    result["matrix_fp32_bytes"] = matrix_bytes
    result["ideal_fp32_bytes"] = 2 * (world - 1) / world * matrix_bytes
    result["rounds"] = len(plan.rounds)
    if profile:
        # One process's step (rank 0; torch's private Newton-Schulz function is
        # timed, benchmark only), then the sharded step on every rank.
        import torch.optim._muon as torch_muon

        dist.barrier()
        single_split = (
            _profile_steps(
                opts["single"].step,
                3 * steps,
                torch_muon,
                "_zeropower_via_newtonschulz",
                sync=False,
            )
            if rank == 0
            else {}
        )
        dist.barrier()
        split = _profile_steps(opts["fsdp_compose"].step, 3 * steps, _muon, "newton_schulz")
        result["profile"] = {
            "single": single_split,
            "fsdp_compose": {k: _max_over_ranks(v) for k, v in split.items()},
        }
        # Each rank's own phases (not the maximum): where its main thread waits.
        phases = _phase_steps(opts["fsdp_compose"].step, 3 * steps, _muon)
        mine = torch.tensor([phases[k] for k in PHASES], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        result["phases"] = [dict(zip(PHASES, t.tolist())) for t in every]
    del models["fsdp2"], opts["fsdp2"]

    # Whole training steps on fsdp_compose: Muon for the matrices + AdamW for the rest vs AdamW alone.
    model = models["fsdp_compose"]
    matrices, rest = _muon_params(model, kind)
    from fsdp_compose import enable_sharded_step

    muon = enable_sharded_step(torch.optim.Muon(matrices, lr=1e-3))
    with_muon = [muon, torch.optim.AdamW(rest, lr=1e-3)] if rest else [muon]
    adamw = [torch.optim.AdamW(model.parameters(), lr=1e-3)]

    def train(optims: list[Any]) -> None:
        _forward_backward(model, kind, rank, world)
        for o in optims:
            o.step()
            o.zero_grad()

    train(with_muon)
    train(adamw)
    train_samples: dict[str, list[float]] = {"muon": [], "adamw": []}
    for r in range(repeats):
        for name in ["muon", "adamw"] if r % 2 == 0 else ["adamw", "muon"]:
            train_samples[name].append(
                _max_over_ranks(
                    _timed(lambda name=name: train(with_muon if name == "muon" else adamw), steps)
                )
            )
    result["train_step_s"] = {k: statistics.median(v) for k, v in train_samples.items()}

    # Single device: Muon's extra cost over AdamW on the same matrices (rank 0).
    if rank == 0:
        single = models["single"]
        sm = _muon_params(single, kind)[0]
        s_adamw = torch.optim.AdamW(sm, lr=1e-3)
        s_adamw.step()
        result["single_adamw_matrices_s"] = _timed(s_adamw.step, steps, sync=False)
    dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def run(kind: str, world: int, steps: int, repeats: int, profile: bool = False) -> dict[str, Any]:
    import torch.multiprocessing as mp

    workdir = tempfile.mkdtemp(prefix="fsdp_compose_muon_")
    store, out = os.path.join(workdir, "store"), os.path.join(workdir, "out.json")
    mp.start_processes(
        _rank_main,
        args=(world, store, kind, steps, repeats, out, profile),
        nprocs=world,
        start_method="spawn",
    )
    with open(out) as f:
        return json.load(f)


def summarize(r: dict[str, Any]) -> dict[str, Any]:
    opt = r["optimizer_step_s"]
    cpu = r["optimizer_step_cpu_s"]
    train = r["train_step_s"]
    single_extra = opt["single"] - r["single_adamw_matrices_s"]
    return {
        "model": r["kind"],
        "W": r["world"],
        "single_ms": 1e3 * opt["single"],
        "fsdp_compose_ms": 1e3 * opt["fsdp_compose"],
        "fsdp2_ms": 1e3 * opt["fsdp2"],
        "vs_single": opt["fsdp_compose"] / opt["single"],
        "vs_fsdp2": opt["fsdp_compose"] / opt["fsdp2"],
        "cpu_vs_single": cpu["fsdp_compose"] / cpu["single"],
        "cpu_vs_fsdp2": cpu["fsdp_compose"] / cpu["fsdp2"],
        "exchange_vs_ideal_fp32": r["exchange_bytes_all_ranks"] / r["ideal_fp32_bytes"],
        "exchange_MiB": r["exchange_bytes_all_ranks"] / 2**20,
        "rounds": r["rounds"],
        "train_muon_ms": 1e3 * train["muon"],
        "train_adamw_ms": 1e3 * train["adamw"],
        "train_ratio": train["muon"] / train["adamw"],
        "muon_extra_per_rank_ms": 1e3 * (train["muon"] - train["adamw"]),
        "single_extra_over_W_ms": 1e3 * single_extra / r["world"],
        **({"profile": r["profile"]} if "profile" in r else {}),
        **({"phases": r["phases"]} if "phases" in r else {}),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    """The BENCHMARKS.md tables for ``rows`` (from one run)."""
    head = (
        "| model | W | one process (ms) | fsdp_compose (ms) | FSDP2 + Muon (ms) | vs one process "
        "| vs FSDP2 | on-CPU vs one process | on-CPU vs FSDP2 | exchange / ideal fp32 | rounds |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r['model']} | {r['W']} | {r['single_ms']:.0f} | {r['fsdp_compose_ms']:.0f} | "
        f"{r['fsdp2_ms']:.0f} | {r['vs_single']:.2f} | {r['vs_fsdp2']:.2f} | "
        f"{r['cpu_vs_single']:.2f} | {r['cpu_vs_fsdp2']:.2f} | "
        f"{r['exchange_vs_ideal_fp32']:.2f} ({r['exchange_MiB']:.1f} MiB) | {r['rounds']} |\n"
        for r in rows
    )
    head2 = (
        "\n| model | W | train step, Muon (ms) | train step, AdamW (ms) | Muon / AdamW "
        "| Muon's extra per rank (ms) | one process's Muon extra / W (ms) |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    body2 = "".join(
        f"| {r['model']} | {r['W']} | {r['train_muon_ms']:.0f} | {r['train_adamw_ms']:.0f} | "
        f"{r['train_ratio']:.2f} | {r['muon_extra_per_rank_ms']:.0f} | {r['single_extra_over_W_ms']:.0f} |\n"
        for r in rows
    )
    profiled = [r for r in rows if "profile" in r]
    if not profiled:
        return head + body + head2 + body2
    head3 = (
        "\n| model | W | step (ms) | Newton-Schulz (ms) | rest of the main thread (ms) "
        "| gloo's threads (ms) | main thread off CPU (ms) | one process: Newton-Schulz / rest (ms) |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    body3 = ""
    for r in profiled:
        ours, one = r["profile"]["fsdp_compose"], r["profile"]["single"]
        body3 += (
            f"| {r['model']} | {r['W']} | {1e3 * ours['wall']:.1f} | {1e3 * ours['newton_schulz']:.1f} | "
            f"{1e3 * ours['main_rest']:.1f} | {1e3 * ours['gloo_threads']:.1f} | "
            f"{1e3 * ours['main_not_on_cpu']:.1f} | {1e3 * one['newton_schulz']:.1f} / "
            f"{1e3 * one['main_rest']:.1f} |\n"
        )
    head4 = (
        "\n| model | W | rank | step (ms) | start to first Newton-Schulz (ms) | its waits (ms) "
        "| waits between Newton-Schulz calls (ms) | last Newton-Schulz to end (ms) "
        "| its waits (ms) | Newton-Schulz wall / CPU (ms) |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    body4 = ""
    for r in profiled:
        for rank, ph in enumerate(r.get("phases", [])):
            ms = {k: 1e3 * v for k, v in ph.items()}
            body4 += (
                f"| {r['model']} | {r['W']} | {rank} | {ms['wall']:.1f} | {ms['head']:.1f} | "
                f"{ms['head_wait']:.1f} | {ms['mid_wait']:.1f} | {ms['tail']:.1f} | "
                f"{ms['tail_wait']:.1f} | {ms['ns_wall']:.1f} / {ms['ns_cpu']:.1f} |\n"
            )
    return head + body + head2 + body2 + head3 + body3 + (head4 + body4 if body4 else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", default=["square", "gpt"], choices=["square", "gpt"])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per sample (median)")
    parser.add_argument(
        "--repeats", type=int, default=2, help="alternating samples per implementation"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also split one optimizer step's time by thread and phase (Linux)",
    )
    parser.add_argument("--table", help="print the markdown tables of this results file and exit")
    parser.add_argument("--out", default=os.path.join(_REPO, "benchmarks", "results", "muon.json"))
    args = parser.parse_args()
    if args.table:
        with open(args.table) as f:
            print(markdown(json.load(f)))
        return
    rows = []
    for kind in args.models:
        for world in args.worlds:
            row = summarize(run(kind, world, args.steps, args.repeats, args.profile))
            rows.append(row)
            print(
                json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
                flush=True,
            )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(markdown(rows))


if __name__ == "__main__":
    main()
