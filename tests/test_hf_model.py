"""A real client: Hugging Face ``transformers`` causal LMs built from small configs
(no download), each decoder layer and the model annotated, on 2 ranks.

Parity with one process on the global batch (Llama; GPT-2 with tied embeddings;
Llama with transformers' own gradient checkpointing), keyword arguments (attention
mask, labels, cache objects) through the hooks, a weight tied across units, and
``generate``.
"""

from __future__ import annotations

import copy
import os

import pytest
from helpers import collective_log, full, mean_across_ranks, rank_world

# Before transformers is imported (also in the rank processes, which import this
# module to unpickle the jobs): build from configs only, and keep the log quiet.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
pytest.importorskip("transformers")

LOSS_TOL, GRAD_TOL, PARAM_TOL = 1e-5, 1e-6, 1e-4  # as in test_parity.py


def _hf_parity_job(arch: str, gradient_checkpointing: bool, steps: int = 3) -> dict:
    import torch
    from train_hf import apply_fsdp, build_model, decoder_layers, make_batch

    rank, world = rank_world()
    torch.manual_seed(0)
    ref = build_model(arch).train()
    model = copy.deepcopy(ref)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_fsdp(model)
    layers = decoder_layers(model)
    mlp_calls = [0]
    layers[0].mlp.register_forward_pre_hook(lambda *_: mlp_calls.__setitem__(0, mlp_calls[0] + 1))

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_params = dict(ref.named_parameters())
    loss_diffs, counts, calls = [], [], []
    grad_diff = 0.0
    local = 2
    for step in range(steps):
        batch = make_batch(local * world, step)
        ref_loss = ref(**batch, use_cache=False).loss
        ref_loss.backward()
        mine = {k: v[rank * local : (rank + 1) * local] for k, v in batch.items()}
        mlp_calls[0] = 0
        with collective_log(model) as log:
            loss = model(**mine, use_cache=False).loss
            loss.backward()
        counts.append(dict(log.counts()))
        calls.append(mlp_calls[0])
        if step == 0:
            grad_diff = max((full(p.grad) - ref_params[n].grad).abs().max().item()
                            for n, p in model.named_parameters())
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_diffs.append(abs(mean_across_ranks(loss.item()) - ref_loss.item()))
    param_diff = max((full(p.detach()) - ref_params[n].detach()).abs().max().item()
                     for n, p in model.named_parameters())
    return {
        "loss_diffs": loss_diffs, "grad_diff": grad_diff, "param_diff": param_diff,
        "counts": counts, "mlp_calls": calls,
        "layer_units": [layer._fsdp_state().unit.name for layer in layers],
        "tied": arch == "gpt2" and model.lm_head.weight is model.transformer.wte.weight,
    }


@pytest.mark.parametrize(
    "arch, gradient_checkpointing",
    [("llama", False), ("gpt2", False), ("llama", True)],
    ids=["llama", "gpt2-tied", "llama-grad-ckpt"],
)
def test_hf_causal_lm_parity(arch: str, gradient_checkpointing: bool) -> None:
    from dist_utils import run_distributed

    results = run_distributed(_hf_parity_job, 2, arch, gradient_checkpointing, timeout=240)
    for r in results:
        assert max(r["loss_diffs"]) <= LOSS_TOL, r["loss_diffs"]
        assert r["grad_diff"] <= GRAD_TOL, r["grad_diff"]
        assert r["param_diff"] <= PARAM_TOL, r["param_diff"]
        # Checkpointed layers run their MLP again in backward.
        assert r["mlp_calls"] == [2 if gradient_checkpointing else 1] * len(r["mlp_calls"])
        if arch == "gpt2":
            assert r["tied"], "the tied LM head / embedding must stay one parameter"
        for counts in r["counts"]:
            for unit in r["layer_units"]:
                assert counts[("all_gather", unit)] == 2, counts
                assert counts[("reduce_scatter", unit)] == 1, counts
            assert counts[("all_gather", "root")] == 1, counts  # the root keeps its params
            assert counts[("reduce_scatter", "root")] == 1, counts


def _tied_across_units_job() -> dict:
    import torch
    from train_hf import build_model, make_batch

    from fsdp_compose import fully_shard

    rank, world = rank_world()
    torch.manual_seed(0)
    ref = build_model("gpt2")
    model = copy.deepcopy(ref)
    fully_shard(model.transformer.wte)  # the LM head, left to the root, shares this weight
    fully_shard(model)
    batch = make_batch(2 * world, 0)
    ref_loss = ref(**batch, use_cache=False).loss
    mine = {k: v[rank * 2 : (rank + 1) * 2] for k, v in batch.items()}
    loss = model(**mine, use_cache=False).loss
    loss.backward()
    ref_loss.backward()
    grad = full(model.lm_head.weight.grad)
    return {
        "tied": model.lm_head.weight is model.transformer.wte.weight,
        "loss_diff": abs(mean_across_ranks(loss.item()) - ref_loss.item()),
        "grad_diff": (grad - ref.lm_head.weight.grad).abs().max().item(),
    }


def test_hf_tied_embedding_across_units_is_shared() -> None:
    """The embedding as its own unit, the LM head in the root's: the tied weight is
    shared ([Note: shared parameters]); the full parity matrix is in
    test_shared_params.py."""
    from dist_utils import run_distributed

    for r in run_distributed(_tied_across_units_job, 2):
        assert r["tied"], r
        assert r["loss_diff"] <= LOSS_TOL and r["grad_diff"] <= GRAD_TOL, r


def _generate_job(register: bool) -> dict:
    import torch
    from train_hf import apply_fsdp, build_model

    from fsdp_compose import register_fsdp_forward_method

    torch.manual_seed(0)
    ref = build_model("llama").eval()
    model = copy.deepcopy(ref)
    apply_fsdp(model)
    if register:
        register_fsdp_forward_method(model, "generate")
    prompt = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False, pad_token_id=0)
    expected = ref.generate(prompt, **kwargs)
    try:
        with collective_log(model) as log:
            out = model.generate(prompt, **kwargs)  # a DynamicCache goes through the hooks
    except RuntimeError as exc:  # reported to the test (keeps the rank pool healthy)
        return {"error": str(exc)}
    return {"same": out.tolist() == expected.tolist(), "all_gathers": log.kinds()["all_gather"]}


def test_hf_generate() -> None:
    """generate() runs forward once per new token: each forward gathers and frees
    every layer unit (no grad; the root keeps its parameters, as in FSDP2), and the
    tokens are those of the unsharded model."""
    from dist_utils import run_distributed

    for r in run_distributed(_generate_job, 2, False):
        assert "error" not in r, r
        assert r["same"], r
        assert r["all_gathers"] == 1 + 4 * 2  # the root keeps its params (no_grad too); 2 layers x 4 forwards


def test_hf_generate_registered_forward_method() -> None:
    from dist_utils import run_distributed

    for r in run_distributed(_generate_job, 2, True):
        assert "error" not in r, r
        assert r["same"], r
        assert r["all_gathers"] == 1 + 4 * 2  # the root once for the whole generate
