"""The optimizer step alone, and host memory over a long run: FSDP2's DTensor step,
fsdp_compose's default (DTensor) step and fsdp_compose's ``enable_sharded_step``.

One job of W fresh processes (gloo, one thread each; ``harness.spawn_ranks``):

* **step time.** For each optimizer (AdamW fused, AdamW foreach, SGD with momentum,
  Muon on the 2-D weights), the same model (``--units`` blocks of
  ``Linear(width) + LayerNorm``, each block and the root ``fully_shard``-ed) is built
  three times, one per mode, and gets the same gradients; then ``--repeats``
  samples per mode, the modes alternated (ABC, CBA, ...), each sample the median of
  ``--steps`` steps behind a barrier, the maximum over ranks. Every mode takes the
  same number of steps, so their parameters must agree at the end: the table says
  whether they are bit-identical to FSDP2's.
* **host memory.** For each mode and optimizer in turn, ``--rss-steps`` optimizer
  steps (with ``--rss-train``, training steps: forward, backward, step,
  ``zero_grad``) of a tiny model (``--rss-units`` blocks of ``--rss-width``); the resident set size (``/proc/self/statm``) is sampled
  every ``--rss-every`` steps and its slope fitted (least squares) over the second
  half, in bytes per step, the maximum over ranks. ``--rss-objects`` adds the
  ``gc``-tracked objects whose count grew most over that half (by type). Muon on
  the DTensor path (FSDP2 and fsdp_compose's default) runs Newton-Schulz through
  DTensor dispatch, whose every matmul all-gathers over gloo: it takes
  ``--rss-muon-steps`` steps only, the sharded step all of them.

* **offloaded step** (``--offload``). Each optimizer's step time is measured twice in
  the same job: as above, and with every unit built with ``CPUOffloadPolicy``
  (torch's for FSDP2, fsdp_compose's otherwise; ``pin_memory=False``, since pinned
  memory needs an accelerator). On a CPU mesh the sharded parameters already live in
  host memory: FSDP2 still takes its offload code path (its ``.cpu()`` and
  ``.to(device)`` copies are no-ops on CPU tensors), fsdp_compose treats the policy
  as nothing to move, and the optimizer step itself is the same code in both cases;
  the rows measure that the offloaded step costs what the plain one does, not a
  host-device transfer.

    python benchmarks/optim_step.py                 # the table in BENCHMARKS.md
    python benchmarks/optim_step.py --rss-steps 0   # step time only
    python benchmarks/optim_step.py --rss-steps 0 --offload --optimizers adamw_fused adamw_foreach
    python benchmarks/optim_step.py --repeats 0 --optimizers muon --rss-muon-steps 1000  # long run only
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
MODES = ("fsdp2", "fsdp_compose", "sharded_step")
OPTIMIZERS = ("adamw_fused", "adamw_foreach", "sgd", "muon")
OFFLOADED = " + CPUOffloadPolicy"  # the suffix of an offloaded row's name


def _model(units: int, width: int, mode: str, offload: bool = False) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width)) for _ in range(units)]
    )
    if mode == "fsdp2":
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
    else:
        from fsdp_compose import CPUOffloadPolicy, OffloadPolicy, fully_shard
    # pin_memory=False: pinning needs an accelerator (see "--offload" in the docstring).
    policy = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
    for block in model:
        fully_shard(block, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    return model


def _optimizer(name: str, model: Any, mode: str, muon_matrices: int = 8) -> Any:
    import torch

    params = list(model.parameters())
    if name == "adamw_fused":
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    elif name == "adamw_foreach":
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)
    elif name == "sgd":
        opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    else:  # Newton-Schulz is costly on one thread: the first few matrices only
        opt = torch.optim.Muon([p for p in params if p.ndim == 2][:muon_matrices], lr=1e-3)
    if mode == "sharded_step":
        from fsdp_compose import enable_sharded_step

        enable_sharded_step(opt)
    return opt


def _backward(model: Any, width: int, rank: int, step: int = 0) -> None:
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    model(torch.randn(4, width, generator=g)).square().mean().backward()


def _max_over_ranks(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _time_steps(opt: Any, steps: int) -> tuple[float, float]:
    """Median wall and main-thread CPU seconds of ``steps`` steps; the CPU time is
    what other jobs on shared cores do not inflate."""
    import torch.distributed as dist

    walls, cpus = [], []
    for _ in range(steps):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        opt.step()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def _step_times(
    name: str, args: argparse.Namespace, rank: int, offload: bool = False
) -> dict[str, Any]:
    models = {m: _model(args.units, args.width, m, offload) for m in MODES}
    opts = {m: _optimizer(name, models[m], m, args.muon_matrices) for m in MODES}
    for m in MODES:
        _backward(models[m], args.width, rank)
        opts[m].step()  # creates the states
    samples: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    repeats = max(2, args.repeats // 3) if name == "muon" else args.repeats
    for r in range(repeats):
        for m in MODES if r % 2 == 0 else MODES[::-1]:
            wall, thread = _time_steps(opts[m], 1 if name == "muon" else args.steps)
            samples[m].append(_max_over_ranks(wall))
            cpu[m].append(_max_over_ranks(thread))
    ref = [p.to_local() for p in models["fsdp2"].parameters()]
    identical: dict[str, bool | float] = {}
    for m in MODES[1:]:
        diff = max(
            (a - b.to_local()).abs().max().item() for a, b in zip(ref, models[m].parameters())
        )
        diff = _max_over_ranks(diff)
        identical[m] = diff == 0.0 if name != "muon" else diff  # Muon: max |difference|
    return {
        "ms": {m: 1e3 * statistics.median(v) for m, v in samples.items()},
        "cpu_ms": {m: 1e3 * statistics.median(v) for m, v in cpu.items()},
        "identical": identical,
    }


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _slope(xs: list[int], ys: list[int]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def _object_counts() -> collections.Counter[str]:
    return collections.Counter(type(o).__name__ for o in gc.get_objects())


def _rss_run(name: str, mode: str, args: argparse.Namespace, rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    model = _model(args.rss_units, args.rss_width, mode)
    opt = _optimizer(name, model, mode, args.muon_matrices)
    xs: list[int] = []
    ys: list[int] = []
    before: collections.Counter[str] | None = None
    # Muon on the DTensor path (FSDP2's and fsdp_compose's default) runs Newton-Schulz
    # through DTensor dispatch: every matmul all-gathers its operands, tens of gloo
    # round trips per step, ten times the sharded step's time. Those modes take
    # fewer steps; the sharded step, one exchange per step, takes them all.
    dtensor_muon = name == "muon" and mode != "sharded_step"
    steps = min(args.rss_steps, args.rss_muon_steps) if dtensor_muon else args.rss_steps
    half = steps // 2
    _backward(model, args.rss_width, rank)
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(steps):
        if step == half and args.rss_objects:
            gc.collect()
            before = _object_counts()
        if args.rss_train and step:
            opt.zero_grad()
            _backward(model, args.rss_width, rank, step)
        opt.step()
        if step % args.rss_every == 0:
            xs.append(step)
            ys.append(_rss_bytes())
    seconds = time.perf_counter() - t0
    second = [(x, y) for x, y in zip(xs, ys) if x >= half]
    out: dict[str, Any] = {
        "slope_b_per_step": _max_over_ranks(_slope([x for x, _ in second], [y for _, y in second])),
        "growth_mib": _max_over_ranks((ys[-1] - ys[0]) / 2**20),
        "ms_per_step": _max_over_ranks(1e3 * seconds / max(1, steps)),
        "steps": steps,
    }
    if before is not None:
        gc.collect()
        grew = _object_counts() - before
        out["objects_grown"] = dict(grew.most_common(5))
    del model, opt
    gc.collect()
    return out


def _worker(rank: int, world: int, init_file: str, args: argparse.Namespace, queue: Any) -> None:
    sys.path[:0] = [_REPO, _HERE]
    import harness
    import torch.distributed as dist

    harness.init_gloo(rank, world, init_file, timeout_s=1800)
    result: dict[str, Any] = {"step": {}, "rss": {}}
    for name in args.optimizers if args.repeats else ():
        for offload in (False, True) if args.offload else (False,):
            row = name + OFFLOADED if offload else name
            result["step"][row] = _step_times(name, args, rank, offload)
            gc.collect()
            if rank == 0:
                print(row, json.dumps(result["step"][row]), flush=True)
    if args.rss_steps:
        for name in args.optimizers:
            for mode in MODES:
                if name == "muon" and mode != "sharded_step" and not args.rss_muon_steps:
                    continue  # --rss-muon-steps 0: the sharded step's long run only
                r = _rss_run(name, mode, args, rank)
                result["rss"].setdefault(name, {})[mode] = r
                if rank == 0:
                    print(name, mode, json.dumps(r), flush=True)
    dist.barrier()
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def markdown(result: dict[str, Any]) -> str:
    """The BENCHMARKS.md table for one run's ``result``."""
    head = (
        "| optimizer | step, FSDP2 / default / sharded (ms) | default / FSDP2 | sharded / FSDP2 "
        "| speed-up of sharded over FSDP2 | the same in CPU time | same parameters as FSDP2 "
        "| RSS slope, FSDP2 / default / sharded (B/step) |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    rows = ""
    for name, r in result["step"].items():
        ms, cpu, same = r["ms"], r["cpu_ms"], r["identical"]
        rss = result.get("rss", {}).get(name)
        slopes = (
            " / ".join(f"{rss[m]['slope_b_per_step']:.0f}" if m in rss else "n/a" for m in MODES)
            if rss
            else "not run"
        )
        if name.startswith("muon"):
            agree = "max diff " + " / ".join(f"{same[m]:.1e}" for m in MODES[1:])
        else:
            agree = (
                "bit-identical"
                if same["fsdp_compose"] is True and same["sharded_step"] is True
                else "NO"
            )
        rows += (
            f"| {name} | {ms['fsdp2']:.2f} / {ms['fsdp_compose']:.2f} / {ms['sharded_step']:.2f} "
            f"| {ms['fsdp_compose'] / ms['fsdp2']:.2f} | {ms['sharded_step'] / ms['fsdp2']:.2f} "
            f"| {ms['fsdp2'] / ms['sharded_step']:.2f}x | {cpu['fsdp2'] / cpu['sharded_step']:.2f}x "
            f"| {agree} | {slopes} |\n"
        )
    return head + rows


def rss_markdown(result: dict[str, Any]) -> str:
    """The long run's own table: per optimizer and mode, the steps taken, the time
    per step, the RSS slope over the second half and the growth over the run."""
    rows = "".join(
        f"| {name} | {mode} | {r.get('steps', 'n/a')} | {r['ms_per_step']:.1f} "
        f"| {r['slope_b_per_step']:.0f} | {r['growth_mib']:.2f} |\n"
        for name, modes in result.get("rss", {}).items()
        for mode, r in modes.items()
    )
    head = (
        "| optimizer | mode | steps | ms/step | RSS slope, second half (B/step) | RSS growth (MiB) |\n"
        "|---|---|---|---|---|---|\n"
    )
    return head + rows if rows else ""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--units", type=int, default=48)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--steps", type=int, default=5, help="steps per sample (median)")
    p.add_argument(
        "--repeats", type=int, default=6, help="alternated samples per mode (0: no step-time part)"
    )
    p.add_argument("--muon-matrices", type=int, default=8, help="Muon: how many 2-D weights")
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    p.add_argument(
        "--offload",
        action="store_true",
        help="step time also with CPUOffloadPolicy(pin_memory=False) on every unit",
    )
    p.add_argument("--rss-steps", type=int, default=5000)
    p.add_argument(
        "--rss-muon-steps",
        type=int,
        default=400,
        help="Muon's long run on the DTensor path (FSDP2, default); the sharded "
        "step takes --rss-steps (0: the sharded step only)",
    )
    p.add_argument("--rss-units", type=int, default=4)
    p.add_argument("--rss-width", type=int, default=32)
    p.add_argument("--rss-every", type=int, default=50)
    p.add_argument(
        "--rss-train",
        action="store_true",
        help="the long run trains (forward, backward, step) instead of stepping alone",
    )
    p.add_argument("--rss-objects", action="store_true", help="count gc objects by type")
    p.add_argument("--out", default=os.path.join(_HERE, "results", "optim_step.json"))
    p.add_argument("--table", help="print the table of this results file and exit")
    args = p.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            result = json.load(f)
        print(markdown(result))
        print(rss_markdown(result))
        return
    sys.path.insert(0, _HERE)
    import harness

    started = time.time()
    result = harness.spawn_ranks(_worker, args.world_size, args, "fsdp_compose_optim_")
    result["meta"] = {
        "command": "python benchmarks/optim_step.py " + " ".join(sys.argv[1:]),
        "args": vars(args),
        "duration_s": time.time() - started,
        "load_avg_end": os.getloadavg(),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(markdown(result))
    print(rss_markdown(result))


if __name__ == "__main__":
    main()
