"""FSDP + tensor parallel on a 2-D mesh (dp 2 x tp 2, four gloo ranks).

Each block of the example GPT is parallelised with ``parallelize_module``
(column-wise q, k, v and MLP input; row-wise output projections) and then
sharded with ``fully_shard(block, mesh=mesh["dp"])``; the root stays plain and
dp-sharded. One job checks, against the unsharded model trained on the global
batch in the same process: the sharded layout (placements, local and global
shapes, ``full_tensor()`` values), losses, reduced gradients and parameters;
then state dicts (full, TP-only and sharded) and a DCP save/load round trip,
including loading the TP+FSDP checkpoint into a model sharded without TP. A
second job covers sequence parallel (``Partial`` gradients of replicated
parameters), accumulation without sync, and misuse errors.

``n_embd=34`` makes the TP-local rows of q/k/v (17) uneven over dp (9 + 8), and
the vocabulary (97) uneven over dp for the root's embeddings.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from dist_utils import run_distributed
from gpt import GPT, GPTConfig, loss_fn, make_batch
from helpers import max_grad_diff, max_param_diff
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from train_tp import apply_tensor_parallel, apply_tp_fsdp

from fsdp_compose import MixedPrecisionPolicy, fully_shard

from fsdp_compose._runtime import _compat

CFG = dict(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=34)
DP, TP = 2, 2
PER_RANK_BATCH = 2
LR = 1e-3
LOSS_TOL = 1e-5
GRAD_TOL = 1e-6
PARAM_TOL = 1e-4  # AdamW amplifies last-bit differences (see test_parity.py)

# full_tensor() of FSDP's strided shards warns that it takes two all-gathers
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

_COLWISE = ("attn.q.", "attn.k.", "attn.v.", "mlp.fc.")


def _expected_placements(name: str) -> tuple[Placement, ...]:
    if not name.startswith("blocks.") or ".ln_" in name:
        return (Shard(0),)  # plain parameter, dp mesh only
    if any(c in name for c in _COLWISE):
        # FSDP's rows inside each TP chunk: strided over dp
        return (_compat.strided_shard(0, TP), Shard(0))
    if name.endswith("proj.weight"):
        return (Shard(0), Shard(1))
    return (Shard(0), Replicate())  # row-wise bias


def _expected_local(full: torch.Tensor, name: str, dp_rank: int, tp_rank: int) -> torch.Tensor:
    """The local shard by hand: TP's torch.chunk first, then FSDP's dim-0 chunk."""
    placements = _expected_placements(name)
    if len(placements) == 2 and isinstance(placements[1], Shard):
        full = full.chunk(TP, dim=placements[1].dim)[tp_rank]
    chunks = full.chunk(DP, dim=0)
    return chunks[dp_rank] if dp_rank < len(chunks) else full[:0]


def _mesh():
    return init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))


def _build(mesh, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return apply_tp_fsdp(GPT(GPTConfig(**CFG)), mesh)


def _step(model: GPT, optim: torch.optim.Optimizer, step: int, dp_rank: int) -> float:
    """One step on this dp rank's slice of the global batch; the global loss."""
    cfg = GPTConfig(**CFG)
    x, y = make_batch(cfg, PER_RANK_BATCH * DP, step)
    sl = slice(dp_rank * PER_RANK_BATCH, (dp_rank + 1) * PER_RANK_BATCH)
    loss = loss_fn(model(x[sl]), y[sl])
    loss.backward()
    optim.step()
    optim.zero_grad()
    mean = torch.tensor([loss.item()], dtype=torch.float64)
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def _tp_fsdp_job(path: str) -> dict:
    rank = dist.get_rank()
    dp_rank, tp_rank = divmod(rank, TP)
    mesh = _mesh()
    cfg = GPTConfig(**CFG)
    torch.manual_seed(0)
    ref = GPT(cfg)
    model = apply_tp_fsdp(copy.deepcopy(ref), mesh)
    out: dict = {}

    # --- layout ------------------------------------------------------------
    ref_params = dict(ref.named_parameters())
    layout_errors = []
    for name, p in model.named_parameters():
        q = ref_params[name].detach()
        expected = _expected_placements(name)
        mesh_names = ("dp", "tp") if len(expected) == 2 else ("dp",)
        local = _expected_local(q, name, dp_rank, tp_rank)
        checks = {
            "parameter": isinstance(p, nn.Parameter) and isinstance(p, DTensor),
            "placements": tuple(p.placements) == expected,
            "mesh": p.device_mesh.mesh_dim_names == mesh_names,
            "global shape": p.shape == q.shape,
            "local": torch.equal(p.to_local(), local),
            "full_tensor": torch.equal(p.full_tensor(), q),
        }
        layout_errors += [f"{name}: {what}" for what, ok in checks.items() if not ok]
    out["layout_errors"] = layout_errors
    out["sd_keys_equal"] = list(model.state_dict()) == list(ref.state_dict())

    # unshard() registers TP DTensors (original placement) viewing the gathered data
    block = model.blocks[0]
    block.unshard()
    w, b = block.attn.q.weight, block.attn.proj.bias
    out["unsharded"] = (
        isinstance(w, DTensor)
        and w.device_mesh.mesh_dim_names == ("tp",)
        and w.placements == (Shard(0),)
        and w.to_local().shape == (cfg.n_embd // TP, cfg.n_embd)
        and torch.equal(w.full_tensor(), ref.blocks[0].attn.q.weight.detach())
        and b.placements == (Replicate(),)
        and torch.equal(b.to_local(), ref.blocks[0].attn.proj.bias.detach())
    )
    block.reshard()
    out["resharded"] = block.attn.q.weight.device_mesh.mesh_dim_names == ("dp", "tp")

    # --- parity with one process on the global batch -------------------------
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    loss_diffs = []
    for step in range(4):
        x, y = make_batch(cfg, PER_RANK_BATCH * DP, step)
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        sl = slice(dp_rank * PER_RANK_BATCH, (dp_rank + 1) * PER_RANK_BATCH)
        loss = loss_fn(model(x[sl]), y[sl])
        loss.backward()
        if step == 0:
            out["grad_diff"] = max_grad_diff(model, ref)
            out["grad_placements_match"] = all(
                isinstance(p.grad, DTensor) and p.grad.placements == p.placements
                for p in model.parameters()
            )
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
        mean = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(mean)
        loss_diffs.append(abs(mean.item() / dist.get_world_size() - ref_loss.item()))
    out["loss_diffs"] = loss_diffs
    out["param_diff"] = max_param_diff(model, ref)

    # --- state dicts -----------------------------------------------------------
    full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    trained = _full_params(model)
    out["full_sd_matches"] = sorted(full_sd) == sorted(trained) and all(
        not isinstance(v, DTensor) and torch.equal(v, trained[k]) for k, v in full_sd.items()
    )
    # a full (plain tensor) state dict loads into a fresh TP + FSDP model
    fresh = _build(mesh, seed=1)
    fresh.load_state_dict(ref.state_dict())
    out["full_load_diff"] = max(
        (v - ref_params[k].detach()).abs().max().item() for k, v in _full_params(fresh).items()
    )
    # so does a TP-only one (DTensors on the tp mesh, saved before fully_shard)
    tp_only = apply_tensor_parallel(copy.deepcopy(ref), mesh["tp"])
    fresh = _build(mesh, seed=1)
    fresh.load_state_dict(tp_only.state_dict())
    out["tp_only_load_diff"] = max(
        (v - ref_params[k].detach()).abs().max().item() for k, v in _full_params(fresh).items()
    )

    # DCP round trip: save, load into a differently initialised model, continue
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    loaded = _build(mesh, seed=2)
    loaded_opt = torch.optim.AdamW(loaded.parameters(), lr=LR)
    msd, osd = get_state_dict(loaded, loaded_opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(loaded, loaded_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    saved, restored = _full_params(model), _full_params(loaded)
    out["dcp_param_diff"] = max((saved[k] - restored[k]).abs().max().item() for k in saved)
    out["dcp_losses"] = [
        (_step(model, opt, step, dp_rank), _step(loaded, loaded_opt, step, dp_rank))
        for step in range(4, 6)
    ]

    # the TP + FSDP checkpoint holds the true global tensors: it loads into a
    # model sharded over all 4 ranks without TP
    torch.manual_seed(3)
    plain = GPT(cfg)
    for blk in plain.blocks:
        fully_shard(blk)
    fully_shard(plain)
    psd = get_model_state_dict(plain)
    dcp.load({"model": psd}, checkpoint_id=path)
    plain.load_state_dict(psd)
    out["cross_layout_diff"] = max(
        (v - saved[k]).abs().max().item() for k, v in _full_params(plain).items()
    )
    return out


def test_tp_fsdp_2x2(tmp_path: Path) -> None:
    results = run_distributed(_tp_fsdp_job, DP * TP, str(tmp_path / "ckpt"), timeout=300)
    for rank, r in enumerate(results):
        assert r["layout_errors"] == [], (rank, r["layout_errors"])
        assert r["sd_keys_equal"], r
        assert r["unsharded"] and r["resharded"]
        assert max(r["loss_diffs"]) <= LOSS_TOL, r["loss_diffs"]
        assert r["grad_diff"] <= GRAD_TOL, r["grad_diff"]
        assert r["grad_placements_match"], r
        assert r["param_diff"][0] <= PARAM_TOL, r["param_diff"]
        assert r["full_sd_matches"], r
        assert r["full_load_diff"] == 0.0
        assert r["tp_only_load_diff"] == 0.0
        assert r["dcp_param_diff"] == 0.0
        for a, b in r["dcp_losses"]:
            assert a == b, r["dcp_losses"]
        assert r["cross_layout_diff"] == 0.0
    print(
        "TP+FSDP 2x2 parity: loss", max(results[0]["loss_diffs"]), "grad", results[0]["grad_diff"],
        "param", results[0]["param_diff"],
    )


class _SPNet(nn.Module):
    """norm -> fc -> relu -> out, for sequence parallel: the norm's replicated
    parameters get Partial gradients over tp."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 6)  # TP-local 3 rows: uneven (2 + 1) over dp
        self.out = nn.Linear(6, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc(self.norm(x))))


def _sequence_parallel_and_errors_job() -> dict:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    rank = dist.get_rank()
    dp_rank, tp_rank = divmod(rank, TP)
    mesh = _mesh()
    out: dict = {}

    # sequence parallel: each tp rank holds half of the sequence (dim 1)
    torch.manual_seed(0)
    ref = _SPNet()
    with torch.no_grad():  # non-trivial norm parameters
        ref.norm.weight.normal_()
        ref.norm.bias.normal_()
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh["tp"], {
        "norm": SequenceParallel(),
        "fc": ColwiseParallel(input_layouts=Shard(1)),
        "out": RowwiseParallel(output_layouts=Shard(1)),
    })
    # float64 compute, float32 reduction: gradient accumulation without sync
    # keeps (TP-local, upcast) gradients between micro-batches
    mp = MixedPrecisionPolicy(param_dtype=torch.float64, reduce_dtype=torch.float32)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
    for micro in range(2):
        model.set_requires_gradient_sync(micro == 1)
        x = torch.randn(2 * DP, 4 * TP, 8)
        local_x = x[2 * dp_rank : 2 * dp_rank + 2].chunk(TP, dim=1)[tp_rank]
        # this rank's part of the global mean (FSDP averages over dp; tp ranks add up)
        model(local_x).pow(2).sum().mul(DP / x.numel()).backward()
        ref(x).pow(2).sum().div(x.numel()).backward()
    out["sp_grad_diff"] = max_grad_diff(model, ref)
    out["sp_placements"] = {n: tuple(p.placements) for n, p in model.named_parameters()}

    def message(fn) -> str:
        try:
            fn()
        except (NotImplementedError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    torch.manual_seed(0)
    # the whole (dp, tp) mesh instead of its dp sub-mesh
    gpt = apply_tensor_parallel(GPT(GPTConfig(**CFG)), mesh["tp"])
    out["whole_mesh"] = message(lambda: fully_shard(gpt.blocks[0], mesh=mesh))
    # a dp mesh that is not a sibling of the TP mesh
    other = init_device_mesh("cpu", (DP * TP,), mesh_dim_names=("world",))
    out["unrelated_mesh"] = message(lambda: fully_shard(gpt.blocks[1], mesh=other))
    return out


def test_sequence_parallel_and_errors() -> None:
    results = run_distributed(_sequence_parallel_and_errors_job, DP * TP)
    for r in results:
        assert r["sp_grad_diff"] <= GRAD_TOL, r["sp_grad_diff"]
    placements = results[0]["sp_placements"]
    assert placements["norm.weight"] == (Shard(0), Replicate()), placements
    assert placements["fc.weight"] == (_compat.strided_shard(0, TP), Shard(0)), placements
    r = results[0]
    assert 'mesh["dp"]' in r["whole_mesh"], r["whole_mesh"]
    assert "sub-meshes of one device mesh" in r["unrelated_mesh"], r["unrelated_mesh"]


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q", "-s"])
