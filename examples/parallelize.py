"""How the examples apply fsdp_compose: one readable function per parallelism."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from fsdp_compose import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from gpt import GPT


def apply_fsdp(
    model: GPT,
    *,
    mesh: DeviceMesh | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool | int = True,
    offload: bool = False,
) -> GPT:
    """Shards each transformer block as its own unit, then the root (embeddings,
    final norm and head). On a 2-D mesh (replicate, shard) this is HSDP."""
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # The root hands the logits to the loss in float32: a softmax over the whole
    # vocabulary in bf16/fp16 would round the loss to 2-3 significant digits.
    root_mp_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        output_dtype=torch.float32 if param_dtype is not None else None,
    )
    offload_policy: OffloadPolicy = CPUOffloadPolicy() if offload else OffloadPolicy()
    for block in model.blocks:
        fully_shard(
            block,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
        )
    # The root's parameters are needed again right at the start of backward, so
    # by default (reshard_after_forward=None) it keeps them after forward.
    fully_shard(model, mesh=mesh, mp_policy=root_mp_policy, offload_policy=offload_policy)
    return model
