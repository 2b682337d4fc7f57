"""The CUDA path in one run: correctness, speed and memory on one GPU.

    bash benchmarks/gpu/check.sh [OUT_DIR]            # on the GPU machine, <= 8 minutes
    python benchmarks/gpu/check.py --out DIR --smoke  # the same code paths on the CPU, seconds

Each section runs in a process of its own with its own time budget, so a crash,
a hang or an import error in one section is reported and the next one still
runs. After every section the results so far are written to ``DIR/check.json``
and ``DIR/check.md``; each section's output goes to ``DIR/logs/<section>.log``.

Sections (see ``benchmarks/gpu/README.md``): ``tests`` (the suite's
``@pytest.mark.gpu`` tests), ``parity``, ``stress``, ``features``, ``speed``
(``benchmarks/gpu_llama.py`` plus a profiler trace of one step) and ``memory``
(``fsdp_compose.plan.estimate`` against ``torch.cuda.max_memory_allocated``).
``--smoke`` runs every section on the CPU with gloo and tiny models; its numbers
mean nothing, but an import error, a typo or a missing file shows up in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))

SECTIONS = ("tests", "parity", "stress", "features", "speed", "memory")
# Seconds per section on the GPU; their sum stays under the 8-minute total
# with the start-up of each process.
BUDGET_S = {"tests": 75, "parity": 75, "stress": 75, "features": 50, "speed": 150, "memory": 45}
SMOKE_BUDGET_S = 90  # per section: a hang fails the CPU run in CI quickly
TOTAL_S = 470
STRESS_RUNS = ("run_a", "run_b", "launch_blocking")


# ---------------------------------------------------------------------------
# rank jobs: W forked processes running one job of checks.py
# ---------------------------------------------------------------------------


def _rank_process(env: dict[str, str], *args: Any) -> None:
    os.environ.update(env)  # before this process initialises CUDA: it reads them then
    import checks

    checks.rank_main(*args)


def run_ranks(
    job: str, world: int, smoke: bool, env: dict[str, str] | None = None, **kw: Any
) -> list[dict]:
    """Runs ``checks.<job>`` on ``world`` new rank processes; returns each rank's result.

    The ranks are forked from this section's process, which has imported torch
    and the checks but never initialised CUDA: a fork costs no second import of
    torch, and ``env`` (e.g. ``CUDA_LAUNCH_BLOCKING``) still applies to the
    rank's CUDA initialisation.
    """
    import multiprocessing as mp

    import checks  # noqa: F401 - imported once here, inherited by every rank
    import torch

    if torch.cuda.is_initialized():  # a forked child could not use CUDA
        raise RuntimeError("CUDA was initialised in the section process before forking ranks")
    ctx = mp.get_context("fork")
    device_type = "cpu" if smoke else "cuda"
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = []
        for rank in range(world):
            args = (env or {}, rank, world, init_file, device_type, job, kw, tmp)
            procs.append(ctx.Process(target=_rank_process, args=args))
            procs[-1].start()
        codes = wait_all(procs)
        if any(codes):
            raise RuntimeError(f"{job} on {world} ranks: exit codes {codes} (see the log)")
        results = []
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                results.append(json.load(f))
    return results


def wait_all(procs: list[Any], grace_s: float = 10.0) -> list[int | None]:
    """Waits for every rank; once one has failed, the others get ``grace_s``
    seconds to fail on their own (they may be blocked in a collective with it)."""
    deadline = None
    while any(p.is_alive() for p in procs):
        if deadline is None and any(p.exitcode not in (None, 0) for p in procs):
            deadline = time.monotonic() + grace_s
        if deadline is not None and time.monotonic() > deadline:
            for p in procs:
                if p.is_alive():
                    p.kill()
        time.sleep(0.05)
    for p in procs:
        p.join()
    return [p.exitcode for p in procs]


def merge_ranks(ranks: list[dict]) -> dict[str, Any]:
    """Rank 0's entries, each ``ok`` only where it holds on every rank."""
    merged = dict(ranks[0])
    for name, entry in merged.items():
        if isinstance(entry, dict) and "ok" in entry:
            oks = [r[name].get("ok") for r in ranks]
            ok = None if all(o is None for o in oks) else all(o is not False for o in oks)
            merged[name] = {**entry, "ok": ok}
    return merged


