"""HSDP on a 2-D (replicate, shard) mesh: placements, collectives and parity with
one process on the global batch; ``set_requires_all_reduce(False)``; mesh errors."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from gpt import GPT, GPTConfig, loss_fn, make_batch
from helpers import (
    collective_log,
    gpt_batches,
    local_slice,
    max_grad_diff,
    rank_world,
    train_side_by_side,
)
from models import TINY_GPT
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp_compose import MixedPrecisionPolicy, fully_shard

TINY = TINY_GPT
LOSS_TOL = 1e-5
GRAD_TOL = 1e-6
PARAM_TOL = 1e-4  # AdamW amplifies last-bit differences, see test_parity.py


def _hsdp_gpt(cfg: GPTConfig, base: GPT, mesh, **kwargs) -> GPT:
    model = copy.deepcopy(base)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _hsdp_job() -> dict:
    rank, world = rank_world()
    assert world == 4
    torch.manual_seed(0)
    cfg = GPTConfig(**TINY)
    ref = GPT(cfg)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _hsdp_gpt(cfg, ref, mesh)
    out: dict = {
        "placements": sorted({str(p.placements) for p in model.parameters()}),
        "coordinate": list(mesh.get_coordinate()),
    }

    # Parity: 4 data-parallel ranks (2 replicas x 2 shards) vs the global batch.
    def step0_checks(step: int, *_: object) -> None:
        if step == 0:
            out["grad_placements"] = sorted({str(p.grad.placements) for p in model.parameters()})
            # both replicas of a shard hold the same gradient after the all-reduce
            local = torch.cat([p.grad.to_local().reshape(-1) for p in model.parameters()])
            replicas = [torch.empty_like(local) for _ in range(2)]
            torch.distributed.all_gather(replicas, local, group=mesh.get_group("replicate"))
            out["replicas_agree"] = torch.equal(replicas[0], replicas[1])
            out["replicas_max_diff"] = (replicas[0] - replicas[1]).abs().max().item()

    with collective_log(model) as log:
        parity = train_side_by_side(
            model, ref, 3, gpt_batches(cfg), loss_fn, log=log, after_backward=step0_checks
        )
    out["grad_diff"] = parity["grad_diff"]
    out["kinds"] = {
        kind: sorted({i.group_size for i in log.issued if i.kind == kind})
        for kind in ("all_gather", "reduce_scatter", "all_reduce")
    }
    out["counts"] = dict(log.kinds())
    out["loss_diffs"] = parity["loss_diffs"]
    out["param_diff"], out["where"] = parity["param_diff"], parity["where"]

    # set_requires_all_reduce(False): the first micro-step reduce-scatters and keeps
    # the sums; the last one all-reduces them together with its own.
    torch.manual_seed(1)
    base = GPT(cfg)
    accum = _hsdp_gpt(cfg, base, mesh)
    micro = [make_batch(cfg, 2 * world, 20 + i) for i in range(2)]
    all_reduces = []
    with collective_log(accum) as log:
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            accum.set_requires_all_reduce(last)
            log.clear()
            (
                loss_fn(accum(local_slice(x, rank, world)), local_slice(y, rank, world)) / 2
            ).backward()
            all_reduces.append(log.kinds().get("all_reduce", 0))
            if not last:
                out["grad_before_all_reduce"] = any(p.grad is not None for p in accum.parameters())
    for x, y in micro:
        (loss_fn(base(x), y) / 2).backward()
    out["accum_all_reduces"] = all_reduces
    out["accum_grad_diff"] = max_grad_diff(accum, base)

    # Low precision over both dims: bf16 gather, fp32 reduce-scatter and all-reduce.
    torch.manual_seed(0)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    bf16 = _hsdp_gpt(cfg, GPT(cfg), mesh, mp_policy=mp)
    x, y = make_batch(cfg, 2 * world, 0)
    with collective_log(bf16) as log:
        loss_fn(bf16(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    out["mp_dtypes"] = {
        kind: sorted({str(i.dtype) for i in log.issued if i.kind == kind})
        for kind in ("all_gather", "reduce_scatter", "all_reduce")
    }
    out["mp_grad_vs_fp32"] = max(
        ((a.grad.full_tensor() - b.grad).norm() / b.grad.norm()).item()
        for a, b in zip(bf16.parameters(), _reference_params_after_backward(cfg, x, y))
    )
    return out


def _reference_params_after_backward(
    cfg: GPTConfig, x: torch.Tensor, y: torch.Tensor
) -> list[torch.nn.Parameter]:
    """Parameters of the seed-0 reference GPT after one float32 backward on (x, y)."""
    torch.manual_seed(0)
    ref = GPT(cfg)
    loss_fn(ref(x), y).backward()
    return list(ref.parameters())


def test_hsdp_2x2_parity() -> None:
    from dist_utils import run_distributed

    results = run_distributed(_hsdp_job, 4, timeout=240)
    assert [r["coordinate"] for r in results] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    for r in results:
        assert r["placements"] == [str((Replicate(), Shard(0)))]
        assert r["grad_placements"] == [str((Replicate(), Shard(0)))]
        assert r["replicas_agree"], r
        assert r["grad_diff"] <= GRAD_TOL, r["grad_diff"]
        assert max(r["loss_diffs"]) <= LOSS_TOL, r["loss_diffs"]
        assert r["param_diff"] <= PARAM_TOL, (r["param_diff"], r["where"])
        # every collective runs over a group of 2: gathers and reduce-scatters in
        # the shard group, all-reduces in the replicate group; one of each per unit
        assert r["kinds"] == {"all_gather": [2], "reduce_scatter": [2], "all_reduce": [2]}
        n_units = TINY["n_layer"] + 1
        assert r["counts"]["reduce_scatter"] == r["counts"]["all_reduce"] == n_units, (
            r["counts"],
            n_units,
        )
        # accumulation without the replicate all-reduce
        assert r["accum_all_reduces"] == [0, n_units]
        assert not r["grad_before_all_reduce"], r
        assert r["accum_grad_diff"] <= GRAD_TOL, r["accum_grad_diff"]
        assert r["mp_dtypes"] == {
            "all_gather": ["torch.bfloat16"],
            "reduce_scatter": ["torch.float32"],
            "all_reduce": ["torch.float32"],
        }
        assert r["mp_grad_vs_fp32"] <= 5e-2, r["mp_grad_vs_fp32"]


def _degenerate_shapes_job() -> dict:
    """(4, 1) is DDP-like (no sharding), (1, 4) is plain FSDP: same gradients."""
    rank, world = rank_world()
    cfg = GPTConfig(**{**TINY, "n_layer": 1})
    out = {}
    for shape in ((4, 1), (1, 4)):
        torch.manual_seed(0)
        ref = GPT(cfg)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        model = _hsdp_gpt(cfg, ref, mesh)
        x, y = make_batch(cfg, 2 * world, 0)
        loss_fn(ref(x), y).backward()
        loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        out[str(shape)] = max_grad_diff(model, ref)
    return out


def _mesh_errors_job() -> dict[str, str]:
    def expect(fn, pattern: str) -> str:
        try:
            fn()
        except ValueError as exc:
            return "ok" if re.search(pattern, str(exc)) else f"message: {exc}"
        except Exception as exc:  # noqa: BLE001
            return f"wrong exception {type(exc).__name__}: {exc}"
        return "no exception"

    lin = torch.nn.Linear
    results = {
        "3d": expect(
            lambda: fully_shard(lin(4, 4), mesh=init_device_mesh("cpu", (1, 2, 2))),
            r"1-D mesh .* or a 2-D mesh .* 3-D",
        ),
        "unnamed_2d": expect(
            lambda: fully_shard(lin(4, 4), mesh=init_device_mesh("cpu", (2, 2))),
            r"2-D mesh without mesh_dim_names",
        ),
        "int_param_dtype": expect(
            lambda: MixedPrecisionPolicy(param_dtype=torch.int8), "floating-point"
        ),
    }
    # FSDP2 accepts any dim names (dim 0 replicates): a warning, not a refusal.
    for names, pattern in ((("shard", "replicate"), "suggests the reverse"), (("dp", "tp"), "'tp'")):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        with pytest.warns(UserWarning, match=pattern):
            fully_shard(lin(4, 4), mesh=mesh)
    with pytest.raises(AssertionError):  # FSDP2's type for an unnamed 2-D mesh
        fully_shard(lin(4, 4), mesh=init_device_mesh("cpu", (2, 2)))
    # torchtitan's naming is accepted
    model = lin(4, 4)
    titan = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    fully_shard(model, mesh=titan)
    results["titan_names"] = "ok" if isinstance(model.weight, DTensor) else "not sharded"
    return results


@pytest.mark.parametrize("job", ["degenerate", "errors"])
def test_hsdp_shapes_and_errors(job: str) -> None:
    from dist_utils import run_distributed

    if job == "degenerate":
        for r in run_distributed(_degenerate_shapes_job, 4):
            assert max(r.values()) <= GRAD_TOL, r
    else:
        for r in run_distributed(_mesh_errors_job, 4):
            assert all(v == "ok" for v in r.values()), r
