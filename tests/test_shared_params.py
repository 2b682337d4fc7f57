"""Parameters shared across units ([Note: shared parameters]).

A tied embedding and LM head annotated as separate units, and one weight shared by
blocks in different units (ALBERT-style), train at parity with one process on the
global batch; the shared parameter is sharded once, gathered once per forward and
per backward, and reduced once per step. Cases are grouped into one job per world
size to keep the suite fast.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from gpt import GPT, GPTConfig, loss_fn, make_batch
from helpers import (
    collective_log,
    local_slice,
    max_grad_diff,
    max_param_diff,
    mean_across_ranks,
    rank_world,
)
from models import TINY_GPT, SharedWeightBlocks
from torch import nn

from fsdp_compose import FSDPModule, fully_shard

TINY = {**TINY_GPT, "tie_weights": True}
LOSS_TOL = 1e-5
GRAD_TOL = 1e-6
PARAM_TOL = 1e-4  # AdamW after a few steps; see test_parity.PARAM_TOL


def build(kind: str, *, seed: int = 0, **kwargs: Any) -> tuple[nn.Module, nn.Module]:
    """(reference, sharded copy): ``gpt`` annotates the tied ``tok_emb`` and
    ``lm_head`` as units of their own; ``albert`` one unit per block."""
    torch.manual_seed(seed)
    ref: nn.Module = GPT(GPTConfig(**TINY)) if kind == "gpt" else SharedWeightBlocks()
    model = copy.deepcopy(ref)
    shard(model, kind, **kwargs)
    return ref, model


def shard(model: nn.Module, kind: str, **kwargs: Any) -> None:
    root_kwargs = {k: v for k, v in kwargs.items() if k != "reshard_after_forward"}
    if kind == "gpt":
        fully_shard(model.tok_emb, **kwargs)
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model.lm_head, **kwargs)
    else:
        for block in model.blocks:
            fully_shard(block, **kwargs)
    fully_shard(model, **root_kwargs)


def tied(model: nn.Module, kind: str) -> bool:
    if kind == "gpt":
        return model.lm_head.weight is model.tok_emb.weight
    b = model.blocks
    return b[1].mix.weight is b[0].mix.weight and b[3].mix.weight is b[0].mix.weight


def owner_unit(model: nn.Module, kind: str) -> Any:
    owner = model.tok_emb if kind == "gpt" else model.blocks[0]
    return owner._fsdp_state().unit


def batch(kind: str, step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "gpt":
        return make_batch(GPTConfig(**TINY), n, step)
    gen = torch.Generator().manual_seed(step)
    return torch.randn(n, 6, generator=gen), torch.randn(n, generator=gen)


def loss_of(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return loss_fn(out, y) if kind == "gpt" else F.mse_loss(out, y)


def _parity_case(kind: str, raf: bool | int, steps: int = 2) -> dict:
    rank, world = rank_world()
    ref, model = build(kind, reshard_after_forward=raf)
    out: dict = {
        "tied": tied(model, kind),
        "n_params": (len(list(model.parameters())), len(list(ref.parameters()))),
        "keys_equal": list(model.state_dict()) == list(ref.state_dict()),
        "borrower_is_fsdp": isinstance(
            model.lm_head if kind == "gpt" else model.blocks[1], FSDPModule
        ),
    }
    unit = owner_unit(model, kind)
    between: list[str] = []
    if kind == "albert":  # block 2 runs between two uses of the shared weight
        model.blocks[2].register_forward_hook(lambda *_: between.append(unit.state.value))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    loss_diffs, after_forward = [], []
    with collective_log(model) as log:
        for step in range(steps):
            x, y = batch(kind, step, 2 * world)
            ref_loss = loss_of(kind, ref(x), y)
            ref_loss.backward()
            log.clear()
            loss = loss_of(kind, model(local_slice(x, rank, world)), local_slice(y, rank, world))
            after_forward.append(unit.state.value)
            loss.backward()
            if step == 0:
                out["grad_diff"] = max_grad_diff(model, ref)
            out["tied_after_backward"] = tied(model, kind)
            ref_opt.step()
            ref_opt.zero_grad()
            opt.step()
            opt.zero_grad()
            loss_diffs.append(abs(mean_across_ranks(loss.item()) - ref_loss.item()))
        out["counts"] = dict(log.counts())
    out.update(
        loss_diffs=loss_diffs,
        param_diff=max_param_diff(model, ref),
        after_forward=after_forward,
        after_backward=unit.state.value,
        between=between,
        owner=unit.name,
        tied_end=tied(model, kind),
    )
    return out


def _parity_job(cases: list[tuple[str, bool | int]]) -> list[dict]:
    return [_parity_case(kind, raf) for kind, raf in cases]


def _check_parity(r: dict, kind: str, raf: bool | int, world: int) -> None:
    what = (kind, raf, world)
    assert r["tied"] and r["tied_after_backward"] and r["tied_end"], what
    assert r["n_params"][0] == r["n_params"][1], (what, r["n_params"])
    assert r["keys_equal"] and r["borrower_is_fsdp"], what
    assert max(r["loss_diffs"]) <= LOSS_TOL, (what, r["loss_diffs"])
    assert r["grad_diff"] <= GRAD_TOL, (what, r["grad_diff"])
    assert r["param_diff"][0] <= PARAM_TOL, (what, r["param_diff"])
    # Freed after its last use of the forward, per reshard_after_forward, and
    # after backward; held between two uses (ALBERT: around block 2).
    expected_state = {True: "sharded", False: "unsharded"}.get(raf, "partially_sharded")  # type: ignore[call-overload]
    assert r["after_forward"] == [expected_state] * len(r["after_forward"]), (
        what,
        r["after_forward"],
    )
    assert r["after_backward"] == "sharded", what
    if kind == "albert":
        assert r["between"][1:] == ["unsharded"] * (len(r["between"]) - 1), (what, r["between"])
    # One gather per forward, one per backward unless kept, one reduction per step.
    counts, owner = r["counts"], r["owner"]
    assert counts[("all_gather", owner)] == (1 if raf is False else 2), (what, counts)
    assert counts[("reduce_scatter", owner)] == 1, (what, counts)
    if kind == "gpt":
        assert not any("lm_head" in label for _, label in counts), counts  # no unit of its own


PARITY_CASES = {
    2: [("gpt", True), ("gpt", False), ("albert", True), ("albert", False)],
    3: [("gpt", True), ("albert", False)],  # uneven rows: 97 and 16 over 3 ranks
    4: [("gpt", 2), ("albert", 2), ("gpt", False)],
}


@pytest.mark.parametrize("world_size", sorted(PARITY_CASES))
def test_shared_parity(world_size: int) -> None:
    from dist_utils import run_distributed

    cases = PARITY_CASES[world_size]
    for per_rank in run_distributed(_parity_job, world_size, cases, timeout=240):
        for (kind, raf), r in zip(cases, per_rank):
            _check_parity(r, kind, raf, world_size)


# ---------------------------------------------------------------------------
# composition: no-sync accumulation, CPU offload, activation checkpointing,
# explicit prefetch, generate, bf16, HSDP
# ---------------------------------------------------------------------------


def _train_and_compare(
    model: nn.Module, ref: nn.Module, kind: str, *, steps: int = 2, micro: int = 1
) -> dict:
    """Trains both (``micro`` micro-batches per step, syncing on the last one);
    returns the worst loss and parameter differences and reduce-scatters per
    micro-batch."""
    rank, world = rank_world()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    loss_diffs, rs = [], []
    for step in range(steps):
        for i in range(micro):
            x, y = batch(kind, 10 * step + i, 2 * world)
            ref_loss = loss_of(kind, ref(x), y) / micro
            ref_loss.backward()
            model.set_requires_gradient_sync(i == micro - 1)
            with collective_log(model) as log:
                loss = (
                    loss_of(kind, model(local_slice(x, rank, world)), local_slice(y, rank, world))
                    / micro
                )
                loss.backward()
            rs.append(log.kinds().get("reduce_scatter", 0))
            loss_diffs.append(abs(mean_across_ranks(loss.item()) - ref_loss.item()))
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    return {
        "loss": max(loss_diffs),
        "param": max_param_diff(model, ref)[0],
        "rs": rs,
        "tied": tied(model, kind),
    }


def _greedy(self: nn.Module, idx: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = self(idx)[:, -1]
            idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
    return idx


def _checkpointed(block: nn.Module) -> None:
    """Checkpoints ``block``'s call, its fully_shard hooks included."""
    from torch.utils.checkpoint import checkpoint

    inner = block.forward
    block.forward = lambda x: checkpoint(inner, x, use_reentrant=False)  # type: ignore[method-assign]


