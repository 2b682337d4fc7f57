"""bitsandbytes QLoRA: frozen ``Linear4bit`` base layers (``Params4bit`` packed
NF4 weights, ``quant_storage`` a float dtype as Hugging Face/accelerate set it
for FSDP) plus trainable LoRA adapters, under fsdp_compose and torch's FSDP2 in
the same job, against one process on the whole batch.

``Params4bit`` is an ``nn.Parameter`` subclass without FSDP2's all-gather
extension; its quantization state (``quant_state``: absmax, blocksize,
quant_type, shape, dtype) is an instance attribute. FSDP2 drops it from the
sharded parameter, so ``state_dict()``, DCP checkpoints and full-state-dict
exports lose the entries bitsandbytes writes for it (the tests record that);
fsdp_compose carries it (see [Note: parameter-subclass attributes])."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import run_distributed
from helpers import rank_world, train_side_by_side
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdp_compose import fully_shard

pytest.importorskip("bitsandbytes")

_QUANT_KEYS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
_STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "uint8": torch.uint8}


class LoRALinear(nn.Module):
    """A frozen 4-bit base layer plus a trainable low-rank adapter (PEFT's shape)."""

    def __init__(self, dim: int, rank: int, storage: torch.dtype) -> None:
        import bitsandbytes as bnb

        super().__init__()
        self.base = bnb.nn.Linear4bit(
            dim, dim, bias=False, compute_dtype=torch.float32, quant_type="nf4",
            quant_storage=storage,
        )  # fmt: skip
        self.lora_a = nn.Linear(dim, rank, bias=False)
        self.lora_b = nn.Linear(rank, dim, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)  # PEFT zeros it; nonzero tests more

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


def _model(storage: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(
        LoRALinear(64, 4, _STORAGE[storage]), nn.ReLU(), LoRALinear(64, 4, _STORAGE[storage])
    )
    return model.to("cpu")  # bitsandbytes quantizes on the first move to a device


def _bases(model: nn.Module) -> list[nn.Module]:
    return [model[0].base, model[2].base]


def _shard(model: nn.Module, which: str) -> nn.Module:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    shard = {"torch": torch_fully_shard, "ours": fully_shard}[which]
    for layer in (model[0], model[2]):
        shard(layer.base)  # its own unit: FSDP2 wants one dtype per unit (bf16 storage)
        shard(layer)
    shard(model)
    return model


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes (packed nibbles in bf16 storage can be NaN patterns)."""
    return t.detach().contiguous().view(torch.uint8)


def _quant_state_summary(qs: Any) -> tuple[Any, ...]:
    return (qs.blocksize, qs.quant_type, tuple(qs.shape), qs.dtype, _bits(qs.absmax).tolist())


def _train_job(which: str, storage: str) -> dict[str, Any]:
    """Trains the adapters 3 steps; records, for each base layer, whether the
    sharded parameter and the unsharded one seen in forward carry the quant
    state, and whether the gathered packed bytes equal the original's."""
    world = rank_world()[1]
    ref, model = _model(storage), _shard(_model(storage), which)
    seen: list[tuple[bool, bool]] = []
    for base, ref_base in zip(_bases(model), _bases(ref)):

        def record(module: nn.Module, args: Any, ref_base: nn.Module = ref_base) -> None:
            weight = module.weight
            same = torch.equal(_bits(weight), _bits(ref_base.weight))
            seen.append((getattr(weight, "quant_state", None) is not None, same))

        base.register_forward_pre_hook(record)
    carried = [
        _quant_state_summary(b.weight.quant_state) == _quant_state_summary(r.weight.quant_state)
        if getattr(b.weight, "quant_state", None) is not None
        else None
        for b, r in zip(_bases(model), _bases(ref))
    ]
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(4 * world, 64, generator=gen), torch.randn(4 * world, 64, generator=gen))
        for _ in range(3)
    ]
    result = train_side_by_side(
        model, ref, 3, lambda step: batches[step], nn.functional.mse_loss, lr=1e-2,
        params=lambda m: [p for p in m.parameters() if p.requires_grad],
    )  # fmt: skip
    keys = sorted(model.state_dict().keys())
    return {
        **result,
        "seen": seen,
        "carried": carried,
        "keys": keys,
        "ref_keys": sorted(ref.state_dict()),
    }


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("storage", ["float32", "bfloat16", "uint8"])  # uint8: the default
def test_qlora_training_matches_one_process_and_keeps_quant_state(world: int, storage: str) -> None:
    """Losses, adapter gradients and parameters equal one process's (W=3: the
    packed rows are sharded unevenly); fsdp_compose's sharded and unsharded base
    weights carry the original ``quant_state``; FSDP2's carry none."""
    # FSDP2 before torch 2.13 cannot shard a uint8 parameter at all (its sharded
    # nn.Parameter requires grad): only fsdp_compose runs there.
    old_fsdp2 = storage == "uint8" and torch.__version__ < "2.13"
    for which in ("ours",) if old_fsdp2 else ("ours", "torch"):
        results = run_distributed(_train_job, world, which, storage)
        for r in results:
            assert max(r["loss_diffs"]) <= 1e-5, (which, r["loss_diffs"])
            assert r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, (which, r)
            assert all(same for _, same in r["seen"]), (which, "gathered packed bytes differ")
            quant_keys = {
                k for k in r["ref_keys"] if k.split(".")[-1] in _QUANT_KEYS or "quant_state" in k
            }
            assert len(quant_keys) == 10
            if which == "ours":
                assert r["carried"] == [True, True]
                assert all(has for has, _ in r["seen"]) and r["keys"] == r["ref_keys"]
            else:  # FSDP2 (torch 2.13): the metadata is gone; bitsandbytes' forward
                # falls back on Linear4bit.quant_state, so training still matches.
                assert r["carried"] == [None, None]
                assert not any(has for has, _ in r["seen"])
                assert set(r["keys"]) == set(r["ref_keys"]) - quant_keys