def _status(entries: dict[str, Any]) -> str:
    oks = [e.get("ok") for e in entries.values() if isinstance(e, dict) and "ok" in e]
    return "pass" if all(o is not False for o in oks) else "fail"


# ---------------------------------------------------------------------------
# sections (each runs in its own process, forked by spawn_section)
# ---------------------------------------------------------------------------


def _has_gpu_mark(path: str) -> bool:
    with open(path) as f:
        return "mark.gpu" in f.read()


def section_tests(out: str, smoke: bool) -> dict[str, Any]:
    """The suite's ``@pytest.mark.gpu`` tests (skipped without a GPU)."""
    import glob
    import xml.etree.ElementTree as ET

    tests = os.path.join(_REPO, "tests")
    files = [f for f in sorted(glob.glob(os.path.join(tests, "test_*.py"))) if _has_gpu_mark(f)]
    if not files:
        return {"status": "fail", "error": "no test file carries @pytest.mark.gpu"}
    xml = os.path.join(out, "pytest_gpu.xml")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "gpu",
        f"--junitxml={xml}",
        *files,
    ]
    proc = subprocess.run(cmd, cwd=_REPO)
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    ok = proc.returncode == 0 and (smoke or passed > 0)
    return {
        "status": "pass" if ok else "fail",
        "files": [os.path.relpath(f, _REPO) for f in files],
        "passed": passed,
        **counts,
        "returncode": proc.returncode,
    }


def _worlds(smoke: bool) -> tuple[int, ...]:
    return (1, 2) if smoke else (1, 2, 4)


def section_parity(out: str, smoke: bool) -> dict[str, Any]:
    """Parity with one process at W = 1, 2 (and 4 on the GPU, for an int reshard)."""
    import checks

    size = checks.SIZES["smoke" if smoke else "gpu"]
    result: dict[str, Any] = {}
    for world in _worlds(smoke):
        try:
            result[f"w{world}"] = merge_ranks(
                run_ranks("parity", world, smoke, size=size["parity"], steps=size["steps"])
            )
        except Exception as exc:  # the other world sizes still run
            result[f"w{world}"] = {"job": {"ok": False, "error": str(exc)}}
    status = all(_status(v) == "pass" for v in result.values())
    return {"status": "pass" if status else "fail", **result}


def section_stress(out: str, smoke: bool) -> dict[str, Any]:
    """The same bf16 training loop three times: twice as is (determinism) and once
    with ``CUDA_LAUNCH_BLOCKING=1`` (every kernel synchronous: no stream can race)."""
    import checks

    size = checks.SIZES["smoke" if smoke else "gpu"]
    base_env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "CUDA_LAUNCH_BLOCKING": "0"}
    runs = {}
    for name in STRESS_RUNS:
        env = {**base_env, "CUDA_LAUNCH_BLOCKING": "1" if name == "launch_blocking" else "0"}
        runs[name] = run_ranks(
            "stress", 1, smoke, env, size=size["stress"], steps=size["stress_steps"]
        )[0]
    digests = {name: r["digest"] for name, r in runs.items()}
    deterministic = digests["run_a"] == digests["run_b"]
    race_free = digests["run_a"] == digests["launch_blocking"]
    return {
        "status": "pass" if deterministic and race_free else "fail",
        "deterministic": deterministic,
        "identical_to_launch_blocking": race_free,
        "runs": runs,
    }


def section_features(out: str, smoke: bool) -> dict[str, Any]:
    """Sharded Muon, tied weights in separate units, safetensors into shards (W = 1, 2)."""
    import checks

    size = checks.SIZES["smoke" if smoke else "gpu"]
    folder = os.path.join(out, "features")
    os.makedirs(folder, exist_ok=True)
    result: dict[str, Any] = {}
    for world in (1, 2):
        try:
            ranks = run_ranks(
                "features", world, smoke, size=size["parity"], steps=size["steps"], folder=folder
            )
            result[f"w{world}"] = merge_ranks(ranks)
        except Exception as exc:  # the other world size still runs
            result[f"w{world}"] = {"job": {"ok": False, "error": str(exc)}}
    status = all(_status(v) == "pass" for v in result.values())
    return {"status": "pass" if status else "fail", **result}


