"""safetensors in and out of sharded models (``fsdp_compose.safetensors_io``).

Loading: a single file and Hugging Face's sharded files with their index, into a
model built on the meta device or a materialized one, at W = 2 and 4 with uneven
and empty shards, a bfloat16 file into float32 parameters, tied weights, a key
map, HSDP and tensor parallel (2-D): every rank reads only its own part (the
bytes read over all ranks add up to the file's data) and the full parameters are
the file's tensors. Bad checkpoints raise a clear error before anything changes.
Export: files and index in Hugging Face's layout, equal to the full parameters;
a failed export publishes nothing; a DCP checkpoint converts offline on one
process or on several ranks.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("safetensors")

from dist_utils import run_distributed

CFG = {"vocab_size": 97, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 34}  # uneven at W=4


def _index(directory: str) -> dict:
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        return json.load(f)


def _ref(tie: bool = False, seed: int = 0):
    from gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(**CFG, tie_weights=tie))


def _sharded(tie: bool = False, meta: bool = True, mesh=None, seed: int = 1):
    from gpt import GPT, GPTConfig
    from parallelize import apply_fsdp

    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            model = GPT(GPTConfig(**CFG, tie_weights=tie))
    else:
        model = GPT(GPTConfig(**CFG, tie_weights=tie))
    return apply_fsdp(model, mesh=mesh)


def _full_diff(model, ref) -> float:
    from helpers import max_param_diff

    return max_param_diff(model, ref)[0]


def _logits_diff(model, ref) -> float:
    from gpt import GPTConfig, make_batch

    x, _ = make_batch(GPTConfig(**CFG), 4, step=0)
    with torch.no_grad():
        return (model(x) - ref(x)).abs().max().item()


def _save_rank0(tensors: dict, path: str, **kw) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, path, **kw)
    dist.barrier()


def _export_diff(model, directory: str, expected: dict) -> float:
    """Exports ``model`` and returns the largest difference to ``expected``."""
    from safetensors.torch import load_file

    from fsdp_compose.safetensors_io import save_safetensors

    save_safetensors(model, directory)
    written = load_file(os.path.join(directory, "model.safetensors"))
    assert sorted(written) == sorted(expected), sorted(set(written) ^ set(expected))
    return max((written[k] - v).abs().max().item() for k, v in expected.items())


def _load_job(tmp: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compose.safetensors_io import load_safetensors, save_safetensors

    world = dist.get_world_size()
    out: dict = {}
    ref = _ref()
    state = ref.state_dict()
    single = os.path.join(tmp, "single", "model.safetensors")
    _save_rank0(state, single)

    # meta-device model, single file: each rank reads only its rows
    model = _sharded()
    before = list(model.parameters())
    optim = torch.optim.SGD(model.parameters(), lr=0.1)  # created on the meta parameters
    res = load_safetensors(model, single)
    out["meta_single"] = (_full_diff(model, ref), _logits_diff(model, ref))
    out["same_objects"] = all(a is b for a, b in zip(before, model.parameters()))
    model(torch.zeros(2, 4, dtype=torch.long)).sum().backward()
    optim.step()  # the optimizer holds the loaded parameters
    out["optim_moved"] = _full_diff(model, ref) > 0
    total = torch.tensor([res.bytes_read])
    dist.all_reduce(total)
    out["bytes_read_total"] = int(total.item())
    out["bytes_file"] = sum(t.numel() * t.element_size() for t in state.values())
    out["bytes_read_rank"] = res.bytes_read
    out["all_loaded"] = sorted(res.loaded) == sorted(state)

    # materialized model, HF sharded files + index (written by our export)
    save_safetensors(ref, os.path.join(tmp, "split"), max_shard_size=20_000)  # a plain model: rank 0 writes
    model = _sharded(meta=False)
    load_safetensors(model, os.path.join(tmp, "split"))
    out["n_files"] = len(set(_index(os.path.join(tmp, "split"))["weight_map"].values()))
    out["split"] = _full_diff(model, ref)

    # bfloat16 file into float32 parameters
    bf16 = os.path.join(tmp, "bf16", "model.safetensors")
    _save_rank0({k: v.bfloat16() for k, v in state.items()}, bf16)
    model = _sharded()
    load_safetensors(model, bf16)
    rounded = _ref()
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.bfloat16().float())
    out["bf16"] = _full_diff(model, rounded)
    out["dtype"] = {str(p.dtype) for p in model.parameters()}

    # tied weights: the file holds only the embedding (as save_pretrained writes it)
    tied_ref = _ref(tie=True)
    tied_state = {k: v for k, v in tied_ref.state_dict().items() if k != "lm_head.weight"}
    tied_file = os.path.join(tmp, "tied", "model.safetensors")
    _save_rank0(tied_state, tied_file)
    model = _sharded(tie=True)
    res = load_safetensors(model, tied_file)
    out["tied"] = (_full_diff(model, tied_ref), model.lm_head.weight is model.tok_emb.weight,
                   "lm_head.weight" in res.loaded)

    # tied weights across units: tok_emb and lm_head annotated as units of their own
    from gpt import GPT, GPTConfig

    from fsdp_compose import fully_shard

    with torch.device("meta"):
        model = GPT(GPTConfig(**CFG, tie_weights=True))
    fully_shard(model.tok_emb)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model.lm_head)
    fully_shard(model)
    load_safetensors(model, tied_file)
    export = _export_diff(model, os.path.join(tmp, "tied_units_export"), tied_state)
    out["tied_units"] = (_full_diff(model, tied_ref), _logits_diff(model, tied_ref), export,
                         model.lm_head.weight is model.tok_emb.weight)

    # key map: the file's names have a prefix
    prefixed = os.path.join(tmp, "prefixed", "model.safetensors")
    _save_rank0({"transformer." + k: v for k, v in state.items()}, prefixed)
    model = _sharded()
    load_safetensors(model, prefixed, key_map=lambda k: "transformer." + k)
    out["key_map"] = _full_diff(model, ref)

    # HSDP: replicas read the same rows
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = _sharded(mesh=mesh)
        load_safetensors(model, single)
        out["hsdp"] = (_full_diff(model, ref), _logits_diff(model, ref))
        out["hsdp_export"] = _export_diff(model, os.path.join(tmp, "hsdp_export"), state)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_load_into_shards(tmp_path, world: int) -> None:
    results = run_distributed(_load_job, world, str(tmp_path), timeout=180)
    for r in results:
        assert r["meta_single"] == (0.0, 0.0), r
        assert r["all_loaded"] and r["same_objects"] and r["optim_moved"], r
        # each rank read only its own part: all ranks together read the file's data once
        assert r["bytes_read_total"] == r["bytes_file"], r
        assert r["bytes_read_rank"] < r["bytes_file"] * 0.75, r
        assert r["n_files"] > 1 and r["split"] == 0.0, r
        assert r["bf16"] == 0.0 and r["dtype"] == {"torch.float32"}, r
        assert r["tied"] == (0.0, True, True), r
        assert r["tied_units"] == (0.0, 0.0, 0.0, True), r
        assert r["key_map"] == 0.0, r
        if world == 4:
            assert r["hsdp"] == (0.0, 0.0) and r["hsdp_export"] == 0.0, r


def _tp_job(tmp: str) -> dict:
    import copy

    from gpt import GPT, GPTConfig
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from train_tp import apply_tp_fsdp

    from fsdp_compose.safetensors_io import load_safetensors

    ref = _ref()
    single = os.path.join(tmp, "model.safetensors")
    _save_rank0(ref.state_dict(), single)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = apply_tp_fsdp(GPT(GPTConfig(**CFG)), mesh)
    placements = set()
    for p in model.parameters():
        assert isinstance(p, DTensor)
        placements.add(str(tuple(p.placements)))
    load_safetensors(model, single)
    out = {
        "export": _export_diff(model, os.path.join(tmp, "export"), ref.state_dict()),
        "param": _full_diff(model, ref),
        "logits": _logits_diff(model, copy.deepcopy(ref)),
        "strided": any("_StridedShard" in p for p in placements),
    }
    return out


def test_load_tensor_parallel_2d(tmp_path) -> None:
    for r in run_distributed(_tp_job, 4, str(tmp_path), timeout=180):
        assert r["strided"], "the TP + FSDP layout should have strided shards"
        assert r["param"] == 0.0 and r["export"] == 0.0, r
        assert r["logits"] <= 1e-5, r


def _errors_job(tmp: str) -> dict:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from fsdp_compose.safetensors_io import load_safetensors

    ref = _ref()
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    rank = dist.get_rank()
    cases: dict[str, tuple[str, dict]] = {}

    def case(name: str, tensors: dict, index: dict | None = None) -> str:
        d = os.path.join(tmp, name)
        if rank == 0:
            os.makedirs(d, exist_ok=True)
            save_file(tensors, os.path.join(d, "model-00001-of-00001.safetensors" if index else "model.safetensors"))
            if index is not None:
                with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
                    json.dump(index, f)
        return d

    missing = case("missing", {k: v for k, v in state.items() if k != "blocks.1.mlp.fc.weight"})
    extra = case("unexpected", {**state, "extra.weight": torch.zeros(3)})
    bad_shape = case("shape", {**state, "ln_f.weight": torch.zeros(35)})
    bad_dtype = case("dtype", {**state, "ln_f.bias": torch.zeros(34, dtype=torch.int64)})
    truncated = case("truncated", state)
    shard = "model-00001-of-00001.safetensors"
    wm = {k: shard for k in state}
    no_file = case("no_file", state, {"weight_map": {**wm, "ln_f.weight": "model-00002-of-00002.safetensors"}})
    wrong_index = case("wrong_index", {k: v for k, v in state.items() if k != "ln_f.bias"}, {"weight_map": wm})
    if rank == 0:
        path = os.path.join(truncated, "model.safetensors")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 100)
    dist.barrier()
    cases = {
        "missing": (missing, "blocks.1.mlp.fc.weight"),
        "unexpected": (extra, "extra.weight"),
        "shape": (bad_shape, "ln_f.weight"),
        "dtype": (bad_dtype, "ln_f.bias"),
        "truncated": (truncated, "model.safetensors"),
        "no_file": (no_file, "model-00002-of-00002.safetensors"),
        "wrong_index": (wrong_index, "ln_f.bias"),
    }
    out: dict = {}
    for meta in (False, True):
        model = _sharded(meta=meta)
        before = {n: p.to_local().clone() for n, p in model.named_parameters()} if not meta else None
        for what, (path, must_name) in cases.items():
            try:
                load_safetensors(model, path)
                out[(what, meta)] = "no error"
                continue
            except (ValueError, FileNotFoundError) as exc:
                message = str(exc)
            problems = []
            if must_name not in message:
                problems.append(f"does not name {must_name!r}: {message}")
            if what not in ("truncated", "no_file") and path not in message:
                problems.append(f"does not name the file: {message}")
            if meta:
                if not all(p.is_meta for p in model.parameters()):
                    problems.append("materialized parameters")
            elif any(not torch.equal(p.to_local(), before[n]) for n, p in model.named_parameters()):
                problems.append("modified parameters")
            out[(what, meta)] = problems
    # strict=False reports instead of raising
    model = _sharded()
    res = load_safetensors(model, missing, strict=False)
    out["non_strict"] = (res.missing, res.unexpected)
    res = load_safetensors(model, extra, strict=False)
    out["non_strict_extra"] = res.unexpected
    return {str(k): v for k, v in out.items()}


def test_bad_checkpoints_raise_before_loading(tmp_path) -> None:
    for r in run_distributed(_errors_job, 2, str(tmp_path), timeout=180):
        for what, problems in r.items():
            if what.startswith("non_strict"):
                continue
            assert problems == [], (what, problems)
        assert r["non_strict"] == (["blocks.1.mlp.fc.weight"], []), r
        assert r["non_strict_extra"] == ["extra.weight"], r


def _export_job(tmp: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from fsdp_compose.safetensors_io import _export as safetensors_export
    from fsdp_compose.safetensors_io import (
        export_dcp_to_safetensors,
        load_safetensors,
        save_safetensors,
    )

    rank = dist.get_rank()
    out: dict = {}
    ref = _ref(tie=True)
    model = _sharded(tie=True, meta=False)
    ref_sd = ref.state_dict()
    src = os.path.join(tmp, "src")
    save_safetensors(ref, src)  # a plain model: rank 0 writes
    load_safetensors(model, src)

    # export from shards, split in several files
    d = os.path.join(tmp, "export")
    paths = save_safetensors(model, d, max_shard_size="20KB", dtype=None)
    dist.barrier()
    index = _index(d)
    files = sorted(set(index["weight_map"].values()))
    loaded: dict = {}
    for f in files:
        loaded.update(load_file(os.path.join(d, f)))
    out["paths"] = (len(paths), len(files)) if rank == 0 else None
    out["names"] = sorted(loaded) == sorted(k for k in ref_sd if k != "lm_head.weight")
    out["values"] = max((loaded[k] - ref_sd[k]).abs().max().item() for k in loaded)
    out["total_size"] = index["metadata"]["total_size"] == sum(v.numel() * 4 for v in loaded.values())
    out["listing"] = sorted(os.listdir(d))

    # bf16 export into one file
    d16 = os.path.join(tmp, "export16")
    save_safetensors(model, d16, dtype=torch.bfloat16)
    one = load_file(os.path.join(d16, "model.safetensors"))
    out["bf16"] = {str(v.dtype) for v in one.values()}

    # a failing export publishes nothing and keeps an older complete export
    real = safetensors_export._write_bytes
    calls = [0]

    def failing(f, tensor):
        calls[0] += 1
        if calls[0] == 5:
            raise OSError("disk full (simulated)")
        real(f, tensor)

    safetensors_export._write_bytes = failing
    try:
        save_safetensors(model, d, max_shard_size="20KB")
        out["failure"] = "no error"
    except (OSError, RuntimeError) as exc:
        out["failure"] = type(exc).__name__
    finally:
        safetensors_export._write_bytes = real
    out["after_failure"] = sorted(os.listdir(d))

    # DCP checkpoint -> safetensors offline, here on the 2 ranks
    ckpt = os.path.join(tmp, "dcp")
    dcp.save({"model": model.state_dict()}, checkpoint_id=ckpt)
    dd = os.path.join(tmp, "from_dcp_dist")
    export_dcp_to_safetensors(ckpt, dd, max_shard_size="20KB")
    dist.barrier()
    index = _index(dd)
    from_dcp: dict = {}
    for f in sorted(set(index["weight_map"].values())):
        from_dcp.update(load_file(os.path.join(dd, f)))
    # DCP keeps both tied names (one storage); the export writes what DCP holds
    out["dcp"] = max((from_dcp[k] - ref_sd[k]).abs().max().item() for k in from_dcp)
    out["dcp_names"] = sorted(from_dcp) == sorted(ref_sd)
    return out


def test_export(tmp_path) -> None:
    from safetensors.torch import load_file

    from fsdp_compose.safetensors_io import export_dcp_to_safetensors

    results = run_distributed(_export_job, 2, str(tmp_path), timeout=180)
    for r in results:
        assert r["names"] and r["values"] == 0.0 and r["total_size"], r
        assert r["bf16"] == {"torch.bfloat16"}, r
        assert r["failure"] in ("OSError", "RuntimeError"), r
        assert r["after_failure"] == r["listing"], "a failed export changed the directory"
        assert r["dcp"] == 0.0 and r["dcp_names"], r
    assert results[0]["failure"] == "OSError" and results[1]["failure"] == "RuntimeError"
    n_paths, n_files = results[0]["paths"]
    assert n_files > 1 and n_paths == n_files + 1, results[0]["paths"]
    assert not any(".tmp" in f for f in results[0]["listing"]), results[0]["listing"]
    # the same DCP checkpoint on one process (no process group)
    out = tmp_path / "from_dcp_single"
    paths = export_dcp_to_safetensors(tmp_path / "dcp", out, max_shard_size="1GB")
    assert paths == [str(out / "model.safetensors")]
    single = load_file(out / "model.safetensors")
    dist_dir = tmp_path / "from_dcp_dist"
    index = json.loads((dist_dir / "model.safetensors.index.json").read_text())
    for name, file in index["weight_map"].items():
        assert torch.equal(single[name], load_file(dist_dir / file)[name]), name


def test_missing_safetensors_is_a_clear_error(monkeypatch) -> None:
    import sys

    from fsdp_compose import safetensors_io

    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install fsdp_compose\[safetensors\]"):
        safetensors_io.load_safetensors(torch.nn.Linear(2, 2), "model.safetensors")


def test_core_does_not_import_the_extension() -> None:
    import fsdp_compose

    runtime = os.path.join(os.path.dirname(fsdp_compose.__file__), "_runtime")
    names = sorted(n for n in os.listdir(runtime) if n.endswith(".py"))
    assert "_fully_shard.py" in names, names
    for name in names:
        with open(os.path.join(runtime, name)) as f:
            assert "safetensors" not in f.read(), name


def test_export_argument_errors(tmp_path) -> None:
    from fsdp_compose.safetensors_io import export_dcp_to_safetensors, save_safetensors

    model = torch.nn.Linear(2, 3)  # a plain module, one process: no process group needed
    with pytest.raises(ValueError, match="max_shard_size"):
        save_safetensors(model, tmp_path / "out", max_shard_size="5 parsecs")
    with pytest.raises(ValueError, match="two tensors are exported under the name 'w'"):
        save_safetensors(model, tmp_path / "out", key_map=lambda k: "w")
    assert not (tmp_path / "out").exists(), "nothing may be written after a bad argument"
    with pytest.raises(ValueError, match=r"not a readable torch\.distributed\.checkpoint"):
        export_dcp_to_safetensors(tmp_path / "no_such_checkpoint", tmp_path / "out")
    paths = save_safetensors(model, tmp_path / "out", max_shard_size="1KiB")
    assert paths == [str(tmp_path / "out" / "model.safetensors")]
    assert sorted(os.listdir(tmp_path / "out")) == ["model.safetensors"]
