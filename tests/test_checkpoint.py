"""Checkpointing with torch.distributed.checkpoint (DCP): sharded state dicts,
resharding to another world size, full state dicts, resume after a crash, and
clear errors for checkpoints that do not fit the model.

The distributed jobs run on the shared gloo pools; the crash test launches its
own rank processes (``tests/ckpt_train.py``) so that one of them can be killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from checkpoint import CheckpointMismatchError, load_checkpoint, save_checkpoint
from dist_utils import run_distributed, start_script
from gpt import GPT, GPTConfig, loss_fn, make_batch
from helpers import collective_log, full, local_slice, mean_across_ranks, rank_world
from models import TINY_GPT
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Shard

from fsdp_compose import fully_shard

TINY = {**TINY_GPT, "n_layer": 2}
GLOBAL_BATCH = 8  # divisible by every world size used here
LR = 1e-3
LOSS_TOL = 1e-5


def _build(cfg: GPTConfig, *, meta: bool = False, seed: int = 0) -> GPT:
    """The example GPT with one unit per block and the root, initialised from
    ``seed`` (or left on the meta device)."""
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _train_step(model: GPT, optim: torch.optim.Optimizer, cfg: GPTConfig, step: int) -> float:
    """One optimizer step on this rank's slice of the global batch of ``step``;
    returns the global-batch loss."""
    rank, world = rank_world()
    x, y = make_batch(cfg, GLOBAL_BATCH, step)
    loss = loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return mean_across_ranks(loss.item())


def _full_state(model: GPT, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state as a full tensor (collective)."""
    model_sd, optim_sd = get_state_dict(model, optim)
    # clone: plain tensors (Adam's step) are the optimizer's own state objects
    out = {f"param/{k}": full(v).detach().clone() for k, v in model_sd.items()}
    for fqn, states in optim_sd["state"].items():
        for name, value in states.items():
            out[f"optim/{fqn}/{name}"] = full(value).detach().clone()
    return out


# ---------------------------------------------------------------------------
# save at W, load at W' (meta-device model), continue training
# ---------------------------------------------------------------------------


def _save_job(path: str) -> dict:
    """Trains 3 steps, saves with DCP, then trains 3 more (the uninterrupted run)."""
    cfg = GPTConfig(**TINY)
    model = _build(cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(3):
        _train_step(model, optim, cfg, step)

    out: dict = {}
    # model.state_dict() holds the shards themselves: no collective, no copy.
    params = dict(model.named_parameters())
    with collective_log(model) as log:
        sd = model.state_dict()
    out["sd_no_collectives"] = not log.issued
    out["sd_shards"] = all(
        isinstance(v, DTensor)
        and v.placements == (Shard(0),)
        and v.to_local().data_ptr() == params[k].to_local().data_ptr()
        for k, v in sd.items()
    )

    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    saved = _full_state(model, optim)
    out["losses_after"] = [_train_step(model, optim, cfg, step) for step in range(3, 6)]
    if dist.get_rank() == 0:
        out["saved"] = saved
    return out


def _load_job(path: str, saved: dict[str, torch.Tensor]) -> dict:
    """Loads the checkpoint into a model built on the meta device (only the shards
    are ever allocated) at this world size, then trains the same 3 steps."""
    cfg = GPTConfig(**TINY)
    model = _build(cfg, meta=True)
    model.to_empty(device="cpu")  # uninitialised shards: everything comes from the checkpoint
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])

    loaded = _full_state(model, optim)
    return {
        "keys_equal": sorted(loaded) == sorted(saved),
        "max_state_diff": max((loaded[k] - saved[k]).abs().max().item() for k in saved),
        "losses_after": [_train_step(model, optim, cfg, step) for step in range(3, 6)],
    }


@pytest.mark.parametrize("save_world,load_world", [(4, 2), (2, 4)])
def test_reshard_on_load(tmp_path: Path, save_world: int, load_world: int) -> None:
    path = str(tmp_path / "ckpt")
    source = run_distributed(_save_job, save_world, path)
    for r in source:
        assert r["sd_no_collectives"] and r["sd_shards"]
    files = os.listdir(path)  # one data file per rank (no gather) and the global metadata
    assert ".metadata" in files and sum(f.endswith(".distcp") for f in files) == save_world, files
    saved = source[0]["saved"]
    assert any(k.endswith("/exp_avg_sq") for k in saved), sorted(saved)
    assert any(k.endswith("/step") for k in saved), sorted(saved)

    for r in run_distributed(_load_job, load_world, path, saved):
        assert r["keys_equal"], r
        assert r["max_state_diff"] == 0.0  # parameters and Adam states, bit for bit
        for got, want in zip(r["losses_after"], source[0]["losses_after"]):
            assert abs(got - want) <= LOSS_TOL, (r["losses_after"], source[0]["losses_after"])