def _param_dtype_job(which: str, storage: str, param_dtype: torch.dtype) -> dict[str, Any]:
    """The base layers in their own units with ``param_dtype`` unlike their float
    ``quant_storage``: whether the gathered packed bytes stay the original's, and
    the forward's difference from one process (or the error it raises)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_compose import MixedPrecisionPolicy

    shard, policy = {
        "ours": (fully_shard, MixedPrecisionPolicy),
        "torch": (torch_fully_shard, TorchPolicy),
    }[which]
    ref, model = _model(storage), _model(storage)
    for base in _bases(model):  # inputs not cast: the base computes as in one process
        shard(base, mp_policy=policy(param_dtype=param_dtype, cast_forward_inputs=False))
    shard(model)
    same = []
    for base, ref_base in zip(_bases(model), _bases(ref)):
        base.register_forward_pre_hook(
            lambda m, _, r=ref_base: same.append(torch.equal(_bits(m.weight), _bits(r.weight)))
        )
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    try:
        diff = (model(x) - ref(x)).abs().max().item()
    except RuntimeError as exc:
        return {"same": same, "diff": None, "error": str(exc)[:80]}
    return {"same": same, "diff": diff, "error": None}


@pytest.mark.parametrize(
    ("storage", "param_dtype"), [("float32", torch.bfloat16), ("bfloat16", torch.float16)]
)
def test_param_dtype_leaves_packed_quantized_storage_alone(
    storage: str, param_dtype: torch.dtype
) -> None:
    """``MixedPrecisionPolicy(param_dtype=...)`` unlike a float ``quant_storage``:
    fsdp_compose gathers the packed bytes as they are (their ``quant_state``
    decodes them) and matches one process exactly; FSDP2 casts them, which either
    fails in bitsandbytes' forward (sizes differ) or gives wrong outputs."""
    for r in run_distributed(_param_dtype_job, 2, "ours", storage, param_dtype):
        assert r == {"same": [True, True], "diff": 0.0, "error": None}, r
    for r in run_distributed(_param_dtype_job, 2, "torch", storage, param_dtype):
        assert not any(r["same"]) and (r["error"] is not None or r["diff"] > 1e-2), r


