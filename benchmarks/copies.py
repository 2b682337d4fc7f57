"""Copy kernels and bytes copied per training step: fsdp_compose vs torch's FSDP2.

One training step (forward, backward, ``optimizer.step()``, ``zero_grad()``) of the
example GPT, with one unit each for the token embedding, every block and the LM
head, and the root (torchtitan's layout), runs under a
``TorchDispatchMode`` that counts every *copy op* and the bytes it writes, and
under torch's ``CommDebugMode``, which counts the collectives. Both libraries run
on the same model copy, mesh, data and optimizer (AdamW), in the same processes
(2 gloo ranks by default), after one warm-up step (lazy initialisation and the
optimizer states are not counted).

Copy ops (what moves or converts existing data into another tensor):

* ``aten``: ``copy_``, ``_to_copy`` (``.to(dtype/device)``), ``clone`` (and so
  ``contiguous``/``reshape`` when they copy), ``cat``, ``stack``, ``_chunk_cat``,
  ``_foreach_copy_``, ``constant_pad_nd`` and every ``*_copy`` op
  (``split_with_sizes_copy``, ``permute_copy``, ...);
* FSDP2's own ops: ``fsdp.all_gather_copy_in`` (its bytes: the all-gather input
  it writes), ``fsdp.split_with_sizes_copy``, ``fsdp.chunk_cat``.

Bytes are those written: of the arguments the op's schema marks as written
(``out=``, in-place ``self``), otherwise of its outputs; a ``DTensor``'s local
tensor. Fills (``zeros``, ``fill_``), arithmetic and the collectives' own
internal copies are not counted. What torch's autograd and the optimizer copy is
counted for both libraries alike.

Cases: float32 or ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``, every
parameter on ``Shard(0)`` or the 2-D ones on ``Shard(1)`` (``shard_placement_fn``).

Run: ``python benchmarks/copies.py [--world-size 2] [--preset tiny|small] [--by-op]``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import sys
import tempfile
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (os.path.dirname(_HERE), os.path.join(os.path.dirname(_HERE), "examples")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

CASES = {
    "fp32 Shard(0)": {"bf16": False, "shard1": False},
    "bf16 Shard(0)": {"bf16": True, "shard1": False},
    "fp32 Shard(1)": {"bf16": False, "shard1": True},
    "bf16 Shard(1)": {"bf16": True, "shard1": True},
}
PRESETS = {
    "tiny": {"vocab_size": 97, "block_size": 16, "n_layer": 3, "n_head": 2, "n_embd": 32},
    "small": {"vocab_size": 1024, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128},
}
_COPY_OPS = {
    "copy_",
    "_to_copy",
    "clone",
    "cat",
    "stack",
    "_chunk_cat",
    "_foreach_copy_",
    "constant_pad_nd",
    "all_gather_copy_in",
    "chunk_cat",
}


def _is_copy(func: Any) -> bool:
    name = func._schema.name.split("::")[-1]
    return name in _COPY_OPS or name.endswith("_copy")


def _nbytes(value: Any) -> int:
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    if not isinstance(value, torch.Tensor):
        return 0
    local = getattr(value, "_local_tensor", value)  # a DTensor: this rank's bytes
    return local.numel() * local.element_size()


class CopyCounter(TorchDispatchMode):
    """Counts copy ops (see the module docstring) and the bytes they write."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _is_copy(func):
            name = func._schema.name.split("::")[-1]
            if name == "all_gather_copy_in":  # returns (input row, output): writes the row
                written = _nbytes(out[0])
            else:
                schema_args = func._schema.arguments
                values = [
                    kwargs[a.name] if a.name in kwargs else args[i] if i < len(args) else None
                    for i, a in enumerate(schema_args)
                ]
                mutated = [
                    v for a, v in zip(schema_args, values) if a.alias_info and a.alias_info.is_write
                ]
                written = _nbytes(mutated) if mutated else _nbytes(out)
            label = f"{func._schema.name.split('::')[0]}.{name}"
            self.ops[label] += 1
            self.bytes[label] += written
        return out