def section_speed(out: str, smoke: bool) -> dict[str, Any]:
    """``benchmarks/gpu_llama.py``: unwrapped, FSDP2 and fsdp_compose at W=1, plus
    a profiler trace of one step of each (``speed/trace_<impl>.json.gz``)."""
    folder = os.path.join(out, "speed")
    os.makedirs(folder, exist_ok=True)
    result_file = os.path.join(folder, "gpu_llama.json")
    cmd = [
        sys.executable,
        os.path.join(_REPO, "benchmarks", "gpu_llama.py"),
        "--json",
        result_file,
        "--trace",
        folder,
    ] + (["--smoke"] if smoke else [])
    subprocess.run(cmd, cwd=_REPO, check=True)
    with open(result_file) as f:
        rows = {r["impl"]: r for r in json.load(f)}
    keys = ("step_time_s", "tokens_per_s", "mfu", "peak_allocated_gib", "params", "device")
    table = {impl: {k: r[k] for k in keys} for impl, r in rows.items()}
    mine, fsdp2, plain = rows["fsdp_compose"], rows["fsdp2"], rows["unwrapped"]
    ratios = {
        "step_vs_unwrapped": mine["step_time_s"] / plain["step_time_s"],
        "step_vs_fsdp2": mine["step_time_s"] / fsdp2["step_time_s"],
        "peak_vs_fsdp2": (
            mine["peak_allocated_gib"] / fsdp2["peak_allocated_gib"]
            if fsdp2["peak_allocated_gib"]
            else None
        ),
    }
    traces = sorted(f for f in os.listdir(folder) if f.startswith("trace_"))
    ok = len(traces) == 3
    return {
        "status": "pass" if ok else "fail",
        "results": table,
        "ratios": ratios,
        "traces": traces,
        "config": mine["config"],
        "batch": mine["batch"],
        "dtype": mine["dtype"],
    }


def _llama_estimate(config: dict[str, Any], batch: int, device: str) -> Any:
    """``fsdp_compose.plan.estimate`` for gpu_llama.py's model, step and settings."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(_REPO, "benchmarks"))
    from gpu_llama import LlamaConfig, build_model

    from fsdp_compose.plan import estimate

    model = build_model(LlamaConfig(**config), torch.bfloat16, "meta")  # gpu_llama's --dtype bf16

    def step(m: Any, b: int, s: int) -> Any:  # gpu_llama.py's loss: fp32 cross-entropy
        ids = torch.zeros(b, s, dtype=torch.long, device="meta")
        return F.cross_entropy(m(ids).float().flatten(0, 1), ids.flatten())

    return estimate(
        model,
        batch=batch,
        seq=config["seq_len"],
        world_size=1,
        policy=["Block"],
        optimizer="adamw",
        set_to_none=True,
        step_fn=step,
        device=device,
    )


def section_memory(out: str, smoke: bool) -> dict[str, Any]:
    """The estimator's peak against the measured ``max_memory_allocated`` of the
    speed section's fsdp_compose run (run here if that section left none)."""
    result_file = os.path.join(out, "speed", "gpu_llama.json")
    if os.path.exists(result_file):
        with open(result_file) as f:
            run = next(r for r in json.load(f) if r["impl"] == "fsdp_compose")
        source = "speed section"
    else:
        result_file = os.path.join(out, "memory_gpu_llama.json")
        cmd = [
            sys.executable,
            os.path.join(_REPO, "benchmarks", "gpu_llama.py"),
            "--impl",
            "fsdp_compose",
            "--warmup",
            "1",
            "--steps",
            "2",
            "--json",
            result_file,
        ]
        subprocess.run(cmd + (["--smoke"] if smoke else []), cwd=_REPO, check=True)
        with open(result_file) as f:
            run = json.load(f)
        source = "own run"
    est = _llama_estimate(run["config"], run["batch"], "cpu" if smoke else "cuda")
    predicted = est.peak_bytes_per_rank / 2**30
    measured = run["peak_allocated_gib"]
    ratio = measured / predicted if not smoke and predicted else None
    # The 5% bound is a target (summary.TARGETS); this section fails only without numbers.
    ok = predicted > 0 and (smoke or measured > 0)
    return {
        "status": "pass" if ok else "fail",
        "predicted_gib": predicted,
        "measured_gib": measured,
        "measured_over_predicted": ratio,
        "breakdown": est.breakdown,
        "peak_at": est.peak_at,
        "measurement": source,
    }