def _save_job(path: str, which: str) -> None:
    dcp.save(_shard(_model("bfloat16"), which).state_dict(), checkpoint_id=path)


def _load_job(path: str, which: str) -> dict[str, Any]:
    """Loads model 0's checkpoint into model 1 (other base weights and quant
    state); rebuilds each base's quant state from what was loaded, as a loader
    must; returns whether the forward then equals model 0's, bit for bit."""
    from bitsandbytes.functional import QuantState

    saved = _model("bfloat16")
    model = _shard(_model("bfloat16", seed=1), which)
    sd = model.state_dict()
    # bitsandbytes' packed entry (JSON bytes) varies in length with its values:
    # load it at the saved size.
    saved_meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for key in sd:
        if key.endswith("bitsandbytes__nf4"):
            sd[key] = torch.empty(saved_meta[key].size, dtype=sd[key].dtype)
    dcp.load(sd, checkpoint_id=path)
    missing = []
    for i in (0, 2):
        prefix = f"{i}.base.weight."
        stats = {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}
        if not stats:
            missing.append(i)
            continue
        qs = QuantState.from_dict(stats, device=torch.device("cpu"))
        assert _quant_state_summary(qs) == _quant_state_summary(saved[i].base.weight.quant_state)
        model[i].base.weight.quant_state = model[i].base.quant_state = qs
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    return {"missing": missing, "equal": torch.equal(model(x), saved(x))}


@pytest.mark.parametrize("which", ["ours", "torch"])
def test_qlora_dcp_save_at_2_load_at_3_keeps_quant_state(which: str, tmp_path: Path) -> None:
    """A DCP checkpoint saved at W=2 holds each base layer's quant state with
    fsdp_compose, and loading it at W=3 (uneven) restores model 0's forward
    exactly. FSDP2's checkpoint has no quant state: the loaded packed weights
    would be decoded with the loading model's own absmax (recorded)."""
    path = str(tmp_path)
    run_distributed(_save_job, 2, path, which)
    results = run_distributed(_load_job, 3, path, which)
    for r in results:
        if which == "ours":
            assert r == {"missing": [], "equal": True}
        else:
            assert r["missing"] == [0, 2] and not r["equal"]


def _full_state_dict_job(which: str) -> dict[str, Any]:
    """The full-state-dict export against the unsharded model's state dict, and
    each base weight rebuilt from it (``Params4bit.from_prequantized``)."""
    from bitsandbytes.nn import Params4bit

    ref, model = _model("bfloat16"), _shard(_model("bfloat16"), which)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    expected = ref.state_dict()
    for name, value in full.items():
        assert torch.equal(_bits(value), _bits(expected[name])), name
    rebuilt = []
    for i in (0, 2):
        prefix = f"{i}.base.weight"
        stats = {k[len(prefix) + 1 :]: v for k, v in full.items() if k.startswith(prefix + ".")}
        if stats:
            weight = Params4bit.from_prequantized(full[prefix], stats, device="cpu")
            original = ref[i].base.weight
            assert _quant_state_summary(weight.quant_state) == _quant_state_summary(
                original.quant_state
            )
            rebuilt.append(i)
    return {
        "missing": sorted(set(expected) - set(full)),
        "rebuilt": rebuilt,
        "rank": dist.get_rank(),
    }


@pytest.mark.parametrize("which", ["ours", "torch"])
def test_qlora_full_state_dict_export_keeps_quant_state(which: str) -> None:
    """``get_model_state_dict(full_state_dict=True)`` at W=3 equals the unsharded
    model's state dict, quant-state entries included, with fsdp_compose; FSDP2's
    export lacks them (recorded), so its packed weights cannot be decoded."""
    for r in run_distributed(_full_state_dict_job, 3, which):
        if which == "ours":
            assert r["missing"] == [] and r["rebuilt"] == [0, 2]
        else:
            assert len(r["missing"]) == 10 and r["rebuilt"] == []