def _build(case: dict[str, Any], impl: str, base: Any, mesh: Any) -> Any:
    if impl == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from fsdp_compose import MixedPrecisionPolicy, fully_shard  # type: ignore[assignment]
    from torch.distributed.tensor import Shard

    kwargs: dict[str, Any] = {"mesh": mesh}
    if case["bf16"]:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if case["shard1"]:
        world = mesh.size()
        kwargs["shard_placement_fn"] = lambda p: (
            Shard(1) if p.ndim == 2 and p.shape[1] % world == 0 else None
        )
    model = copy.deepcopy(base)
    for module in (model.tok_emb, *model.blocks, model.lm_head):
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _step(model: Any, optim: Any, cfg: Any, rank: int, world: int, i: int) -> None:
    from gpt import loss_fn, make_batch

    x, y = make_batch(cfg, 2 * world, i)
    sl = slice(2 * rank, 2 * rank + 2)
    loss_fn(model(x[sl]), y[sl]).backward()
    optim.step()
    optim.zero_grad()


def _count_rank(case: dict[str, Any], preset: str) -> dict[str, Any]:
    """One rank's counts of one step per implementation (the process group is up)."""
    import torch.distributed as dist
    from gpt import GPT, GPTConfig
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    cfg = GPTConfig(**PRESETS[preset])
    base = GPT(cfg)
    result: dict[str, Any] = {}
    params: dict[str, list[torch.Tensor]] = {}
    for impl in ("fsdp_compose", "fsdp2"):
        model = _build(case, impl, base, mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)

        step = functools.partial(_step, model, optim, cfg, rank, world)
        step(0)
        with CommDebugMode() as comms, CopyCounter() as copies:
            step(1)
        result[impl] = {
            "ops": dict(copies.ops),
            "bytes": dict(copies.bytes),
            "collectives": {str(op): n for op, n in comms.get_comm_counts().items()},
        }
        params[impl] = [p.full_tensor() for p in model.parameters()]
    result["bit_identical"] = all(
        torch.equal(a, b) for a, b in zip(params["fsdp_compose"], params["fsdp2"])
    )
    return result


def _spawned(rank: int, world: int, store: str, cases: list[str], preset: str, queue: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        queue.put((rank, {name: _count_rank(CASES[name], preset) for name in cases}))
    finally:
        dist.destroy_process_group()


def count(cases: list[str], world: int = 2, preset: str = "tiny") -> dict[str, Any]:
    """Rank 0's counts per case, in fresh spawned gloo processes."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_spawned, args=(r, world, store, cases, preset, queue))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=900) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    return results[0]


def totals(counts: dict[str, Any]) -> tuple[int, int]:
    """(copy ops, bytes written) of one implementation's step."""
    return sum(counts["ops"].values()), sum(counts["bytes"].values())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--by-op", action="store_true", help="also print each op's counts")
    args = parser.parse_args()
    results = count(list(CASES), args.world_size, args.preset)
    print(f"preset {args.preset} {PRESETS[args.preset]}, W={args.world_size}, rank 0, one step")
    print(
        "| case | fsdp_compose copies | FSDP2 copies | fsdp_compose KiB | FSDP2 KiB "
        "| bytes ratio | same collectives | bit-identical |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        (ops, nbytes), (ops2, nbytes2) = totals(r["fsdp_compose"]), totals(r["fsdp2"])
        same = r["fsdp_compose"]["collectives"] == r["fsdp2"]["collectives"]
        print(
            f"| {name} | {ops} | {ops2} | {nbytes / 1024:.1f} | {nbytes2 / 1024:.1f} "
            f"| {nbytes / nbytes2:.3f} | {same} | {r['bit_identical']} |"
        )
    if args.by_op:
        for name, r in results.items():
            print(f"\n{name}: op: fsdp_compose count/KiB | FSDP2 count/KiB")
            ours, theirs = r["fsdp_compose"], r["fsdp2"]
            for op in sorted(set(ours["ops"]) | set(theirs["ops"])):
                print(
                    f"  {op}: {ours['ops'].get(op, 0)}/{ours['bytes'].get(op, 0) / 1024:.1f}"
                    f" | {theirs['ops'].get(op, 0)}/{theirs['bytes'].get(op, 0) / 1024:.1f}"
                )


if __name__ == "__main__":
    main()
