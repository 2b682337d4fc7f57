"""The memory formula that measured peaks are checked against.

Per rank, for a model of P parameter bytes (fp32) trained with AdamW:

    formula = sharded state + unsharded working set + activations

* sharded state = (params + grads + Adam exp_avg + Adam exp_avg_sq) / W
  = 4 P / W for the FSDPs; 4 P for ``single`` and ``ddp`` (nothing is sharded).
* unsharded working set (FSDP at W > 1 only; at W = 1 the shard *is* the full
  parameter and nothing needs to be gathered):
  root unit params + root unit grads (the root keeps its parameters from forward
  through backward, and its gradients exist from the first backward op to the
  last) + 3 x the largest block (the block computing: parameters and gradients,
  and the next block's prefetched parameters).
  ``ddp``: + P for the reducer's gradient buckets (a second copy of the grads).
* activations = bytes autograd saves for backward in the unwrapped model at the
  local batch (measured by a forward on the meta device with
  ``saved_tensors_hooks``, parameters excluded).

It deliberately ignores transient buffers (logit gradients, temporaries inside
kernels, the reduce-scatter's packed/received copies, allocator slack), so a
measured/formula ratio a little above 1 is expected; far above 1 points at memory
the implementation holds that an ideal one would not.
"""

from __future__ import annotations

import torch

from workloads import FSDP_IMPLS, GPT, PRESETS, loss_fn, unit_param_bytes


def activation_bytes(preset: str, local_batch: int) -> int:
    """Bytes saved for backward by one forward of the unwrapped model (meta device)."""
    cfg = PRESETS[preset]
    with torch.device("meta"):
        model = GPT(cfg)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in params:  # views of one tensor share a storage
            saved[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        x = torch.zeros(local_batch, cfg.block_size, dtype=torch.long, device="meta")
        loss_fn(model(x), x)
    return sum(saved.values())


def memory_formula(impl: str, preset: str, world_size: int, local_batch: int) -> dict[str, int]:
    """The formula's terms and total, in bytes per rank."""
    sizes = unit_param_bytes(preset)
    total = sizes["total"]
    shards = world_size if impl in FSDP_IMPLS else 1
    terms = {
        "sharded_state": 4 * total // shards,
        "unsharded_working_set": 0,
        "activations": activation_bytes(preset, local_batch),
    }
    if impl in FSDP_IMPLS and world_size > 1:
        terms["unsharded_working_set"] = 2 * sizes["root"] + 3 * sizes["block"]
    elif impl == "ddp":
        terms["unsharded_working_set"] = total
    terms["total"] = sum(terms.values())
    return terms
