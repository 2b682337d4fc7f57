"""torchtitan with torch's FSDP2 and with fsdp_compose in its place: step time and memory.

    python benchmarks/torchtitan_client.py [--cases llama3 deepseek_v3] [--steps 20] [--rounds 2]

The job is ``tests/titan_harness.py``'s: a torchtitan debug model parallelized by
torchtitan's own FSDP code (``apply_fsdp_to_decoder``) on 2 gloo CPU ranks, AdamW,
synthetic batches. Each (library, round) runs in 2 fresh rank processes, the
libraries alternating, so both are measured in the same run under the same load.
Reported per library: the median over rounds of the slowest rank's median step time
(first step left out), and the largest peak resident set size of a rank
(``ru_maxrss``) with its growth over the job (peak minus the RSS at the job's
start, after torch's import; torchtitan's import falls in it). Whether the losses
were bit-identical step by step is checked on every round. Needs torchtitan
(``pip install torchtitan==0.3.0 spmd_types==0.2.3``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_REPO, os.path.join(_REPO, "tests")]

from dist_utils import DistPool  # noqa: E402
from titan_harness import train  # noqa: E402

WORLD = 2
_CASES = {
    "llama3": dict(model="llama3", spmd_backend="partial_dtensor", batch=2, seq_len=128),
    "deepseek_v3": dict(
        model="deepseek_v3", spmd_backend="partial_dtensor", ep=2, batch=2, seq_len=64
    ),
}


def _run(fsdp: str, steps: int, job: dict) -> list[dict]:
    pool = DistPool(WORLD)
    try:
        return pool.run(train, fsdp, steps=steps, timeout=3000, **job)
    finally:
        pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--cases",
        nargs="+",
        choices=list(_CASES),
        default=["llama3"],
        help="llama3: the dense debug model; deepseek_v3: the MoE one with expert parallel 2",
    )
    args = parser.parse_args()
    print("| model | library | step time (s) | peak RSS per rank (MiB) | growth (MiB) | losses |")
    print("| --- | --- | --- | --- | --- | --- |")
    for case in args.cases:
        results: dict[str, list[list[dict]]] = {"fsdp2": [], "fsdp_compose": []}
        for _ in range(args.rounds):
            for fsdp in results:
                results[fsdp].append(_run(fsdp, args.steps, _CASES[case]))
        same = all(
            ref[0]["losses"] == got[0]["losses"]
            for ref, got in zip(results["fsdp2"], results["fsdp_compose"])
        )
        for fsdp, rounds in results.items():
            step = statistics.median(max(r["step_s"] for r in ranks) for ranks in rounds)
            peak = max(r["peak_rss_bytes"] for ranks in rounds for r in ranks) / 2**20
            growth = max(
                r["peak_rss_bytes"] - r["start_rss_bytes"] for ranks in rounds for r in ranks
            )
            verdict = "bit-identical" if same else "DIFFER"
            print(
                f"| {case} | {fsdp} | {step:.3f} | {peak:.0f} | {growth / 2**20:.0f} | {verdict} |"
            )


if __name__ == "__main__":
    main()
