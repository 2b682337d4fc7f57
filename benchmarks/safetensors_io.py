"""Per-rank memory and time of ``fsdp_compose.safetensors_io`` (load into shards, export).

    python benchmarks/safetensors_io.py                       # large preset, W = 1, 2, 4
    python benchmarks/safetensors_io.py --preset small --worlds 1 2

The parent process writes the preset's randomly initialised GPT as one float32
``model.safetensors`` (the file is cached by the OS, as after a first read).
Then, for each world size W, W fresh rank processes (gloo) each build the GPT on
the meta device, annotate it with fully_shard (examples/parallelize.py), and:

* **load**: ``load_safetensors(model, file)``. Memory is the benchmark's VmHWM
  method (benchmarks/measure.py): the heap is trimmed and the resident-set
  high-water mark reset just before the call; the table gives the peak RSS
  *added* by the call next to ``S`` = this rank's shard bytes and ``L`` = the
  largest single tensor's shard on this rank, and the constant ``C`` that the
  bound ``added peak <= 1.2 (S + L) + C`` needs (0 when it holds without one).
* **naive** (the common practice, for comparison): ``safetensors.torch.load_file``
  of the whole file on every rank, then ``load_state_dict`` of the full tensors.
* **export**: ``save_safetensors(model, out_dir)`` of the loaded model (5 GB
  files; the preset fits in one), with its own peak reset, and its wall time.
* **DCP offline**: the ranks of the last W also save the loaded model with
  ``torch.distributed.checkpoint``; one fresh process (no process group) then
  converts it with ``export_dcp_to_safetensors``.

Prints a Markdown table (paste it into BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
for _p in (_HERE, _REPO, os.path.join(_REPO, "examples")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

MiB = 2**20


def _rank_main(args: argparse.Namespace) -> None:
    import measure
    import torch
    import torch.distributed as dist
    from gpt import GPT, PRESETS
    from parallelize import apply_fsdp
    from torch.distributed.tensor import DTensor

    from fsdp_compose.safetensors_io import load_safetensors, save_safetensors

    torch.set_num_threads(1)
    if args.mode == "dcp_export":  # offline: one process, no process group
        from fsdp_compose.safetensors_io import export_dcp_to_safetensors

        out = {"rss_before": measure.reset_peak_rss()}
        start = time.perf_counter()
        export_dcp_to_safetensors(args.dcp, os.path.join(args.out, "from_dcp"))
        out["export_s"] = time.perf_counter() - start
        out["export_peak"] = measure.peak_rss_bytes() - out["rss_before"]
        with open(os.path.join(args.out, "rank0.json"), "w") as f:
            json.dump(out, f)
        return
    dist.init_process_group(
        "gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.world
    )
    with torch.device("meta"):
        model = GPT(PRESETS[args.preset])
    apply_fsdp(model)
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    shard_bytes = sum(t.numel() * t.element_size() for t in local)
    largest = max(t.numel() * t.element_size() for t in local)
    out = {"rank": args.rank, "shard_bytes": shard_bytes, "largest_shard_bytes": largest}

    if args.mode == "naive":
        from safetensors.torch import load_file

        model.to_empty(device="cpu")
        dist.barrier()
        out["rss_before"] = measure.reset_peak_rss()
        start = time.perf_counter()
        model.load_state_dict(load_file(args.file))
        out["load_s"] = time.perf_counter() - start
        out["load_peak"] = measure.peak_rss_bytes() - out["rss_before"]
    else:
        dist.barrier()
        out["rss_before"] = measure.reset_peak_rss()
        start = time.perf_counter()
        result = load_safetensors(model, args.file)
        out["load_s"] = time.perf_counter() - start
        out["load_peak"] = measure.peak_rss_bytes() - out["rss_before"]
        out["bytes_read"] = result.bytes_read
        dist.barrier()
        export_dir = os.path.join(args.out, "export")
        out["rss_before_export"] = measure.reset_peak_rss()
        start = time.perf_counter()
        save_safetensors(model, export_dir)
        out["export_s"] = time.perf_counter() - start
        out["export_peak"] = measure.peak_rss_bytes() - out["rss_before_export"]
        if args.rank == 0:  # the export equals the file that was loaded
            from safetensors import safe_open

            with (
                safe_open(args.file, "pt") as a,
                safe_open(os.path.join(export_dir, "model.safetensors"), "pt") as b,
            ):
                names = a.keys()
                out["export_equal"] = all(
                    torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in names
                )
        if args.dcp:  # the input of the offline DCP -> safetensors measurement
            import torch.distributed.checkpoint as dcp

            dcp.save({"model": model.state_dict()}, checkpoint_id=args.dcp)
    with open(os.path.join(args.out, f"rank{args.rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def _run(world: int, mode: str, preset: str, file: str, dcp: str = "") -> list[dict]:
    work = tempfile.mkdtemp(prefix="fsdp_compose_st_")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH")) if p),
    }
    try:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--rank",
                    str(r),
                    "--world",
                    str(world),
                    "--mode",
                    mode,
                    "--preset",
                    preset,
                    "--file",
                    file,
                    "--out",
                    work,
                    "--store",
                    os.path.join(work, "store"),
                    "--dcp",
                    dcp,
                ],
                env=env,
            )
            for r in range(world)
        ]
        codes = [p.wait(timeout=1800) for p in procs]
        if any(codes):
            raise SystemExit(f"{mode} W={world}: a rank failed (exit codes {codes})")
        results = []
        for r in range(world):
            with open(os.path.join(work, f"rank{r}.json")) as f:
                results.append(json.load(f))
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _write_checkpoint(preset: str, path: str) -> tuple[int, int]:
    """Writes the preset's model; returns its parameter count and largest tensor's bytes."""
    import torch
    from gpt import GPT, PRESETS
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = GPT(PRESETS[preset])
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    return sum(p.numel() for p in model.parameters()), max(sizes)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="large")
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument(
        "--no-naive", action="store_true", help="skip the load_file + load_state_dict baseline"
    )
    # rank processes
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="load", help=argparse.SUPPRESS)
    p.add_argument("--file", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--dcp", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        _rank_main(args)
        return

    tmp = tempfile.mkdtemp(prefix="fsdp_compose_st_ckpt_")
    try:
        file = os.path.join(tmp, "model.safetensors")
        n, largest = _write_checkpoint(args.preset, file)
        print(
            f"{args.preset} preset: {n / 1e6:.0f}M parameters, {os.path.getsize(file) / MiB:.0f} MiB "
            "float32 file; per-rank numbers are the maximum over ranks (MiB)\n"
        )
        print(
            "| W | S: shard | L: largest tensor shard | load: added peak | peak / (S + L) "
            "| C (added) | VmHWM during load | C (VmHWM) | load time | naive load_file: added peak "
            "| export: added peak | export time |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        dcp_dir = os.path.join(tmp, "dcp")
        for world in args.worlds:
            dcp = dcp_dir if world == args.worlds[-1] else ""
            rows = _run(world, "load", args.preset, file, dcp=dcp)
            naive = None if args.no_naive else _run(world, "naive", args.preset, file)

            def over(r: dict, key: str) -> float:  # what the bound 1.2 (S + L) leaves over
                return r[key] - 1.2 * (r["shard_bytes"] + r["largest_shard_bytes"])

            for r in rows:
                r["hwm"] = r["rss_before"] + r["load_peak"]
            worst = max(rows, key=lambda r: over(r, "load_peak"))
            s, l_, peak = worst["shard_bytes"], worst["largest_shard_bytes"], worst["load_peak"]
            const = max(0.0, max(over(r, "load_peak") for r in rows))
            const_abs = max(0.0, max(over(r, "hwm") for r in rows))
            naive_peak = "—" if naive is None else f"{max(r['load_peak'] for r in naive) / MiB:.0f}"
            assert rows[0].get("export_equal"), "the export differs from the loaded file"
            print(
                f"| {world} | {s / MiB:.0f} | {l_ / MiB:.0f} | {peak / MiB:.0f} | {peak / (s + l_):.2f} "
                f"| {const / MiB:.0f} | {max(r['hwm'] for r in rows) / MiB:.0f} | {const_abs / MiB:.0f} "
                f"| {max(r['load_s'] for r in rows):.2f} s | {naive_peak} "
                f"| {max(r['export_peak'] for r in rows) / MiB:.0f} | {max(r['export_s'] for r in rows):.2f} s |"
            )
        r = _run(1, "dcp_export", args.preset, file, dcp=dcp_dir)[0]
        print(
            f"\nDCP checkpoint (saved at W={args.worlds[-1]}) -> safetensors offline on one process: "
            f"added peak {r['export_peak'] / MiB:.0f} MiB (largest tensor "
            f"{largest / MiB:.0f} MiB), {r['export_s']:.2f} s"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
