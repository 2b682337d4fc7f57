"""Tensor-subclass parameters: all-gather bytes (float8 vs bf16) and the memory
that the release hook saves.

Two measurements, each in fresh gloo processes (W ranks, CPU), with fsdp_compose
and torch's FSDP2 on the same model:

* **bytes**: a stack of ``Linear(d, d)`` layers (one ``fully_shard`` unit each,
  biases kept) trained with ``MixedPrecisionPolicy(param_dtype=bfloat16)``, plain
  and converted by torchao's ``convert_to_float8_training`` with
  ``enable_fsdp_float8_all_gather=True``. Counted: the bytes of every all-gather
  output in one forward + backward step (a ``TorchDispatchMode`` on
  ``c10d._allgather_base_``; what each rank receives is (W-1)/W of it).
* **memory**: a stack of frozen int8 weights (``Int8RowWise``, per-row scales,
  from ``tests/test_tensor_subclass.py``) whose ``fsdp_post_all_gather``
  dequantizes to the compute dtype, with and without
  ``fsdp_should_release_all_gather_outputs_after_post_all_gather``; trainable
  low-rank adapters. Counted: the high-water mark of live bytes in the storages
  that one forward + backward (after a warm-up step) reads or writes, sharded
  state included (a ``TorchDispatchMode``; torch's ``MemTracker`` refuses frozen
  parameters): at each layer's forward and backward entry (what the units hold
  between operations) and over every operation (the rebuild's transients too).

Run: ``python benchmarks/subclass_memory.py [--world-size 2] [--dim 512] [--layers 4]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
sys.path[:0] = [_REPO, os.path.join(_REPO, "tests")]


def _linear_stack(dim: int, layers: int, float8: bool) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
    if float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=config)
    return model


def _shard_all(model: Any, shard_fn: Any, **kwargs: Any) -> None:
    for layer in model:
        shard_fn(layer, **kwargs)
    shard_fn(model, **kwargs)


def _bytes(impl: str, dim: int, layers: int) -> dict[str, int]:
    import torch
    from test_tensor_subclass_training import AllGatherBytes

    shard_fn, mp_cls = _runtime(impl)
    out = {}
    for float8 in (False, True):
        model = _linear_stack(dim, layers, float8)
        _shard_all(model, shard_fn, mp_policy=mp_cls(param_dtype=torch.bfloat16))
        x = torch.randn(8, dim)
        model(x).float().pow(2).mean().backward()  # warm-up (lazy init)
        with AllGatherBytes() as counter:
            model(x).float().pow(2).mean().backward()
        out["float8" if float8 else "bf16"] = counter.nbytes
    return out


def _memory(impl: str, dim: int, layers: int, release: bool) -> dict[str, int]:
    import torch
    from test_tensor_subclass import QLinear, Released
    from test_tensor_subclass_training import LiveBytes
    from torch import nn

    class Kept(Released):
        def fsdp_should_release_all_gather_outputs_after_post_all_gather(self) -> bool:
            return False

    shard_fn, _ = _runtime(impl)
    torch.manual_seed(0)
    model = nn.Sequential(
        *[QLinear(dim, dim, Released if release else Kept) for _ in range(layers)]
    )
    _shard_all(model, shard_fn)
    x = torch.randn(8, dim)
    model(x).pow(2).mean().backward()  # warm-up: lazy init, gradients allocated
    counter = LiveBytes()
    for layer in model:  # registered after fully_shard's: they run once gathered
        layer.register_forward_pre_hook(counter.sample)
        layer.register_full_backward_pre_hook(counter.sample)
    with counter.mode:
        model(x).pow(2).mean().backward()
    return {"peak": counter.peak, "at_layers": counter.at_layers}


def _runtime(impl: str) -> tuple[Any, Any]:
    if impl == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from fsdp_compose import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def _rank_main(rank: int, world: int, store: str, args: Any, queue: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results: dict[str, Any] = {}
    for impl in ("torch", "ours"):
        results[f"bytes {impl}"] = _bytes(impl, args.dim, args.layers)
        for release in (False, True) if impl == "ours" else (False,):
            results[f"memory {impl} release={release}"] = _memory(
                impl, args.dim, args.layers, release
            )
    queue.put((rank, results))
    dist.destroy_process_group()


def main() -> None:
    import multiprocessing as mp

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank_main, args=(r, args.world_size, store, args, queue))
            for r in range(args.world_size)
        ]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=900) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    _report(results[0], args)


def _report(r: dict[str, Any], args: Any) -> None:
    kib = 1024
    d, n, w = args.dim, args.layers, args.world_size
    print(f"W={w}, {n} layers of {d} x {d}, rank 0, one forward + backward step\n")
    print("| all-gather output bytes / step (KiB) | bf16 | float8 | float8 / bf16 |")
    print("|---|---|---|---|")
    for impl in ("torch", "ours"):
        b = r[f"bytes {impl}"]
        name = "torch FSDP2" if impl == "torch" else "fsdp_compose"
        print(
            f"| {name} | {b['bf16'] / kib:.1f} | {b['float8'] / kib:.1f} | {b['float8'] / b['bf16']:.3f} |"
        )
    print(
        "\n| int8 weights, dequantized at rebuild | peak at layer entries (KiB) "
        "| peak over all operations (KiB) |"
    )
    print("|---|---|---|")
    for key, name in (
        ("memory torch release=False", "torch FSDP2 (no release hook in torch 2.13)"),
        ("memory ours release=False", "fsdp_compose, outputs kept until reshard"),
        ("memory ours release=True", "fsdp_compose, release hook: outputs freed after rebuild"),
    ):
        m = r[key]
        print(f"| {name} | {m['at_layers'] / kib:.1f} | {m['peak'] / kib:.1f} |")


if __name__ == "__main__":
    main()