# ---------------------------------------------------------------------------
# full state dict: export to a plain model, and load into a meta-device model
# ---------------------------------------------------------------------------


def _full_state_dict_job(path: str) -> dict:
    rank, world = rank_world()
    cfg = GPTConfig(**TINY)
    model = _build(cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(2):
        _train_step(model, optim, cfg, step)

    out: dict = {}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    plain_keys = list(GPT(cfg).state_dict())
    if rank == 0:
        out["full_plain"] = list(full) == plain_keys and all(
            type(v) is torch.Tensor and v.device.type == "cpu" for v in full.values()
        )
        torch.save(full, path)
    else:
        out["full_plain"] = full == {}  # cpu_offload keeps the full tensors on rank 0 only
    dist.barrier()

    x, y = make_batch(cfg, GLOBAL_BATCH, 100)
    with torch.no_grad():
        sharded_logits = model(x)
    # The file loads into the plain, unsharded model (strictly) and computes the same.
    plain = GPT(GPTConfig(**TINY))
    plain.load_state_dict(torch.load(path, weights_only=True))
    with torch.no_grad():
        out["plain_logits_diff"] = (plain(x) - sharded_logits).abs().max().item()

    # The same file loads into a sharded model too (each rank keeps its shards).
    resharded = _build(cfg, seed=1)
    resharded.load_state_dict(torch.load(path, weights_only=True))
    with torch.no_grad():
        out["sharded_load_logits_diff"] = (resharded(x) - sharded_logits).abs().max().item()

    # Loading a full state dict into a model still on the meta device: rank 0
    # broadcasts, each rank keeps only its shards.
    meta_model = _build(cfg, meta=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's device probe for all-meta models warns
        set_model_state_dict(
            meta_model,
            full if rank == 0 else {},
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
    out["meta_sharded"] = all(
        isinstance(p, DTensor) and not p.is_meta and p.placements == (Shard(0),)
        for p in meta_model.parameters()
    )
    with torch.no_grad():
        out["meta_logits_diff"] = (meta_model(x) - sharded_logits).abs().max().item()
    # ... and it trains like the plain model trained on the global batch.
    meta_optim = torch.optim.AdamW(meta_model.parameters(), lr=LR)
    plain_optim = torch.optim.AdamW(plain.parameters(), lr=LR)
    diffs = []
    for step in range(2):
        x, y = make_batch(cfg, GLOBAL_BATCH, step + 10)
        plain_loss = loss_fn(plain(x), y)
        plain_loss.backward()
        plain_optim.step()
        plain_optim.zero_grad()
        diffs.append(abs(_train_step(meta_model, meta_optim, cfg, step + 10) - plain_loss.item()))
    out["train_loss_diff"] = max(diffs)
    return out


def test_full_state_dict_round_trip(tmp_path: Path) -> None:
    for r in run_distributed(_full_state_dict_job, 2, str(tmp_path / "full.pt")):
        assert r["full_plain"], r
        assert r["plain_logits_diff"] == 0.0 and r["sharded_load_logits_diff"] == 0.0
        assert r["meta_sharded"] and r["meta_logits_diff"] == 0.0
        assert r["train_loss_diff"] <= LOSS_TOL


# ---------------------------------------------------------------------------
# a checkpoint that does not fit the model
# ---------------------------------------------------------------------------


def _saved_after_one_step(root: str) -> tuple[GPTConfig, GPT, torch.optim.Optimizer, str]:
    """A sharded GPT trained one step and checkpointed under ``root``."""
    cfg = GPTConfig(**TINY)
    model = _build(cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    _train_step(model, optim, cfg, 0)
    return cfg, model, optim, save_checkpoint(root, 1, model, optim)


def _mismatch_job(root: str) -> dict:
    cfg, model, optim, path = _saved_after_one_step(root)

    out = {}
    variants = {"more_layers": {"n_layer": 3}, "fewer_layers": {"n_layer": 1}, "wider": {"n_embd": 48}}
    for name, change in variants.items():
        other_cfg = GPTConfig(**{**TINY, **change})
        other = _build(other_cfg, seed=1)
        other_optim = torch.optim.AdamW(other.parameters(), lr=LR)
        before = _full_state(other, other_optim)
        try:
            load_checkpoint(path, other, other_optim)
            out[name] = "no error"
        except CheckpointMismatchError as exc:
            out[name] = str(exc)
        after = _full_state(other, other_optim)
        out[name + "_untouched"] = all(torch.equal(before[k], after[k]) for k in before)
    # the matching model loads fine, model only as well
    same = _build(cfg, seed=1)
    out["model_only_step"] = load_checkpoint(path, same)
    out["model_only_equal"] = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(same.parameters(), model.parameters())
    )
    return out


def test_mismatching_checkpoint_raises_clear_error(tmp_path: Path) -> None:
    for r in run_distributed(_mismatch_job, 2, str(tmp_path)):
        # the first mismatching key, in the model's order or the checkpoint's
        assert "'model.blocks.2.ln_1.weight' is in the state being loaded but not in the checkpoint" in r["more_layers"], r["more_layers"]
        assert "'model.blocks.1.ln_1.weight'" in r["fewer_layers"], r["fewer_layers"]
        assert "is in the checkpoint but not in the state being loaded" in r["fewer_layers"]
        assert "'model.tok_emb.weight' has shape (97, 32) in the checkpoint but (97, 48)" in r["wider"], r["wider"]
        for name in ("more_layers", "fewer_layers", "wider"):
            assert "Nothing was loaded" in r[name]
            assert r[name + "_untouched"], name
        assert r["model_only_step"] == 1 and r["model_only_equal"]


# ---------------------------------------------------------------------------
# a rank is killed in the middle of a save; the restart resumes and loses nothing
# ---------------------------------------------------------------------------

_SCRIPT = str(Path(__file__).with_name("ckpt_train.py"))
_WORLD = 2
_JOB_TIMEOUT_S = 180.0


class _Job:
    """The rank processes of one launch of ``ckpt_train.py`` (like torchrun's)."""

    def __init__(self, tmp: Path, tag: str, *args: str) -> None:
        self.logs = [tmp / f"{tag}.rank{r}.log" for r in range(_WORLD)]
        init_file = tmp / f"{tag}.store"  # a fresh rendezvous file per launch
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        # ``python ckpt_train.py ...`` per rank, forked from a process that has
        # imported torch already (the imports were most of a launch's time)
        self.procs = [
            start_script(_SCRIPT, ["--rank", str(rank), "--world-size", str(_WORLD),
                                   "--init-file", str(init_file), *args],
                         env=env, log=str(self.logs[rank]))
            for rank in range(_WORLD)
        ]

    def output(self) -> str:
        return "\n".join(f"--- rank {r} ---\n{log.read_text()}" for r, log in enumerate(self.logs))

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(timeout=30)

    def wait(self, timeout: float) -> list[int]:
        """Return codes; kills every rank and fails the test after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(deadline - time.monotonic(), 0.1)) for p in self.procs]
        except subprocess.TimeoutExpired:
            self.kill_all()
            pytest.fail(f"checkpoint job hung for {timeout:.0f}s:\n{self.output()}")

    def wait_ok(self) -> None:
        codes = self.wait(_JOB_TIMEOUT_S)
        assert codes == [0] * _WORLD, f"return codes {codes}:\n{self.output()}"


@pytest.mark.slow
def test_kill_during_save_then_resume(tmp_path: Path) -> None:
    common = ["--steps", "6", "--save-every", "2"]
    # 1. the run that is never interrupted
    ref = _Job(tmp_path, "reference", "--dir", str(tmp_path / "ref"), "--out", str(tmp_path / "ref.pt"), *common)
    ref.wait_ok()

    # 2. the same run; rank 1 stops inside the save after step 4 and is killed there
    run_dir = tmp_path / "run"
    marker = tmp_path / "rank1_in_save"
    crashed = _Job(tmp_path, "crashed", "--dir", str(run_dir), "--out", str(tmp_path / "unused.pt"),
                   "--hang-in-save", "4", "--hang-rank", "1", "--marker", str(marker), *common)
    deadline = time.monotonic() + _JOB_TIMEOUT_S
    while not marker.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in crashed.procs):
            crashed.kill_all()
            pytest.fail(f"rank 1 never reached the save of step 4:\n{crashed.output()}")
        time.sleep(0.05)
    os.kill(crashed.procs[1].pid, signal.SIGKILL)
    # The survivor fails in its next collective with the dead rank; like torchrun's
    # agent, stop it if it has not exited on its own.
    try:
        crashed.procs[0].wait(timeout=30)
    except subprocess.TimeoutExpired:
        crashed.kill_all()
    crashed.wait(30)
    assert crashed.procs[1].returncode == -signal.SIGKILL
    entries = sorted(os.listdir(run_dir))
    # the interrupted save never became a checkpoint; the previous one survived
    assert entries == ["step_00000002", "step_00000004.tmp"], entries
    assert not (run_dir / "step_00000004.tmp" / ".metadata").exists()

    # 3. restart: resumes from step 2 and ends where the reference ended
    resumed = _Job(tmp_path, "resumed", "--dir", str(run_dir), "--out", str(tmp_path / "resumed.pt"), *common)
    resumed.wait_ok()
    assert "start step 2" in resumed.logs[0].read_text(), resumed.output()
    assert sorted(os.listdir(run_dir)) == ["step_00000004", "step_00000006"]
    want = torch.load(tmp_path / "ref.pt", weights_only=True)
    got = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


# ---------------------------------------------------------------------------
# a failed load leaves the model and optimizer as they were
# ---------------------------------------------------------------------------


def _local_state(model: GPT, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p.to_local().clone() for p in model.parameters()]
    for state in optim.state.values():
        tensors += [v.to_local().clone() if isinstance(v, DTensor) else v.clone() for v in state.values()]
    return tensors


def _damaged_load_job(root: str, damage: str) -> dict:
    """Saves after step 1, trains a step more, damages a file, loads: the load must
    fail and leave everything as it was after step 2."""
    rank, _ = rank_world()
    cfg, model, optim, path = _saved_after_one_step(root)
    _train_step(model, optim, cfg, 1)
    before = _local_state(model, optim)
    if rank == 0:
        data_files = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
        target = os.path.join(path, data_files[-1])
        if damage in ("truncate", "truncate_unverified"):
            with open(target, "r+b") as f:
                f.truncate(os.path.getsize(target) // 2)
            if damage == "truncate_unverified":  # DCP itself must fail, mid-read
                os.remove(os.path.join(path, "checksums.json"))
        elif damage == "missing":
            os.remove(target)
        elif damage == "corrupt":  # same size, a byte range changed
            with open(target, "r+b") as f:
                f.seek(os.path.getsize(target) // 2)
                chunk = bytearray(f.read(64))
                f.seek(os.path.getsize(target) // 2)
                f.write(bytes(b ^ 0xFF for b in chunk))
    dist.barrier()
    try:
        load_checkpoint(path, model, optim)
        error = "no error"
    except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException(BaseException)
        error = f"{type(exc).__name__}: {exc}"
    after = _local_state(model, optim)
    unchanged = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    # and the model still trains
    _train_step(model, optim, cfg, 2)
    return {"error": error, "unchanged": unchanged}


@pytest.mark.parametrize("damage", ["truncate", "missing", "corrupt", "truncate_unverified"])
def test_failed_load_leaves_model_and_optimizer_unchanged(tmp_path: Path, damage: str) -> None:
    results = run_distributed(_damaged_load_job, 2, str(tmp_path), damage)
    for r in results:
        assert r["unchanged"], r
        assert r["error"] != "no error", r
        if damage == "truncate_unverified":
            continue  # DCP's own error; what matters is that nothing changed
        assert r["error"].startswith("CheckpointCorruptError:"), r
        assert "__1_0.distcp" in r["error"], r
    expected = {"truncate": "were saved (truncated", "missing": "is missing", "corrupt": "does not match its checksum"}
    if damage in expected:
        assert expected[damage] in results[0]["error"], results[0]


def _checksums_job(root: str) -> bool:
    from checkpoint import verify_checkpoint

    path = _saved_after_one_step(root)[3]
    return verify_checkpoint(path) and os.path.isfile(os.path.join(path, "checksums.json"))


def test_checkpoint_records_and_verifies_checksums(tmp_path: Path) -> None:
    assert run_distributed(_checksums_job, 2, str(tmp_path)) == [True, True]
