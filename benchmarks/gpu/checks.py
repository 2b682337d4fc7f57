"""Rank-side checks of the one-GPU check (``benchmarks/gpu/check.py``).

Every function here runs inside a rank process that :func:`rank_main` has put
in a process group. A job (``parity``, ``features``, ``stress``) runs several
sub-checks; each is guarded, so one that raises is reported and the next one
still runs. Results are plain dicts (JSON-serialisable), one per rank.

The models and the parity loop are the test suite's: the GPT of
``examples/gpt.py`` and ``train_side_by_side`` of ``tests/helpers.py``.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

# This checkout's library, the examples' GPT and the tests' helpers, before any install.
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for _p in (_REPO, os.path.join(_REPO, "examples"), os.path.join(_REPO, "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from gpt import GPT, PRESETS, GPTConfig, loss_fn, make_batch  # noqa: E402
from helpers import full, local_slice, max_grad_diff, max_param_diff, train_side_by_side  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402

from fsdp_compose import (  # noqa: E402
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    cpu_offload_by_budget,
    enable_sharded_step,
    fully_shard,
)

# float32 on a GPU reduces in another order than the one-process reference
# (TF32 is off); bf16 compute is compared with the float32 reference.
TOL = {
    "fp32": {"loss": 1e-5, "grad": 1e-5, "param": 1e-4},
    "bf16": {"loss": 5e-2, "grad": 5e-2, "param": 1e-2},
}
MUON_TOL = 1e-6  # the same gradients in: one differing bf16 rounding would show as ~1e-4

# GPT sizes: "tiny" for the CPU smoke run, "demo" (~1M) for parity and "small"
# (~15M, long enough kernels for the collectives to overlap) for the stress loop.
SIZES = {
    "smoke": {"parity": "tiny", "stress": "tiny", "steps": 3, "stress_steps": 6},
    "gpu": {"parity": "demo", "stress": "small", "steps": 3, "stress_steps": 300},
}


def backend_for(device_type: str, world: int) -> str:
    """The process-group backend for ``world`` ranks on this machine.

    NCCL refuses two ranks on one GPU (it reports a duplicate GPU), so with fewer
    GPUs than ranks CUDA tensors go through gloo, which copies them through host
    memory: slow, but the same collectives, streams and events on the CUDA side.
    """
    if device_type == "cuda" and torch.cuda.device_count() >= world:
        return "cpu:gloo,cuda:nccl"  # CPU collectives too (mean_across_ranks, barriers)
    return "gloo"


def rank_main(
    rank: int, world: int, init_file: str, device_type: str, job: str, kw: dict, out: str
) -> None:
    """Entry point of one rank process: joins the group, runs ``job``, writes its result."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if device_type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    backend = backend_for(device_type, world)
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        result = JOBS[job](device_type, **kw)
        result["backend"] = backend
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, default=str)