def _composition_job() -> dict:
    import types

    from fsdp_compose import CPUOffloadPolicy, register_fsdp_forward_method

    out: dict = {}
    # Gradient accumulation without sync: no reduce-scatter until the last micro-batch.
    for kind in ("gpt", "albert"):
        ref, model = build(kind)
        out[f"no_sync_{kind}"] = _train_and_compare(model, ref, kind, micro=2)
    # CPU offload (a no-op on a CPU mesh, but the policy must be accepted by every
    # unit sharing the parameter).
    ref, model = build("gpt", offload_policy=CPUOffloadPolicy())
    out["offload"] = _train_and_compare(model, ref, "gpt", steps=1)
    # Activation checkpointing around the borrowers (recomputed in backward, where
    # the owner must be gathered again for them).
    torch.manual_seed(0)
    ref = SharedWeightBlocks()
    model = copy.deepcopy(ref)
    for i in (1, 3):
        _checkpointed(model.blocks[i])
    shard(model, "albert")
    out["checkpoint"] = _train_and_compare(model, ref, "albert")
    # Explicit prefetch, to and from the LM head (a module without a unit of its own).
    ref, model = build("gpt")
    model.tok_emb.set_modules_to_forward_prefetch([model.blocks[0]])
    model.blocks[-1].set_modules_to_forward_prefetch([model.lm_head])
    model.lm_head.set_modules_to_backward_prefetch([model.blocks[-1]])
    out["prefetch"] = _train_and_compare(model, ref, "gpt")
    # generate: plain, and registered with register_fsdp_forward_method.
    prompt = torch.randint(
        0, TINY["vocab_size"], (2, 4), generator=torch.Generator().manual_seed(3)
    )
    expected = _greedy(ref, prompt, 5)
    out["generate"] = _greedy(model, prompt, 5).tolist() == expected.tolist()
    model.generate = types.MethodType(_greedy, model)  # type: ignore[assignment]
    register_fsdp_forward_method(model, "generate")
    with collective_log(model) as log:
        out["generate_registered"] = model.generate(prompt, 5).tolist() == expected.tolist()
    out["generate_gathers"] = log.counts()[("all_gather", "tok_emb")]
    # Two forwards, then one backward each (graphs kept alive): the second backward
    # finds its count exhausted, and still no gradient is lost or counted twice.
    for kind in ("gpt", "albert"):
        ref, model = build(kind)
        rank, world = rank_world()
        xs = [batch(kind, 20 + i, 2 * world) for i in range(2)]
        ref_losses = [loss_of(kind, ref(x), y) for x, y in xs]
        losses = [
            loss_of(kind, model(local_slice(x, rank, world)), local_slice(y, rank, world))
            for x, y in xs
        ]
        for ref_loss, loss in zip(ref_losses, losses):
            ref_loss.backward()
            loss.backward()
        out[f"two_graphs_{kind}"] = max_grad_diff(model, ref)
    out["errors"] = _errors()
    return out


