"""Round trip with Hugging Face ``transformers`` through safetensors.

``save_pretrained`` of a randomly initialised ``LlamaForCausalLM`` / GPT-2 (built
from a config, no download) -> ``load_safetensors`` into the fsdp_compose-sharded
model built on the meta device, at W = 2 and 4 -> the logits of transformers' own
``from_pretrained`` model; 5 training steps -> ``save_safetensors`` ->
``from_pretrained`` -> the logits of the sharded model.
"""

from __future__ import annotations

import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

LOGITS_TOL = 1e-5


def _roundtrip_job(arch: str, tmp: str) -> dict:
    import torch
    import torch.distributed as dist
    from train_hf import apply_fsdp, build_model, make_batch
    from transformers import AutoModelForCausalLM

    from fsdp_compose.safetensors_io import load_safetensors, save_safetensors

    rank, world = dist.get_rank(), dist.get_world_size()
    src, dst = os.path.join(tmp, "pretrained"), os.path.join(tmp, "exported")
    if rank == 0:
        torch.manual_seed(0)
        build_model(arch).save_pretrained(src)
    dist.barrier()
    reference = AutoModelForCausalLM.from_pretrained(src).eval()

    with torch.device("meta"):
        model = build_model(arch)
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is not None:  # non-persistent buffers are not in a checkpoint: rebuild them
        model.model.rotary_emb = type(rotary)(config=model.config)
    apply_fsdp(model)
    result = load_safetensors(model, src)
    batch = make_batch(4, 0)
    with torch.no_grad():
        loaded = (model(**batch, use_cache=False).logits - reference(**batch, use_cache=False).logits)
    out = {"load_diff": loaded.abs().max().item(), "loaded": len(result.loaded)}
    if arch == "gpt2":
        out["tied"] = model.lm_head.weight is model.transformer.wte.weight

    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    local = 2
    for step in range(5):
        full = make_batch(local * world, step + 1)
        mine = {k: v[rank * local : (rank + 1) * local] for k, v in full.items()}
        model(**mine, use_cache=False).loss.backward()
        optim.step()
        optim.zero_grad()
    with torch.no_grad():
        trained = model(**batch, use_cache=False).logits
    save_safetensors(model, dst, max_shard_size="100KB")
    if rank == 0:
        model.config.save_pretrained(dst)
    dist.barrier()
    exported = AutoModelForCausalLM.from_pretrained(dst).eval()
    with torch.no_grad():
        out["export_diff"] = (exported(**batch, use_cache=False).logits - trained).abs().max().item()
    out["trained_moved"] = (trained - reference(**batch, use_cache=False).logits).abs().max().item()
    out["files"] = sorted(os.listdir(dst))
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_transformers_round_trip(tmp_path, arch: str, world: int) -> None:
    from dist_utils import run_distributed

    for r in run_distributed(_roundtrip_job, world, arch, str(tmp_path), timeout=300):
        assert r["load_diff"] <= LOGITS_TOL, r
        assert r["export_diff"] <= LOGITS_TOL, r
        assert r["trained_moved"] > 1e-3, "training should have changed the model"
        assert "model.safetensors.index.json" in r["files"], r["files"]
        assert not any(f.endswith(".tmp") for f in r["files"]), r["files"]
        if arch == "gpt2":
            assert r["tied"]
