"""A forgotten ``fully_shard(model)`` on the root: with only the blocks annotated,
the root's plain parameters would train on each rank's own gradients and drift
apart. The first ``optimizer.step()`` raises instead, before anything changes,
naming them (see [Note: plain parameters next to sharded ones])."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from gpt import GPT, GPTConfig, loss_fn, make_batch
from helpers import local_slice, rank_world
from torch.distributed.device_mesh import init_device_mesh

from fsdp_compose import fully_shard

TINY = GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _step(model: torch.nn.Module, opts: list[torch.optim.Optimizer], step: int = 0) -> None:
    rank, world = rank_world()
    x, y = make_batch(TINY, 2 * world, step)
    loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()


def _blocks_only(mesh=None) -> GPT:
    torch.manual_seed(0)
    model = GPT(TINY)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return model


def _missing_root_job() -> dict:
    out: dict = {}
    # 1. The mistake: blocks annotated, root forgotten, one optimizer.
    model = _blocks_only()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = model.tok_emb.weight.detach().clone()
    try:
        _step(model, [opt])
        out["error"] = None
    except RuntimeError as exc:
        out["error"] = str(exc)
    out["root_param_unchanged"] = torch.equal(before, model.tok_emb.weight)

    # 2. Fixed: the root annotated too.
    model = _blocks_only()
    fully_shard(model)
    _step(model, [torch.optim.AdamW(model.parameters(), lr=1e-2)])

    # 3. Deliberate: plain parameters in an optimizer of their own (the user
    # reduces their gradients), or left out of sharding with ignored_params.
    model = _blocks_only()
    sharded = [p for p in model.parameters() if hasattr(p, "device_mesh")]
    plain = [p for p in model.parameters() if not hasattr(p, "device_mesh")]
    _step(model, [torch.optim.SGD(sharded, lr=1e-2), torch.optim.SGD(plain, lr=1e-2)])
    model = _blocks_only()
    fully_shard(model, ignored_params={model.lm_head.weight})
    _step(model, [torch.optim.SGD(model.parameters(), lr=1e-2)])

    # 4. Frozen plain parameters never drift.
    model = _blocks_only()
    for p in model.parameters():
        if not hasattr(p, "device_mesh"):
            p.requires_grad_(False)
    _step(model, [torch.optim.SGD(model.parameters(), lr=1e-2)])

    # 5. A data-parallel size of one: nothing to average, nothing to drift.
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("other", "dp"))
    model = _blocks_only(mesh["dp"])
    _step(model, [torch.optim.SGD(model.parameters(), lr=1e-2)])
    return out


def test_forgotten_root_raises_at_first_step() -> None:
    results = run_distributed(_missing_root_job, 2)
    for out in results:
        message = out["error"]
        assert message is not None, "a forgotten root must not train silently"
        for name in ("'tok_emb.weight'", "'pos_emb.weight'", "'ln_f.weight'", "'lm_head.weight'"):
            assert name in message
        assert "fully_shard(model)" in message and "GPT model" in message
        assert "ignored_params" in message and "optimizer of their own" in message
        assert out["root_param_unchanged"]


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
