"""MixedPrecisionPolicy: compute and all-gather in ``param_dtype``, reduce in
``reduce_dtype``, keep float32 shards and gradients, cast inputs and outputs.

The reference for low precision is the same model cast to that dtype, run on the
global batch in one process (its gradients kept in float32 for the optimizer, like
the sharded run's float32 shards).
"""

from __future__ import annotations

import copy
from collections import defaultdict

import torch
import torch.nn as nn
from gpt import GPT, GPTConfig, loss_fn, make_batch
from helpers import collective_log, full, local_slice, mean_across_ranks, rank_world
from models import TINY_GPT
from torch.distributed.tensor import DTensor

from fsdp_compose import MixedPrecisionPolicy, fully_shard
from fsdp_compose._runtime import _compat

TINY = TINY_GPT
BF16_LOSS_RTOL = 2e-2  # the bound; measured 7e-3 (a bf16 loss of ~4.6 rounds to 2**-7)
# no-sync accumulation in float32 vs. reducing every micro-step in float32: the
# same bf16 gradients summed in a different order
ACCUM_GRAD_TOL = 1e-6


def _shard_gpt(model: GPT, policies: list[MixedPrecisionPolicy], root: MixedPrecisionPolicy) -> None:
    for block, policy in zip(model.blocks, policies):
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=root)


def _low_precision_reference_step(
    ref: GPT, dtype: torch.dtype, x: torch.Tensor, y: torch.Tensor
) -> float:
    """Forward/backward of ``ref`` cast to ``dtype``; float32 grads land on ``ref``."""
    low = copy.deepcopy(ref).to(dtype)
    loss = loss_fn(low(x), y)
    loss.backward()
    for p, q in zip(ref.parameters(), low.parameters()):
        p.grad = q.grad.float()
    return loss.item()


def _record_dtypes(modules: dict[str, nn.Module]) -> dict[str, list[torch.dtype]]:
    seen: dict[str, list[torch.dtype]] = defaultdict(list)
    for name, module in modules.items():
        module.register_forward_hook(lambda m, a, out, name=name: seen[name].append(out.dtype))
    return seen