def guarded(results: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    """Runs one sub-check; an exception becomes a failed entry, not a failed job."""
    start = time.perf_counter()
    try:
        entry = fn()
    except Exception as exc:  # every failure is a result to report
        entry = {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }
    entry["seconds"] = round(time.perf_counter() - start, 3)
    results[name] = entry


def _device(device_type: str) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _mesh(device_type: str) -> DeviceMesh:
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _sharded(
    base: GPT,
    mesh: DeviceMesh,
    tied_units: bool = False,
    block_offload: Callable[[nn.Module], Any] | None = None,
    **kw: Any,
) -> Any:
    """A copy of ``base``, one unit per block and the root (and, for a tied
    embedding and LM head, one unit each: the weight is shared between units);
    ``block_offload(block)``: each block's ``offload_policy``."""
    model: GPT = copy.deepcopy(base)
    if tied_units:
        fully_shard(model.tok_emb, mesh=mesh, **kw)
    for block in model.blocks:
        extra = {} if block_offload is None else {"offload_policy": block_offload(block)}
        fully_shard(block, mesh=mesh, **kw, **extra)
    if tied_units:
        fully_shard(model.lm_head, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _batches(cfg: GPTConfig, device: torch.device) -> Callable[[int], tuple[torch.Tensor, ...]]:
    world = dist.get_world_size()
    return lambda step: tuple(t.to(device) for t in make_batch(cfg, 2 * world, step))


def _verdict(r: dict[str, Any], tol: dict[str, float]) -> dict[str, Any]:
    r["max_loss_diff"] = max(r.pop("loss_diffs"))
    r["tolerance"] = tol
    r["ok"] = (
        r["max_loss_diff"] <= tol["loss"]
        and (r["grad_diff"] or 0.0) <= tol["grad"]
        and r["param_diff"] <= tol["param"]
    )
    return r


def _side_by_side(device_type: str, size: str, steps: int, tol: str, **shard_kw: Any) -> dict:
    """Sharded GPT vs the unsharded one on the whole batch, ``steps`` AdamW steps."""
    device = _device(device_type)
    cfg = GPTConfig(**vars(PRESETS[size]))
    torch.manual_seed(0)
    base = GPT(cfg).to(device)
    model = _sharded(base, _mesh(device_type), **shard_kw)
    r = train_side_by_side(model, base, steps, _batches(cfg, device), loss_fn)
    return _verdict(r, TOL[tol])


def _shard_of(t: torch.Tensor) -> torch.Tensor:
    return torch.chunk(t.detach().cpu(), dist.get_world_size(), dim=0)[dist.get_rank()]


def _offload_pinned(
    device_type: str, size: str, steps: int, by_budget: bool = False
) -> dict[str, Any]:
    """``CPUOffloadPolicy(pin_memory=True)`` vs the unsharded model on the device:
    shards, gradients and optimizer states in pinned host memory (on a CUDA mesh;
    on a CPU mesh the policy changes nothing), the same numbers. ``by_budget``:
    each block offloads only its largest parameters, up to half its bytes
    (``cpu_offload_by_budget``), so that every block unit mixes host and device
    parameters, and the root's stay on the device."""
    device = _device(device_type)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**vars(PRESETS[size]))
    torch.manual_seed(0)
    base = GPT(cfg)  # on the host: the offloaded shards are cut from it
    chosen: list[tuple[nn.Module, str]] = []

    def half_of(block: nn.Module) -> Any:
        budget = sum(p.numel() * p.element_size() for p in block.parameters()) // 2
        policies = cpu_offload_by_budget(block, budget)
        chosen.extend((block, name) for name in policies)
        return policies

    if by_budget:
        model = _sharded(base, _mesh(device_type), block_offload=half_of)
    else:
        model = _sharded(base, _mesh(device_type), offload_policy=CPUOffloadPolicy(pin_memory=True))
    host = {id(block.get_parameter(name)) for block, name in chosen}
    ref = base.to(device)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    batches = _batches(cfg, device)
    r: dict[str, Any] = {"loss_diffs": []}
    for step in range(steps):
        x, y = batches(step)
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        loss = loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world))
        loss.backward()
        if step == 0:  # local shards against the reference's rows, compared on the host
            pairs = [
                (p.grad.to_local(), q.grad) for p, q in zip(model.parameters(), ref.parameters())
            ]
            r["grad_diff"] = max((a.cpu() - _shard_of(b)).abs().max().item() for a, b in pairs)
            r["grad_devices"] = sorted({a.device.type for a, _ in pairs})
            grad_where = [a.device.type for a, _ in pairs]
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        loss_t = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(loss_t)  # a host tensor: gloo
        r["loss_diffs"].append(abs(loss_t.item() / world - ref_loss.item()))
    locals_ = [p.detach().to_local() for p in model.parameters()]
    pairs_ = zip(locals_, ref.parameters())
    r["param_diff"] = max((a.cpu() - _shard_of(b)).abs().max().item() for a, b in pairs_)
    r["shard_devices"] = sorted({t.device.type for t in locals_})
    r["pinned"] = all(t.is_pinned() for t in locals_ if t.numel() and t.device.type == "cpu")
    r = _verdict(r, TOL["fp32"])
    if by_budget:  # each shard and its gradient where the mapping put it
        where = [
            (p.to_local().device.type, g, id(p) in host)
            for p, g in zip(model.parameters(), grad_where)
        ]
        r["offloaded"] = sum(on_host for *_, on_host in where)
        r["placed"] = all(
            a == g == ("cpu" if on_host or device_type == "cpu" else device_type)
            for a, g, on_host in where
        )
        pinned = r["pinned"] or device_type == "cpu"  # (a CPU mesh offloads nothing)
        r["ok"] = r["ok"] and r["placed"] and pinned and 0 < r["offloaded"] < len(where)
    elif device_type == "cuda":
        r["ok"] = r["ok"] and r["shard_devices"] == r["grad_devices"] == ["cpu"] and r["pinned"]
    return r


def _no_sync(device_type: str, size: str) -> dict[str, Any]:
    """Two micro-batches, the first without gradient reduction: the accumulated
    gradients equal the reference's on both whole micro-batches."""
    device = _device(device_type)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**vars(PRESETS[size]))
    torch.manual_seed(0)
    ref = GPT(cfg).to(device)
    model = _sharded(ref, _mesh(device_type))
    batches = _batches(cfg, device)
    for micro in range(2):
        x, y = batches(micro)
        loss_fn(ref(x), y).backward()
        model.set_requires_gradient_sync(micro == 1)
        loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
    grad_diff = max_grad_diff(model, ref)
    tol = TOL["fp32"]["grad"]
    return {"grad_diff": grad_diff, "tolerance": tol, "ok": grad_diff <= tol}


