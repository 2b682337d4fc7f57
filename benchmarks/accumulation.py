"""Gradient accumulation over micro-batches: memory held and error per mode.

One step of ``--micro`` micro-batches (gradient sync on the last one only) of a
small multi-unit model (``--layers`` x ``Linear(--dim, --dim)`` + tanh, one unit
each) with bf16 compute (``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``) on
``--world-size`` gloo ranks, per mode:

* ``fsdp2``: torch's ``fully_shard``, ``reduce_dtype=None`` (accumulates in bf16);
* ``fsdp2 fp32``: torch's ``fully_shard``, ``reduce_dtype=torch.float32``;
* ``ours``, ``ours fp32``: fsdp_compose, the same two policies (FSDP2's behaviour);
* ``ours fp32 grads``: fsdp_compose, ``MixedPrecisionPolicy(grad_dtype=torch.float32)``
  (FSDP2 2.16's gradient dtype: fp32 gradients of the bf16 compute, accumulated
  unsharded and reduced in fp32);
* ``ours sharded``: fsdp_compose with ``set_gradient_accumulation("sharded")``,
  ``reduce_dtype=None`` (bf16 reduce-scatter, fp32 accumulation of the shard);
* ``ours sharded fp32``: the same with ``reduce_dtype=torch.float32``.

Reported:

* the final gradients' largest absolute error against one process computing the
  same micro-batches in fp32 (the data-parallel mean), and that error relative to
  the reference's largest absolute gradient;
* accumulator bytes held per rank between micro-batches (the largest after any
  no-sync backward): for fsdp_compose the tensors ``get_pending_gradients()``
  returns; for torch's FSDP2, its unsharded gradients (``_unsharded_param.grad``
  and ``unsharded_accumulated_grad``, read here through its private state);
* bytes sent per rank per step, counted at the dispatcher (every c10d collective
  either library issues) at the bandwidth-optimal count: (W-1)/W of an all-gather's
  output and of a reduce-scatter's input, 2(W-1)/W of an all-reduce; the gradient
  collectives (reduce-scatter, all-reduce) and all of them.

Run: ``python benchmarks/accumulation.py [--world-size 2] [--micro 8]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]

MODES = (
    "fsdp2",
    "fsdp2 fp32",
    "ours",
    "ours fp32",
    "ours fp32 grads",
    "ours sharded",
    "ours sharded fp32",
)


def _model(args: argparse.Namespace) -> Any:
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.dim, args.dim), nn.Tanh()]
    return nn.Sequential(*layers)


def _batch(args: argparse.Namespace, rank: int, micro: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(1000 * micro + rank)
    # A shared mean: micro-batch gradients agree in sign, as they mostly do in training.
    return torch.randn(args.batch, args.dim, generator=gen) + 1


def _loss(model: Any, x: Any) -> Any:
    return model(x).float().mean()


def _byte_counter(world: int) -> Any:
    """A dispatch mode adding up the bytes each c10d collective sends per rank."""
    from torch.utils._python_dispatch import TorchDispatchMode

    share = (world - 1) / world

    class _Bytes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.grad = 0.0
            self.total = 0.0

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            name = str(func)
            if name.startswith("c10d."):
                if "reduce_scatter" in name:  # (output, input, ...)
                    sent = share * args[1].nbytes
                elif "allgather" in name:  # (output, input, ...)
                    out = args[0]
                    sent = share * (
                        out.nbytes if hasattr(out, "nbytes") else sum(t.nbytes for t in out[0])
                    )
                elif "allreduce" in name:  # ([tensors], ...)
                    sent = 2 * share * sum(t.nbytes for t in args[0])
                else:
                    sent = 0.0
                self.total += sent
                if "allgather" not in name:
                    self.grad += sent
            return func(*args, **(kwargs or {}))

    return _Bytes()


def _fsdp2_held(model: Any) -> int:
    """Bytes of torch's FSDP2's unsharded gradients kept between micro-batches
    (its private state; for this benchmark only)."""
    from torch.distributed.fsdp import FSDPModule

    held = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for fp in group.fsdp_params:
                for grad in (fp.unsharded_accumulated_grad, fp._unsharded_param.grad):
                    held += 0 if grad is None else grad.nbytes
    return held


def _ours_held(model: Any) -> int:
    return sum(
        t.nbytes for pair in model.get_pending_gradients().values() for t in pair if t is not None
    )


def _run_mode(mode: str, args: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_compose import MixedPrecisionPolicy, fully_shard

    shard_fn = torch_fully_shard if mode.startswith("fsdp2") else fully_shard
    mesh = init_device_mesh("cpu", (world,))
    reduce_dtype = torch.float32 if mode.endswith("fp32") else None
    grad_dtype = torch.float32 if mode.endswith("grads") else None
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype, grad_dtype=grad_dtype
    )
    model = _model(args)
    for layer in model[::2]:
        shard_fn(layer, mesh=mesh, mp_policy=mp)
    shard_fn(model, mesh=mesh, mp_policy=mp)
    if "sharded" in mode:
        model.set_gradient_accumulation("sharded")
    held = 0
    counter = _byte_counter(world)
    for micro in range(args.micro):
        last = micro == args.micro - 1
        model.set_requires_gradient_sync(last)
        with counter:
            _loss(model, _batch(args, rank, micro).to(torch.bfloat16)).backward()
        if not last:
            held = max(
                held, _fsdp2_held(model) if shard_fn is torch_fully_shard else _ours_held(model)
            )
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return {"held": held, "grad_bytes": counter.grad, "bytes": counter.total, "grads": grads}


def _worker(rank: int, world: int, init_file: str, args: argparse.Namespace, queue: Any) -> None:
    import harness
    import torch.distributed as dist

    harness.init_gloo(rank, world, init_file)
    # The reference: one process in fp32, the data-parallel mean of every gradient.
    ref_model = _model(args)
    for micro in range(args.micro):
        for r in range(world):
            (_loss(ref_model, _batch(args, r, micro)) / world).backward()
    ref = {n: p.grad for n, p in ref_model.named_parameters()}
    scale = max(g.abs().max().item() for g in ref.values())
    rows = {}
    for mode in MODES:
        r = _run_mode(mode, args, rank, world)
        grads = r.pop("grads")
        error = max((grads[n].float() - ref[n]).abs().max().item() for n in ref)
        rows[mode] = {**r, "error": error, "relative": error / scale}
    numel = sum(g.numel() for g in ref.values())
    if rank == 0:
        queue.put({"rows": rows, "numel": numel})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import harness

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="rows per rank per micro-batch")
    args = parser.parse_args()
    out = harness.spawn_ranks(_worker, args.world_size, args, "fsdp_compose_accum_")
    rows, numel = out["rows"], out["numel"]
    kib = 1024
    print(
        f"{args.layers} x Linear({args.dim}, {args.dim}) units ({numel} parameters), bf16 compute, "
        f"W={args.world_size}, {args.micro} micro-batches of {args.batch} rows per rank"
    )
    print(
        "| mode | max abs error | relative error | error / fsdp2 fp32 | accumulator KiB/rank "
        "| held / fsdp2 fp32 | grad collective KiB/step | all collectives KiB/step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    base = rows["fsdp2 fp32"]
    for mode in MODES:
        r = rows[mode]
        print(
            f"| {mode} | {r['error']:.3e} | {r['relative']:.3e} | {r['error'] / base['error']:.2f} "
            f"| {r['held'] / kib:.1f} | {r['held'] / base['held']:.3f} "
            f"| {r['grad_bytes'] / kib:.1f} | {r['bytes'] / kib:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