def _bf16_job() -> dict:
    """bf16 compute and all-gather, fp32 reduction: dtypes, bytes and loss parity."""
    rank, world = rank_world()
    torch.manual_seed(0)
    cfg = GPTConfig(**TINY)
    ref = GPT(cfg)
    fp32_model, bf16_model = copy.deepcopy(ref), copy.deepcopy(ref)
    _shard_gpt(fp32_model, [MixedPrecisionPolicy()] * cfg.n_layer, MixedPrecisionPolicy())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _shard_gpt(bf16_model, [mp] * cfg.n_layer, mp)
    seen = _record_dtypes({"block0.mlp.fc": bf16_model.blocks[0].mlp.fc, "logits": bf16_model})
    out: dict = {}

    # One step of each model under the collective log: what moves, in which dtype.
    x, y = make_batch(cfg, 2 * world, 0)
    xs, ys = local_slice(x, rank, world), local_slice(y, rank, world)
    bytes_moved, rs_dtypes = {}, {}
    for name, model in (("fp32", fp32_model), ("bf16", bf16_model)):
        with collective_log(model) as log:
            loss_fn(model(xs), ys).backward()
        bytes_moved[name] = sum(i.input_bytes for i in log.issued if i.kind == "all_gather")
        out[f"ag_dtypes_{name}"] = sorted({str(i.dtype) for i in log.issued if i.kind == "all_gather"})
        rs_dtypes[name] = sorted({str(i.dtype) for i in log.issued if i.kind == "reduce_scatter"})
        model.zero_grad()
    out["ag_bytes"] = bytes_moved
    out["rs_dtypes"] = rs_dtypes
    out["activation_dtypes"] = {k: sorted(set(map(str, v))) for k, v in seen.items()}

    # Training parity with the bf16-cast reference on the global batch.
    opt = torch.optim.AdamW(bf16_model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    rel = []
    for step in range(3):
        x, y = make_batch(cfg, 2 * world, step)
        ref_loss = _low_precision_reference_step(ref, torch.bfloat16, x, y)
        loss = loss_fn(bf16_model(local_slice(x, rank, world)), local_slice(y, rank, world))
        loss.backward()
        if step == 0:
            out["param_dtypes"] = sorted({str(p.dtype) for p in bf16_model.parameters()})
            out["grad_dtypes"] = sorted({str(p.grad.dtype) for p in bf16_model.parameters()})
            out["grads_are_dtensors"] = all(
                isinstance(p.grad, DTensor) for p in bf16_model.parameters()
            )
            ref_grads = dict(ref.named_parameters())
            out["grad_rel_diff"] = max(
                ((full(p.grad) - ref_grads[n].grad).norm() / ref_grads[n].grad.norm()).item()
                for n, p in bf16_model.named_parameters()
            )
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        mean = mean_across_ranks(loss.float().item())
        rel.append(abs(mean - ref_loss) / abs(ref_loss))
    out["loss_rel_diff"] = rel
    out["master_dtypes_after_step"] = sorted({str(p.dtype) for p in bf16_model.parameters()})
    return out


def test_bf16_params_fp32_reduce() -> None:
    from dist_utils import run_distributed

    for r in run_distributed(_bf16_job, 2):
        # activations inside the unit, and the root's output, are bf16
        assert r["activation_dtypes"] == {
            "block0.mlp.fc": ["torch.bfloat16"], "logits": ["torch.bfloat16"]
        }
        # float32 shards and float32 DTensor gradients, before and after the optimizer
        assert r["param_dtypes"] == ["torch.float32"]
        assert r["master_dtypes_after_step"] == ["torch.float32"]
        assert r["grad_dtypes"] == ["torch.float32"] and r["grads_are_dtensors"]
        # the all-gather runs in bf16 and moves exactly half the bytes
        assert r["ag_dtypes_bf16"] == ["torch.bfloat16"] and r["ag_dtypes_fp32"] == ["torch.float32"]
        assert r["ag_bytes"]["bf16"] * 2 == r["ag_bytes"]["fp32"], r["ag_bytes"]
        # reduce_dtype=float32: gradients are reduced in float32
        assert r["rs_dtypes"] == {"fp32": ["torch.float32"], "bf16": ["torch.float32"]}
        assert max(r["loss_rel_diff"]) <= BF16_LOSS_RTOL, r["loss_rel_diff"]
        assert r["grad_rel_diff"] <= 5e-2, r["grad_rel_diff"]


class _Probe(nn.Module):
    """Records the dtypes its forward receives; computes in its weight's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []

    def forward(self, x: torch.Tensor, *, ids: torch.Tensor) -> torch.Tensor:
        self.seen.append((x.dtype, ids.dtype))
        return self.lin(x.to(self.lin.weight.dtype)) + ids.to(self.lin.weight.dtype)[:, None]


def _policies_job() -> dict:
    """Per-unit policies, reduce_dtype=None, output/input casts, no-sync accumulation."""
    rank, world = rank_world()
    torch.manual_seed(0)
    out: dict = {}

    # Different policies for different units of one model.
    cfg = GPTConfig(**TINY)
    ref = GPT(cfg)
    model = copy.deepcopy(ref)
    policies = [
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32),  # reduce in bf16
        MixedPrecisionPolicy(
            param_dtype=torch.float16, reduce_dtype=torch.float32, output_dtype=torch.float32
        ),
        MixedPrecisionPolicy(),
    ]
    _shard_gpt(model, policies, MixedPrecisionPolicy())
    seen = _record_dtypes({f"block{i}": b.mlp.fc for i, b in enumerate(model.blocks)})
    seen_out = _record_dtypes({f"out{i}": b for i, b in enumerate(model.blocks)})
    x, y = make_batch(cfg, 2 * world, 0)
    with collective_log(model) as log:
        loss = loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world))
        loss.backward()
    by_unit: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for info in log.issued:
        by_unit[info.label][info.kind].add(str(info.dtype))
    out["comm_dtypes"] = {u: {k: sorted(v) for k, v in kinds.items()} for u, kinds in by_unit.items()}
    out["compute_dtypes"] = {k: sorted(set(map(str, v))) for k, v in seen.items()}
    out["output_dtypes"] = {k: sorted(set(map(str, v))) for k, v in seen_out.items()}
    out["grad_dtypes"] = sorted({str(p.grad.dtype) for p in model.parameters()})
    ref_loss = loss_fn(ref(x), y)
    out["mixed_loss_rel_diff"] = abs(mean_across_ranks(loss.item()) - ref_loss.item()) / ref_loss.item()

    # cast_forward_inputs / output_dtype on a unit called with float and int inputs.
    for cast in (True, False):
        probe = _Probe()
        fully_shard(
            probe,
            mp_policy=MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, output_dtype=torch.float64 if cast else None,
                cast_forward_inputs=cast,
            ),
        )
        result = probe(torch.randn(3, 4), ids=torch.arange(3))
        out[f"probe_cast_{cast}"] = [str(d) for d in probe.seen[0]] + [str(result.dtype)]

    # set_requires_gradient_sync(False) accumulates the bf16 gradients in the
    # float32 reduce dtype: equal to reducing every micro-step in float32.
    torch.manual_seed(1)
    base = GPT(cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    no_sync, every_step = copy.deepcopy(base), copy.deepcopy(base)
    _shard_gpt(no_sync, [mp] * cfg.n_layer, mp)
    _shard_gpt(every_step, [mp] * cfg.n_layer, mp)
    micro = [make_batch(cfg, 2 * world, 10 + i) for i in range(2)]
    for i, (x, y) in enumerate(micro):
        no_sync.set_requires_gradient_sync(i == len(micro) - 1)
        loss_fn(no_sync(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        if i == 0:
            # up to torch 2.14 an upcast copy; from 2.15 autograd hands the gradient
            # over in reduce_dtype, and it accumulates on the unsharded parameter
            accumulated = [
                p.accumulated_grad
                if p.accumulated_grad is not None
                else getattr(p.unsharded_param, "grad", None)
                for p in no_sync.blocks[0]._fsdp_state().unit.params
            ]
            out["accumulated_dtypes"] = sorted({str(a.dtype) for a in accumulated if a is not None})
        loss_fn(every_step(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    out["accum_grad_diff"] = max(
        (a.grad.to_local() - b.grad.to_local()).abs().max().item()
        for a, b in zip(no_sync.parameters(), every_step.parameters())
        if a.grad.numel()
    )
    return out


def _comm(gather: str, reduce: str) -> dict[str, list[str]]:
    return {"all_gather": [f"torch.{gather}"], "reduce_scatter": [f"torch.{reduce}"]}


def test_policies_per_unit_casts_and_accumulation() -> None:
    from dist_utils import run_distributed

    for r in run_distributed(_policies_job, 2):
        comm = r["comm_dtypes"]
        # block 0: bf16 gather; reduce_dtype=None reduces in param_dtype (bf16) up to
        # torch 2.14 and in the parameter's own dtype (fp32) from 2.15, as FSDP2 does
        reduce = "float32" if _compat.REDUCE_IN_PARAM_DTYPE else "bfloat16"
        assert comm["blocks.0"] == _comm("bfloat16", reduce)
        # block 1: fp16 gather, fp32 reduction (fp16 and bf16 both work on gloo)
        assert comm["blocks.1"] == _comm("float16", "float32")
        assert comm["blocks.2"] == _comm("float32", "float32")
        assert r["compute_dtypes"] == {
            "block0": ["torch.bfloat16"], "block1": ["torch.float16"], "block2": ["torch.float32"]
        }
        # output_dtype=float32 hands float32 to the next (float32) unit
        assert r["output_dtypes"] == {
            "out0": ["torch.float32"], "out1": ["torch.float32"], "out2": ["torch.float32"]
        }
        assert r["grad_dtypes"] == ["torch.float32"]
        assert r["mixed_loss_rel_diff"] <= BF16_LOSS_RTOL, r["mixed_loss_rel_diff"]
        # floating inputs cast to param_dtype, integer inputs untouched, output cast
        assert r["probe_cast_True"] == ["torch.bfloat16", "torch.int64", "torch.float64"]
        assert r["probe_cast_False"] == ["torch.float32", "torch.int64", "torch.bfloat16"]
        assert r["accumulated_dtypes"] == ["torch.float32"]
        assert r["accum_grad_diff"] <= ACCUM_GRAD_TOL, r["accum_grad_diff"]