SECTION_FNS = {
    "tests": section_tests, "parity": section_parity, "stress": section_stress,
    "features": section_features, "speed": section_speed, "memory": section_memory,
}  # fmt: skip


def run_section(name: str, out: str, smoke: bool) -> None:
    """The body of one section's process: runs it and writes ``sections/<name>.json``."""
    result = SECTION_FNS[name](out, smoke)
    with open(os.path.join(out, "sections", f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)


# ---------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------


def _section_process(name: str, out: str, smoke: bool) -> None:
    """The body of one section's process, forked from the driver."""
    os.setsid()  # a process group of its own: the section and every rank it starts
    fd = os.open(os.path.join(out, "logs", f"{name}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    run_section(name, out, smoke)


def spawn_section(name: str, out: str, smoke: bool, budget: float) -> dict[str, Any]:
    """Runs one section in a process of its own, killed whole at ``budget`` seconds.

    The process is forked from the driver, which has imported torch and the
    checks but never initialised CUDA (the same rule as the ranks': see
    :func:`run_ranks`): a section costs no import of torch of its own.
    """
    import multiprocessing as mp

    start = time.monotonic()
    proc = mp.get_context("fork").Process(target=_section_process, args=(name, out, smoke))
    proc.start()
    try:
        proc.join(budget)
        code = proc.exitcode
    finally:  # also when the driver itself is stopped (check.sh's timeout)
        if proc.exitcode is None:
            try:  # the section and the ranks it started
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # killed before it had its own group
                proc.kill()
            proc.join()
    seconds = round(time.monotonic() - start, 1)
    path = os.path.join(out, "sections", f"{name}.json")
    if code is None:
        return {"status": "timeout", "seconds": seconds, "budget_s": budget}
    if code != 0 or not os.path.exists(path):
        return {
            "status": "error",
            "seconds": seconds,
            "returncode": code,
            "log": f"logs/{name}.log",
        }
    with open(path) as f:
        return {**json.load(f), "seconds": seconds, "budget_s": budget}


def environment() -> dict[str, Any]:
    """Versions and the device, read by a short child process: the driver never
    initialises CUDA (its sections and their ranks are forked from it)."""
    code = (
        "import json, torch; c = torch.cuda.is_available(); print(json.dumps({'torch': torch.__version__, "
        "'cuda': torch.version.cuda, 'device': torch.cuda.get_device_name() if c else 'cpu', "
        "'gpus': torch.cuda.device_count() if c else 0}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    env = json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr[-2000:]}
    return {**env, "python": platform.python_version(), "host": platform.node()}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--out", default=os.environ.get("OUT") or os.path.join(_REPO, "out", "gpu_check")
    )
    p.add_argument(
        "--smoke", action="store_true", help="CPU, gloo, tiny models: checks the command itself"
    )
    p.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    args = p.parse_args()
    out = os.path.abspath(args.out)
    deadline = time.monotonic() + TOTAL_S
    # A SIGTERM (check.sh's timeout) unwinds through spawn_section, which kills the section.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    env = environment()
    if not args.smoke and not env.get("gpus"):
        raise SystemExit(f"check.py needs a CUDA device; use --smoke without one ({env})")
    for sub in ("sections", "logs"):
        os.makedirs(os.path.join(out, sub), exist_ok=True)
    import checks  # noqa: F401 - torch and the checks, inherited by every section's process
    from summary import write_reports

    report: dict[str, Any] = {
        "smoke": args.smoke,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "environment": env,
        "sections": {},
    }
    for name in args.only or SECTIONS:
        cap = SMOKE_BUDGET_S if args.smoke else BUDGET_S[name]
        budget = min(float(cap), deadline - time.monotonic() - 5)
        if budget <= 1:
            report["sections"][name] = {"status": "not run", "reason": "out of time"}
        else:
            print(f"[gpu check] {name} (budget {budget:.0f} s)", flush=True)
            report["sections"][name] = {
                **spawn_section(name, out, args.smoke, budget),
                "smoke": args.smoke,
            }
        print(f"[gpu check] {name}: {report['sections'][name]['status']}", flush=True)
        write_reports(report, out)
    failed = [n for n, s in report["sections"].items() if s["status"] != "pass"]
    print(f"[gpu check] wrote {out}/check.json and check.md; not passing: {failed or 'none'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