def _errors() -> dict[str, str]:
    """What cannot be shared raises at fully_shard time, naming both modules."""
    import re

    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compose import MixedPrecisionPolicy

    def tied_pair() -> nn.Sequential:
        m = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
        m[1].weight = m[0].weight
        return m

    def expect(fn: Any, exc: type[Exception], pattern: str) -> str:
        try:
            fn()
        except exc as e:
            return "ok" if re.search(pattern, str(e)) else f"wrong message: {e}"
        return "no error"

    def ignored() -> None:
        m = tied_pair()
        fully_shard(m[0])
        fully_shard(m, ignored_params={m[1].weight})

    def other_mesh() -> None:
        m = tied_pair()
        fully_shard(m[0])
        fully_shard(m, mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard")))

    def other_reduce_dtype() -> None:
        m = tied_pair()
        fully_shard(m[0])
        fully_shard(m[1], mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float64))

    def after_forward() -> None:
        m = tied_pair()
        fully_shard(m[0])
        m[0](torch.arange(3))  # the embedding's unit becomes a root and runs
        fully_shard(m)

    def other_tree() -> None:
        m = tied_pair()
        fully_shard(m[0])
        fully_shard(m[1])
        m[1](torch.randn(2, 4))  # lm-head-like module as its own root: owner not under it

    both = r"Linear\.weight .*Embedding\.weight"
    return {
        "ignored": expect(ignored, ValueError, both + r".*ignored_params"),
        "mesh": expect(other_mesh, ValueError, both + r".*differ in mesh"),
        "reduce_dtype": expect(other_reduce_dtype, ValueError, both + r".*reduce_dtype"),
        "after_forward": expect(after_forward, ValueError, both + r".*already ran forward"),
        "other_tree": expect(
            other_tree, RuntimeError, r"'(FSDP)?Linear' shares a parameter with unit 'Embedding'"
        ),
    }


