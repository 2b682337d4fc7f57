"""Tied embedding and LM head as separate units vs the manual workaround.

Compares, on the example GPT with ``tie_weights=True`` (``lm_head.weight is
tok_emb.weight``), per rank and per training step:

* ``shared``: ``fully_shard(model.tok_emb)``, one unit per block,
  ``fully_shard(model.lm_head)``, then the root: the tied weight is shared across
  units ([Note: shared parameters] in ``fsdp_compose/_shared.py``);
* ``workaround``: ``fully_shard([model.tok_emb, model.lm_head])`` (one grouped unit),
  one unit per block, then the root;
* ``root``: blocks only; embedding and head left in the root's unit.

Measured (each variant and world size in fresh processes, gloo over loopback):

* peak RSS per rank: ``VmHWM`` minus RSS after setup (model, shards, optimizer and
  one warm-up step), over the timed steps; the largest over ranks;
* peak unsharded parameter bytes per rank: the high-water mark of the scheduler's
  own accounting of gathered (and in-flight) parameters;
* bytes per rank per step: the collectives fsdp_compose issued, at the
  bandwidth-optimal count ((W-1)/W of each all-gather's output and of each
  reduce-scatter's input), and what the loopback interface carried (rank 0 reads
  ``/proc/net/dev``, divided by W; other traffic on the machine is counted too).

Run: ``python benchmarks/shared_params.py [--preset small] [--world-sizes 2 4] [--steps 3]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), os.path.join(os.path.dirname(_HERE), "examples"), _HERE]

VARIANTS = ("shared", "workaround", "root")


def _shard(model: Any, variant: str) -> None:
    from fsdp_compose import fully_shard

    if variant == "workaround":
        fully_shard([model.tok_emb, model.lm_head])
    elif variant == "shared":
        fully_shard(model.tok_emb)
    for block in model.blocks:
        fully_shard(block)
    if variant == "shared":
        fully_shard(model.lm_head)
    fully_shard(model)


def _rank_main(
    rank: int, world: int, store: str, variant: str, preset: str, steps: int, queue: Any
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import harness
    import torch
    import torch.distributed as dist
    from gpt import GPT, PRESETS, loss_fn, make_batch
    from measure import loopback_tx_bytes, peak_rss_bytes, reset_peak_rss

    from fsdp_compose import Observer

    harness.init_gloo(rank, world, store)
    # The peak of the scheduler's count of unsharded parameter bytes, and the
    # ideal bytes sent, from the runtime's events.
    peak_unsharded = [0]
    ideal = [0.0]

    class _Probe(Observer):
        counting = False

        def on_memory(self, event: Any, info: Any, nbytes: int, total: int) -> None:
            peak_unsharded[0] = max(peak_unsharded[0], total)

        def on_collective(self, event: Any, info: Any) -> None:
            if not self.counting or event != "issue" or info.group_size == 1:
                return
            share = (info.group_size - 1) / info.group_size
            out = info.output_bytes if info.kind == "all_gather" else info.input_bytes
            ideal[0] += share * out

    probe = _Probe()

    cfg = PRESETS[preset]
    cfg = type(cfg)(**{**cfg.__dict__, "tie_weights": True})
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    _shard(model, variant)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    assert model.lm_head.weight is model.tok_emb.weight
    model.register_observer(probe)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per_rank = 2

    def step(i: int) -> float:
        x, y = make_batch(cfg, per_rank * world, i)
        sl = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = loss_fn(model(x[sl]), y[sl])
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss.item()

    step(0)  # warm-up: Adam states, lazy init, recorded order
    peak_unsharded[0] = 0
    dist.barrier()
    base = reset_peak_rss()
    lo_before = loopback_tx_bytes() if rank == 0 else 0
    probe.counting = True
    losses = [step(i) for i in range(1, 1 + steps)]
    probe.counting = False
    dist.barrier()
    lo = (loopback_tx_bytes() - lo_before) / world / steps if rank == 0 else 0.0
    queue.put(
        {
            "rank": rank,
            "peak_rss": peak_rss_bytes() - base,
            "peak_unsharded": peak_unsharded[0],
            "ideal_bytes": ideal[0] / steps,
            "lo_bytes": lo,
            "losses": losses,
        }
    )
    dist.destroy_process_group()


def run(variant: str, world: int, preset: str, steps: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank_main, args=(r, world, store, variant, preset, steps, queue))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results = [queue.get(timeout=900) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    results.sort(key=lambda r: r["rank"])
    return {
        "peak_rss": max(r["peak_rss"] for r in results),
        "peak_unsharded": max(r["peak_unsharded"] for r in results),
        "ideal_bytes": max(r["ideal_bytes"] for r in results),
        "lo_bytes": results[0]["lo_bytes"],
        "loss": results[0]["losses"][-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="small")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    mib = 1024 * 1024
    print(f"preset {args.preset}, tie_weights=True, 2 sequences per rank, {args.steps} timed steps")
    print(
        "| W | variant | peak RSS (MiB) | peak unsharded params (MiB) | collective bytes/step (MiB) "
        "| lo bytes/step (MiB) | last loss | RSS / workaround | bytes / workaround |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for world in args.world_sizes:
        rows = {v: run(v, world, args.preset, args.steps) for v in VARIANTS}
        ref = rows["workaround"]
        for v in VARIANTS:
            r = rows[v]
            print(
                f"| {world} | {v} | {r['peak_rss'] / mib:.1f} | {r['peak_unsharded'] / mib:.1f} "
                f"| {r['ideal_bytes'] / mib:.2f} | {r['lo_bytes'] / mib:.2f} | {r['loss']:.6f} "
                f"| {r['peak_rss'] / ref['peak_rss']:.3f} | {r['ideal_bytes'] / ref['ideal_bytes']:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