def parity_job(device_type: str, size: str, steps: int) -> dict[str, Any]:
    """Parity with one process: float32, bf16 mixed precision, each
    ``reshard_after_forward`` kind, no-sync accumulation and CPU offload."""
    world = dist.get_world_size()
    group = world // 2 if world >= 4 else world  # an int strictly between 1 and W needs W >= 4
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    cases: dict[str, tuple[str, dict[str, Any]]] = {
        "fp32_reshard_true": ("fp32", {"reshard_after_forward": True}),
        "fp32_reshard_false": ("fp32", {"reshard_after_forward": False}),
        f"fp32_reshard_int{group}": ("fp32", {"reshard_after_forward": group}),
        "bf16_mixed_precision": ("bf16", {"mp_policy": bf16}),
    }
    results: dict[str, Any] = {"world": world}
    for name, (tol, kw) in cases.items():
        run: Callable[[], dict[str, Any]] = functools.partial(
            _side_by_side, device_type, size, steps, tol, **kw
        )
        guarded(results, name, run)
    guarded(results, "no_sync_accumulation", lambda: _no_sync(device_type, size))
    guarded(results, "cpu_offload_pinned", lambda: _offload_pinned(device_type, size, steps))
    guarded(
        results,
        "cpu_offload_by_budget",
        lambda: _offload_pinned(device_type, size, steps, by_budget=True),
    )
    return results


def _muon(device_type: str, size: str, steps: int) -> dict[str, Any]:
    """fsdp_compose's sharded ``torch.optim.Muon`` step vs Muon on one device."""
    device = _device(device_type)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**vars(PRESETS[size]))
    torch.manual_seed(0)
    ref = GPT(cfg).to(device)
    model = _sharded(ref, _mesh(device_type))

    def hidden(m: nn.Module) -> list[torch.Tensor]:
        return [
            p
            for n, p in m.named_parameters()
            if p.ndim == 2 and "emb" not in n and "lm_head" not in n
        ]

    opt = enable_sharded_step(torch.optim.Muon(hidden(model), lr=0.02))
    ref_opt = torch.optim.Muon(hidden(ref), lr=0.02)
    batches = _batches(cfg, device)
    for step in range(steps):
        x, y = batches(step)
        loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        # The reference steps on the sharded model's (reduced) gradients: with the
        # same gradients, the two steps must agree bit for bit.
        for p, q in zip(hidden(model), hidden(ref)):
            q.grad = full(p.grad).clone()  # type: ignore[arg-type]
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    diff = max(
        (full(p.detach()) - q).abs().max().item() for p, q in zip(hidden(model), hidden(ref))
    )
    return {"param_diff": diff, "tolerance": MUON_TOL, "ok": diff <= MUON_TOL}


def _tied(device_type: str, size: str, steps: int) -> dict[str, Any]:
    """A tied embedding and LM head in separate units, trained against one process."""
    device = _device(device_type)
    cfg = GPTConfig(**{**vars(PRESETS[size]), "tie_weights": True})
    torch.manual_seed(0)
    ref = GPT(cfg).to(device)
    model = _sharded(ref, _mesh(device_type), tied_units=True)
    r = _verdict(train_side_by_side(model, ref, steps, _batches(cfg, device), loss_fn), TOL["fp32"])
    r["still_tied"] = model.lm_head.weight is model.tok_emb.weight
    r["ok"] = r["ok"] and r["still_tied"]
    return r


