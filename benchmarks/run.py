"""The benchmark entry point: fsdp_compose vs torch FSDP2 vs DDP vs one process.

    # everything in BENCHMARKS.md (26 minutes on 2 cores in the run it records), then
    # regenerate it:
    python benchmarks/run.py --suite full

    # a smoke test of every code path (tiny models, few steps; a few minutes):
    python benchmarks/run.py --suite quick

    # one comparison of your own:
    python benchmarks/run.py --preset small --world-sizes 1 2 4 \\
        --impls single ddp fsdp2 fsdp_compose --steps 6

    # hot-path overhead only:
    python benchmarks/run.py --overhead --world-sizes 1 2

Each (implementation, world size) is one job of fresh processes (``harness.py``);
results (raw per-rank data and the summaries) go to
``benchmarks/results/full-<date>.json`` for ``--suite full``, whose file
BENCHMARKS.md cites and which is committed with it, and otherwise to
``<tmp>/fsdp_compose_benchmarks/<name>-<date>.json`` (outside the checkout, so a
smoke test leaves no untracked file), or to ``--out``; the tables are printed.
``--suite full`` also rewrites the generated section of BENCHMARKS.md
(``report.py`` does that from any results file).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import metrics  # noqa: E402
import report  # noqa: E402
from overhead import OVERHEAD_IMPLS  # noqa: E402
from workloads import IMPLS  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SCRATCH_DIR = os.path.join(tempfile.gettempdir(), "fsdp_compose_benchmarks")


@dataclass(frozen=True)
class Group:
    """A set of jobs compared with each other: every implementation at every
    world size, with the same model, data, steps and settings."""

    name: str
    kind: str  # "train" or "overhead"
    world_sizes: tuple[int, ...]
    impls: tuple[str, ...]
    preset: str = "small"
    reshard_after_forward: bool = True
    global_batch: int | None = 8  # strong scaling: the same global batch at every W
    local_batch: int | None = None  # weak scaling: global batch = local_batch * W
    warmup: int = 2
    steps: int = 6
    instrumented: int = 2
    units: int = 200  # overhead model
    width: int = 32
    batch: int = 8

    def configs(self) -> Iterator[dict[str, Any]]:
        for world in self.world_sizes:
            for impl in self.impls:
                if impl == "single" and world != 1:
                    continue  # one process trains the global batch: W = 1 by definition
                yield self.config(impl, world)

    def config(self, impl: str, world: int) -> dict[str, Any]:
        base = {"group": self.name, "kind": self.kind, "impl": impl, "world_size": world,
                "warmup": self.warmup, "steps": self.steps}
        if self.kind == "overhead":
            return {**base, "units": self.units, "width": self.width, "batch": self.batch}
        global_batch = self.local_batch * world if self.local_batch else self.global_batch
        assert global_batch is not None and global_batch % world == 0, (global_batch, world)
        return {**base, "preset": self.preset, "global_batch": global_batch,
                "reshard_after_forward": self.reshard_after_forward,
                "instrumented": self.instrumented}


FSDPS = ("fsdp2", "fsdp_compose")
SUITES: dict[str, list[Group]] = {
    "full": [
        Group("time", "train", (1, 2, 4), IMPLS),
        Group("time_no_reshard", "train", (2, 4), FSDPS, reshard_after_forward=False),
        Group("memory", "train", (1, 2, 4, 8), ("single", *FSDPS), preset="large",
              global_batch=None, local_batch=1, warmup=1, steps=1, instrumented=0),
        Group("overhead", "overhead", (1, 2), OVERHEAD_IMPLS, warmup=5, steps=30),
    ],
    "quick": [
        Group("time", "train", (1, 2), IMPLS, preset="demo", global_batch=4, warmup=1, steps=3,
              instrumented=1),
        Group("time_no_reshard", "train", (2,), FSDPS, preset="demo", global_batch=4,
              reshard_after_forward=False, warmup=1, steps=3, instrumented=1),
        Group("memory", "train", (1, 2), ("single", *FSDPS), preset="demo", global_batch=None,
              local_batch=1, warmup=1, steps=2, instrumented=0),
        Group("overhead", "overhead", (1, 2), OVERHEAD_IMPLS, units=20, warmup=2, steps=5),
    ],
}


def _loss_key(config: dict[str, Any]) -> tuple[Any, ...]:
    total = config["warmup"] + config["steps"] + config["instrumented"]
    return (config["preset"], config["global_batch"], total)


def run_groups(groups: list[Group], repeats: int) -> list[dict[str, Any]]:
    """Runs every job of every group, ``repeats`` times over; returns job records."""
    jobs: list[dict[str, Any]] = []
    for repeat in range(repeats):
        reference: dict[tuple[Any, ...], list[float]] = {}  # single-process losses
        for group in groups:
            for config in group.configs():
                started = time.perf_counter()
                try:
                    ranks = harness.run_job(config)
                except harness.JobFailed as exc:
                    print(f"FAILED: {exc}", file=sys.stderr, flush=True)
                    jobs.append({"repeat": repeat, "config": config, "error": str(exc)})
                    continue
                if config["kind"] == "overhead":
                    summary = metrics.summarize_overhead(config, ranks)
                else:
                    if config["impl"] == "single":
                        reference[_loss_key(config)] = ranks[0]["losses"]
                    summary = metrics.summarize_train(
                        config, ranks, reference.get(_loss_key(config))
                    )
                seconds = time.perf_counter() - started
                jobs.append({"repeat": repeat, "config": config, "summary": summary,
                             "ranks": ranks, "wall_s": seconds})
                print(report.progress_line(jobs[-1]), flush=True)
    return jobs


def machine_info() -> dict[str, Any]:
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    with open("/proc/meminfo") as f:
        mem_kib = int(f.readline().split()[1])
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=os.path.dirname(RESULTS_DIR)).stdout.strip()
    except OSError:
        commit = ""
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kib / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": commit,
        "load_avg_start": os.getloadavg(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=sorted(SUITES), help="a predefined set of comparisons")
    p.add_argument("--repeats", type=int, default=None,
                   help="run everything this many times (default: 2 for --suite full, else 1)")
    p.add_argument("--overhead", action="store_true", help="the tiny-unit overhead benchmark")
    p.add_argument("--preset", default="small", help="examples/gpt.py preset")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--impls", nargs="+", default=None)
    p.add_argument("--no-reshard-after-forward", action="store_true")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step, all ranks")
    p.add_argument("--local-batch", type=int, default=None, help="per rank (overrides global)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--instrumented", type=int, default=2, help="extra steps under probes")
    p.add_argument("--units", type=int, default=200, help="--overhead: number of units")
    p.add_argument("--out", default=None,
                   help="results JSON (default: benchmarks/results/ for --suite full, else "
                        f"{SCRATCH_DIR}/)")
    p.add_argument("--write-markdown", action="store_true",
                   help="rewrite BENCHMARKS.md's generated section (default with --suite full)")
    return p.parse_args(argv)


def groups_from_args(args: argparse.Namespace) -> list[Group]:
    if args.suite:
        return SUITES[args.suite]
    if args.overhead:
        impls = tuple(args.impls or OVERHEAD_IMPLS)
        return [Group("overhead", "overhead", tuple(args.world_sizes), impls, units=args.units,
                      warmup=args.warmup, steps=args.steps)]
    group = Group(
        "time" if not args.no_reshard_after_forward else "time_no_reshard",
        "train", tuple(args.world_sizes), tuple(args.impls or IMPLS), preset=args.preset,
        reshard_after_forward=not args.no_reshard_after_forward,
        global_batch=None if args.local_batch else args.global_batch,
        local_batch=args.local_batch, warmup=args.warmup, steps=args.steps,
        instrumented=args.instrumented,
    )
    return [group]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    groups = groups_from_args(args)
    repeats = args.repeats or (2 if args.suite == "full" else 1)
    started = time.time()
    info = machine_info()
    jobs = run_groups(groups, repeats)
    info["load_avg_end"] = os.getloadavg()
    results = {
        "meta": {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": "python benchmarks/run.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "duration_s": time.time() - started,
            "repeats": repeats,
            "groups": [dataclasses.asdict(g) for g in groups],
            "machine": info,
        },
        "jobs": jobs,
    }
    name = args.suite or ("overhead" if args.overhead else f"custom-{args.preset}")
    # Only the full suite's results belong in the checkout (BENCHMARKS.md cites them).
    out_dir = RESULTS_DIR if args.suite == "full" else SCRATCH_DIR
    out = args.out or os.path.join(out_dir, f"{name}-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(report.render(results))
    print(f"results: {out} ({results['meta']['duration_s'] / 60:.1f} min)")
    if args.write_markdown or args.suite == "full":
        report.write_markdown(results, out)
    if any("error" in job for job in jobs):
        sys.exit(1)


if __name__ == "__main__":
    main()