def test_shared_composition() -> None:
    from dist_utils import run_distributed

    for r in run_distributed(_composition_job, 2, timeout=240):
        for key in ("no_sync_gpt", "no_sync_albert", "offload", "checkpoint", "prefetch"):
            assert r[key]["loss"] <= LOSS_TOL, (key, r[key])
            assert r[key]["param"] <= PARAM_TOL, (key, r[key])
            assert r[key]["tied"], key
        for key in ("no_sync_gpt", "no_sync_albert"):  # no reduction without sync
            assert r[key]["rs"][0::2] == [0, 0] and min(r[key]["rs"][1::2]) > 0, (key, r[key]["rs"])
        assert r["generate"] and r["generate_registered"]
        # Gathered once per token's forward (tok_emb and lm_head share one gather).
        assert r["generate_gathers"] == 5, r["generate_gathers"]
        assert all(v == "ok" for v in r["errors"].values()), r["errors"]
        assert r["two_graphs_gpt"] <= GRAD_TOL and r["two_graphs_albert"] <= GRAD_TOL, r


def _bf16_hsdp_job() -> dict:
    """bf16: identical to the manual workaround fully_shard([tok_emb, lm_head]) with
    the same policy; HSDP (2 x 2): parity in float32."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compose import MixedPrecisionPolicy

    rank, world = rank_world()
    out: dict = {}
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _, model = build("gpt", mp_policy=mp)
    torch.manual_seed(0)
    workaround = GPT(GPTConfig(**TINY))
    fully_shard([workaround.tok_emb, workaround.lm_head], mp_policy=mp)
    for block in workaround.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(workaround, mp_policy=mp)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, workaround)]
    diffs = []
    for step in range(2):
        x, y = batch("gpt", step, 2 * world)
        losses = []
        for m, opt in zip((model, workaround), opts):
            loss = loss_fn(m(local_slice(x, rank, world)), local_slice(y, rank, world))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        diffs.append(abs(losses[0] - losses[1]))
    out["bf16_loss_diff"] = max(diffs)
    out["bf16_param_diff"] = max(
        (a.full_tensor() - b.full_tensor()).abs().max().item()
        for a, b in zip(model.parameters(), workaround.parameters())
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for kind in ("gpt", "albert"):
        ref, model = build(kind, mesh=mesh)
        out[f"hsdp_{kind}"] = _train_and_compare(model, ref, kind)
    return out


def test_shared_bf16_and_hsdp() -> None:
    from dist_utils import run_distributed

    for r in run_distributed(_bf16_hsdp_job, 4, timeout=240):
        assert r["bf16_loss_diff"] <= 1e-6 and r["bf16_param_diff"] <= 1e-6, r
        for kind in ("gpt", "albert"):
            assert r[f"hsdp_{kind}"]["loss"] <= LOSS_TOL, r
            assert r[f"hsdp_{kind}"]["param"] <= PARAM_TOL, r
            assert r[f"hsdp_{kind}"]["tied"]


# ---------------------------------------------------------------------------
# checkpoints: DCP at another world size, full state dict export
# ---------------------------------------------------------------------------

CKPT_BATCH = 8  # global batch, divisible by 2 and 4


def _ckpt_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> float:
    rank, world = rank_world()
    x, y = batch("gpt", step, CKPT_BATCH)
    loss = loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return mean_across_ranks(loss.item())


def _dcp_save_job(path: str, export_path: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from test_checkpoint import _full_state
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    _, model = build("gpt")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        _ckpt_step(model, optim, step)
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    out: dict = {"saved": _full_state(model, optim)}

    # Full state dict export: the unwrapped model's keys; loads strictly into it.
    full_sd = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    x, _ = batch("gpt", 100, 4)
    with torch.no_grad():
        sharded_logits = model(x)
    if dist.get_rank() == 0:
        plain = GPT(GPTConfig(**TINY))
        out["export_keys"] = list(full_sd) == list(plain.state_dict())
        torch.save(full_sd, export_path)
        plain.load_state_dict(torch.load(export_path, weights_only=True))
        out["export_tied"] = plain.lm_head.weight is plain.tok_emb.weight
        with torch.no_grad():
            out["export_logits_diff"] = (plain(x) - sharded_logits).abs().max().item()
    out["losses_after"] = [_ckpt_step(model, optim, step) for step in range(2, 4)]
    return out


def _dcp_load_job(path: str, saved: dict[str, torch.Tensor]) -> dict:
    import torch.distributed.checkpoint as dcp
    from test_checkpoint import _full_state
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    with torch.device("meta"):
        model = GPT(GPTConfig(**TINY))
    shard(model, "gpt")
    model.to_empty(device="cpu")
    out: dict = {"tied_after_to_empty": tied(model, "gpt")}
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _full_state(model, optim)
    out["keys_equal"] = sorted(loaded) == sorted(saved)
    out["max_state_diff"] = max(
        (loaded[k] - saved[k]).abs().max().item() for k in saved if k in loaded
    )
    out["losses_after"] = [_ckpt_step(model, optim, step) for step in range(2, 4)]
    out["tied"] = tied(model, "gpt")
    return out


def test_shared_checkpoint_reshard_and_export(tmp_path: Any) -> None:
    from dist_utils import run_distributed

    path, export = str(tmp_path / "ckpt"), str(tmp_path / "full.pt")
    source = run_distributed(_dcp_save_job, 2, path, export, timeout=240)
    assert source[0]["export_keys"] and source[0]["export_tied"], source[0]
    assert source[0]["export_logits_diff"] == 0.0, source[0]["export_logits_diff"]
    saved = source[0]["saved"]
    for r in run_distributed(_dcp_load_job, 4, path, saved, timeout=240):
        assert r["tied_after_to_empty"] and r["tied"]
        assert r["keys_equal"] and r["max_state_diff"] == 0.0, r
        for got, want in zip(r["losses_after"], source[0]["losses_after"]):
            assert abs(got - want) <= LOSS_TOL, (r["losses_after"], source[0]["losses_after"])


# ---------------------------------------------------------------------------
# transformers: Llama with tie_word_embeddings, embed_tokens and lm_head as units
# ---------------------------------------------------------------------------


def _llama_tied_job(steps: int = 2) -> dict:
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from helpers import full
    from train_hf import make_batch as hf_batch
    from transformers import LlamaConfig, LlamaForCausalLM

    rank, world = rank_world()
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    ref = LlamaForCausalLM(config).train()
    model = copy.deepcopy(ref)
    fully_shard(model.model.embed_tokens)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model.lm_head)
    fully_shard(model)
    out: dict = {"tied": model.lm_head.weight is model.model.embed_tokens.weight}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_params = dict(ref.named_parameters())
    loss_diffs, local = [], 2
    with collective_log(model) as log:
        for step in range(steps):
            data = hf_batch(local * world, step)
            ref_loss = ref(**data, use_cache=False).loss
            ref_loss.backward()
            mine = {k: v[rank * local : (rank + 1) * local] for k, v in data.items()}
            log.clear()
            loss = model(**mine, use_cache=False).loss
            loss.backward()
            if step == 0:
                out["grad_diff"] = max(
                    (full(p.grad) - ref_params[n].grad).abs().max().item()
                    for n, p in model.named_parameters()
                )
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
            loss_diffs.append(abs(mean_across_ranks(loss.item()) - ref_loss.item()))
        out["counts"] = dict(log.counts())
    out["loss_diffs"] = loss_diffs
    out["param_diff"] = max(
        (full(p.detach()) - ref_params[n].detach()).abs().max().item()
        for n, p in model.named_parameters()
    )
    out["keys_equal"] = list(model.state_dict()) == list(ref.state_dict())
    prompt = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    kwargs = {
        "attention_mask": torch.ones_like(prompt),
        "max_new_tokens": 4,
        "do_sample": False,
        "pad_token_id": 0,
    }
    model.eval()
    ref.eval()
    out["generate_same"] = (
        model.generate(prompt, **kwargs).tolist() == ref.generate(prompt, **kwargs).tolist()
    )
    return out


def test_shared_transformers_llama_tied() -> None:
    pytest.importorskip("transformers")
    from dist_utils import run_distributed

    for r in run_distributed(_llama_tied_job, 2, timeout=240):
        assert r["tied"] and r["keys_equal"]
        assert max(r["loss_diffs"]) <= LOSS_TOL, r["loss_diffs"]
        assert r["grad_diff"] <= GRAD_TOL, r["grad_diff"]
        assert r["param_diff"] <= PARAM_TOL, r["param_diff"]
        # embed_tokens owns the tied weight: one gather per forward and backward,
        # one reduction per step; lm_head has no unit of its own.
        assert r["counts"][("all_gather", "model.embed_tokens")] == 2, r["counts"]
        assert r["counts"][("reduce_scatter", "model.embed_tokens")] == 1, r["counts"]
        assert r["generate_same"], r


def _ignored_in_earlier_unit_job() -> dict:
    """A tied weight in the ignored_params of the unit that meets it first."""

    def tied_pair() -> nn.Sequential:
        m = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
        m[1].weight = m[0].weight
        return m

    out: dict = {}
    for later in ("root", "sibling"):
        m = tied_pair()
        w = m[0].weight
        fully_shard(m[0], ignored_params={w})
        try:
            fully_shard(m if later == "root" else m[1])
            out[later] = "no error"
        except ValueError as exc:
            out[later] = str(exc)
        # refused before anything changed: still one plain parameter
        out[f"{later}_untouched"] = m[1].weight is w and type(w) is nn.Parameter
    # Ignored in every call that meets it: one plain, tied parameter that trains.
    m = tied_pair()
    w = m[0].weight
    fully_shard(m[0], ignored_params={w})
    fully_shard(m, ignored_params={w})
    m(torch.arange(3)).sum().backward()
    out["ignored_in_both"] = m[1].weight is m[0].weight is w and w.grad is not None
    return out


def test_tied_weight_ignored_by_an_earlier_unit_is_refused() -> None:
    """Sharding a tied weight that an earlier unit left unsharded (ignored_params)
    would untie it: the later call raises, naming both calls and both fixes,
    and changes nothing. Ignoring it in every call keeps it tied."""
    from dist_utils import run_distributed

    for r in run_distributed(_ignored_in_earlier_unit_job, 2):
        for later, target in (("root", "Sequential"), ("sibling", "Linear")):
            message = r[later]
            assert "ignored_params of fully_shard(Embedding)" in message, message
            assert f"fully_shard({target}) finds it again" in message, message
            assert "Pass it in ignored_params here too" in message, message
            assert "remove it from the ignored_params of fully_shard(Embedding)" in message
            assert r[f"{later}_untouched"], r
        assert r["ignored_in_both"], r