def _safetensors(device_type: str, size: str, folder: str) -> dict[str, Any]:
    """A safetensors file loaded into the shards of a meta-device model."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        return {"ok": None, "skipped": "the safetensors package is not installed"}
    from fsdp_compose.safetensors_io import load_safetensors

    cfg = GPTConfig(**vars(PRESETS[size]))
    torch.manual_seed(0)
    ref = GPT(cfg)
    path = os.path.join(folder, f"gpt_w{dist.get_world_size()}.safetensors")
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
    dist.barrier()
    with torch.device("meta"):
        model = GPT(cfg)
    model = _sharded(model, _mesh(device_type))
    result = load_safetensors(model, path, device=_device(device_type))
    diff, where = max_param_diff(model, ref.to(_device(device_type)))
    devices = sorted({p.to_local().device.type for p in model.parameters()})
    return {
        "bytes_read": result.bytes_read,
        "param_diff": diff,
        "where": where,
        "shard_devices": devices,
        "ok": diff == 0.0 and devices == [device_type],
    }


def _intervals_exposed(comm: list[tuple[float, float]], busy: list[tuple[float, float]]) -> float:
    """Time (same unit as the intervals) of ``comm`` covered by no ``busy`` interval."""
    exposed = 0.0
    for start, end in comm:
        cursor, hidden = start, 0.0
        for b0, b1 in sorted(busy):
            lo, hi = max(b0, cursor), min(b1, end)
            if hi > lo:
                hidden += hi - lo
                cursor = hi
        exposed += (end - start) - hidden
    return exposed


def _exposed_communication(device_type: str, size: str, steps: int) -> dict[str, Any]:
    """``trace.exposed_communication()`` against the profiler's view of overlap: the
    time of communication kernels (NCCL, or the copies of a gloo collective on a
    side stream) that no compute kernel on another stream overlaps."""
    from torch.profiler import ProfilerActivity, profile

    from fsdp_compose import trace

    device = _device(device_type)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**vars(PRESETS[size]))
    torch.manual_seed(0)
    model = _sharded(GPT(cfg).to(device), _mesh(device_type))
    batches = _batches(cfg, device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
    with profile(activities=activities) as prof, trace.recording(model) as timeline:
        for step in range(steps):
            x, y = batches(step)
            loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        if device_type == "cuda":
            torch.cuda.synchronize()
    ours = sum(timeline.exposed_communication().values())
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    comm = [e for e in kernels if "nccl" in e.name.lower()]
    compute = [e for e in kernels if e not in comm and "memcpy" not in e.name.lower()]
    theirs = (
        _intervals_exposed(
            [(e.time_range.start, e.time_range.end) for e in comm],
            [(e.time_range.start, e.time_range.end) for e in compute],
        )
        / 1e6
    )  # microseconds
    durations = [
        e["dur"] for e in timeline.events() if e.get("cat") in ("all_gather", "reduce_scatter")
    ]
    compared = bool(comm)
    close = abs(ours - theirs) <= max(0.5 * max(ours, theirs), 2e-3)
    return {
        "timeline_exposed_s": round(ours, 6),
        "profiler_exposed_s": round(theirs, 6) if compared else None,
        "profiler_comm_kernels": len(comm),
        "timeline_collectives": len(durations),
        "ok": ours >= 0.0 and all(d >= 0 for d in durations) and (close or not compared),
    }


def features_job(device_type: str, size: str, steps: int, folder: str) -> dict[str, Any]:
    """Sharded Muon, a tied embedding/LM head in separate units, safetensors into shards,
    the timeline's exposed communication against the profiler's."""
    results: dict[str, Any] = {"world": dist.get_world_size()}
    guarded(
        results,
        "exposed_communication",
        lambda: _exposed_communication(device_type, size, steps),
    )
    guarded(results, "muon_sharded_step", lambda: _muon(device_type, size, steps))
    guarded(results, "tied_embedding_separate_units", lambda: _tied(device_type, size, steps))
    guarded(
        results, "safetensors_load_into_shards", lambda: _safetensors(device_type, size, folder)
    )
    return results


def stress_job(device_type: str, size: str, steps: int) -> dict[str, Any]:
    """``steps`` bf16 training steps with prefetching and resharding; returns a
    digest of every loss and the final parameters (compared across runs)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.use_deterministic_algorithms(True, warn_only=True)
    device = _device(device_type)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**vars(PRESETS[size]))
    torch.manual_seed(0)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _sharded(
        GPT(cfg).to(device), _mesh(device_type), mp_policy=mp, offload_policy=OffloadPolicy()
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = _batches(cfg, device)
    digest = hashlib.sha256()
    losses = []
    start = time.perf_counter()
    # The math kernel: the fused attention backwards may be nondeterministic.
    with sdpa_kernel(SDPBackend.MATH):
        for step in range(steps):
            x, y = batches(step % 16)
            loss = loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    values = torch.stack(losses).float().cpu()
    digest.update(values.numpy().tobytes())
    for p in model.parameters():
        digest.update(p.detach().to_local().float().cpu().numpy().tobytes())
    return {
        "steps": steps,
        "seconds": round(time.perf_counter() - start, 3),
        "first_loss": values[0].item(),
        "last_loss": values[-1].item(),
        "digest": digest.hexdigest(),
        "launch_blocking": os.environ.get("CUDA_LAUNCH_BLOCKING", "0"),
    }


JOBS: dict[str, Callable[..., dict[str, Any]]] = {
    "parity": parity_job,
    "features": features_job,
    "stress": stress_job,
}
