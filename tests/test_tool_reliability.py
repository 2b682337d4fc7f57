"""The tools beyond FSDP2 under bad input and faults: whole-matrix optimizers,
safetensors I/O and auto-wrap end in a clear exception on every rank (or behave
correctly), never in a silently wrong result, a hang or a dead process group."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch import nn

from fsdp_compose import enable_sharded_step, fully_shard


def _square_model(seed: int = 0, n: int = 4) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(n)])
    for layer in model:
        fully_shard(layer)
    return fully_shard(model)


def _backward(model: nn.Module) -> None:
    torch.manual_seed(0)
    model(torch.randn(3, 8)).sum().backward()


def _pg_usable() -> bool:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item() == dist.get_world_size()


def _muon_disagreement_job(case: str, optim: str = "Muon") -> dict:
    rank = dist.get_rank()
    model = _square_model()
    if case in ("order_named", "order"):  # the same shapes, another order on rank 1
        named = list(model.named_parameters() if case == "order_named" else model.parameters())
        params = named[::-1] if rank == 1 else named
    elif case == "shapes":  # rank 1 forgets a matrix: the shapes no longer line up
        params = list(model.parameters())[: 3 if rank == 1 else 4]
    else:  # "grads": same optimizer, a matrix without a gradient on rank 1 at step 2
        params = list(model.parameters())
    opt = enable_sharded_step(getattr(torch.optim, optim)(params, lr=0.1))
    error, kind = "", ""
    steps = 0
    before: list[torch.Tensor] = []
    for step in range(3):
        opt.zero_grad()
        _backward(model)
        if case == "grads" and step == 2 and rank == 1:
            model[1].weight.grad = None
        before = [p.detach().to_local().clone() for p in model.parameters()]
        start = time.monotonic()
        try:
            opt.step()
        except RuntimeError as exc:
            error, kind, elapsed = str(exc), type(exc).__name__, time.monotonic() - start
            break
        steps += 1
    unchanged = all(
        torch.equal(b, p.detach().to_local()) for b, p in zip(before, model.parameters())
    )
    return {
        "error": error,
        "kind": kind,
        "steps": steps,
        "fast": bool(error) and elapsed < 10,
        "unchanged": unchanged,
        "pg_usable": _pg_usable(),
    }


@pytest.mark.parametrize(
    "case,optim",
    [
        ("order_named", "Muon"),
        ("order", "Muon"),
        ("order", "Adafactor"),
        ("shapes", "Muon"),
        ("grads", "Muon"),
        ("grads", "Adafactor"),
    ],
)
def test_optimizer_ranks_disagreeing_on_matrices_raise_on_every_rank(case: str, optim: str) -> None:
    """Ranks whose Muon (or Adafactor) holds other matrices (order, shapes, which
    have gradients) raise the same error naming the first differing matrix before
    any data moves, within seconds; nothing is updated and the process group
    stays usable. Matrices of one shape in another order are named even for an
    optimizer built from model.parameters() (the runtime's names for them)."""
    results = run_distributed(_muon_disagreement_job, 2, case, optim)
    assert results[0]["error"] == results[1]["error"], results
    for r in results:
        assert "disagree" in r["error"] and "at matrix" in r["error"], r
        assert r["kind"] == "CollectiveMismatchError", r
        label = "muon.exchange" if optim == "Muon" else "adafactor.step"
        assert f"Their {label} collectives would not match" in r["error"], r
        assert r["fast"] and r["unchanged"] and r["pg_usable"], r
        assert r["steps"] == (2 if case == "grads" else 0), r
    if case in ("order_named", "order"):
        assert "'0.weight'" in results[0]["error"] and "'3.weight'" in results[0]["error"]
    if case == "grads":
        assert "without a gradient" in results[0]["error"]


def _muon_plan_cache_job(steps: int) -> dict:
    from fsdp_compose.whole_matrix import _muon

    model = _square_model(n=6)
    params = list(model.parameters())
    opt = enable_sharded_step(torch.optim.Muon(params, lr=0.01))
    sizes = []
    for step in range(steps):
        opt.zero_grad()
        _backward(model)
        for k, p in enumerate(params):  # a different set of matrices with gradients each step
            if (step >> k) & 1:
                p.grad = None
        opt.step()
        cache = _muon._caches[opt]
        sizes.append((len(cache.plans), len(cache.digests)))
    pools = {id(p.pool) for p in _muon._caches[opt].plans.values()}
    return {
        "max": max(sizes),
        "last": sizes[-1],
        "pools": len(pools),
        "bound": _muon.PLAN_CACHE_SIZE,
    }


def test_muon_plan_cache_is_bounded() -> None:
    """Over three cycles of steps whose set of matrices with gradients keeps
    changing (64 steps a cycle, 63 different sets, far more than PLAN_CACHE_SIZE:
    every plan is evicted and rebuilt), the plans and digests kept stay at
    PLAN_CACHE_SIZE, and the plans share one buffer pool."""
    for r in run_distributed(_muon_plan_cache_job, 2, 3 * 64, timeout=300):
        bound = r["bound"]
        assert r["max"] == (bound, bound) and r["last"] == (bound, bound), r
        assert r["pools"] == 1, r


def _save_into_file_job(tmp: str) -> dict:
    from fsdp_compose.safetensors_io import save_safetensors

    model = _square_model(n=2)
    path = os.path.join(tmp, "model.safetensors")  # a file where a directory is expected
    if dist.get_rank() == 0:
        with open(path, "wb") as f:
            f.write(b"previous")
    dist.barrier()
    start = time.monotonic()
    try:
        save_safetensors(model, path)
        error = ""
    except (ValueError, RuntimeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    elapsed = time.monotonic() - start
    usable = _pg_usable()
    with open(path, "rb") as f:
        intact = f.read() == b"previous"
    saved = save_safetensors(model, os.path.join(tmp, "out"))  # the next save works
    return {
        "error": error,
        "fast": elapsed < 5,
        "usable": usable,
        "intact": intact,
        "saved": len(saved) == (1 if dist.get_rank() == 0 else 0),
    }


def test_save_safetensors_into_a_file_path_fails_on_every_rank(tmp_path) -> None:
    """An existing file as out_dir: every rank raises at once (rank 0 a ValueError
    naming the path and the fix, the others quoting it), the file is left as it
    was, and the process group serves the next collective and the next save."""
    pytest.importorskip("safetensors")
    results = run_distributed(_save_into_file_job, 2, str(tmp_path))
    assert results[0]["error"].startswith("ValueError") and "not a directory" in results[0]["error"]
    assert results[1]["error"].startswith("RuntimeError") and "rank 0" in results[1]["error"]
    for r in results:
        assert r["fast"] and r["usable"] and r["intact"] and r["saved"], r


def _export_bad_read_job(tmp: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from fsdp_compose.safetensors_io import export_dcp_to_safetensors

    ckpt = os.path.join(tmp, "dcp")
    dcp.save({"model.w": torch.ones(4, 4)}, checkpoint_id=ckpt)
    source = ckpt if dist.get_rank() == 0 else os.path.join(tmp, "missing")
    start = time.monotonic()
    try:
        export_dcp_to_safetensors(source, os.path.join(tmp, "out"))
        error = ""
    except (ValueError, RuntimeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {
        "error": error,
        "fast": time.monotonic() - start < 5,
        "usable": _pg_usable(),
        "published": os.path.exists(os.path.join(tmp, "out", "model.safetensors")),
    }


def test_export_with_a_failing_read_on_one_rank_fails_on_every_rank(tmp_path) -> None:
    pytest.importorskip("safetensors")
    results = run_distributed(_export_bad_read_job, 2, str(tmp_path))
    assert results[1]["error"].startswith("ValueError") and "missing" in results[1]["error"]
    assert results[0]["error"].startswith("RuntimeError") and "rank 1" in results[0]["error"]
    for r in results:
        assert r["fast"] and r["usable"] and not r["published"], r


def test_load_safetensors_file_replaced_while_loading(tmp_path, monkeypatch) -> None:
    """The file is replaced by one with fewer rows after its header was checked:
    a clear error naming the tensor and both shapes, not a broadcast short slice."""
    st = pytest.importorskip("safetensors.torch")
    from fsdp_compose.safetensors_io import _load, load_safetensors

    path = str(tmp_path / "model.safetensors")
    st.save_file({"weight": torch.randn(4, 3), "bias": torch.randn(4)}, path)
    checked = _load.read_headers

    def read_then_replace(p: object) -> object:
        entries = checked(p)
        st.save_file({"weight": torch.randn(1, 3), "bias": torch.randn(4)}, path)
        return entries

    monkeypatch.setattr(_load, "read_headers", read_then_replace)
    model = nn.Linear(3, 4)
    with pytest.raises(ValueError, match=r"'weight'.*shape \[1, 3\].*shape \[4, 3\].*replaced"):
        load_safetensors(model, path)


def _auto_wrap_atomic_job() -> dict:
    from torch.distributed.tensor import DTensor, Shard

    from fsdp_compose import FSDPModule, auto_wrap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3), nn.Linear(3, 4))
    before = [(n, id(p), p.clone()) for n, p in model.named_parameters()]

    def bad_placement(p: nn.Parameter) -> Shard | None:
        return Shard(1) if tuple(p.shape) == (4, 3) else None  # 3 columns over 2 ranks

    try:
        auto_wrap(model, {nn.Linear}, shard_placement_fn=bad_placement)
        error = ""
    except (ValueError, NotImplementedError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    untouched = not any(isinstance(m, FSDPModule) for m in model.modules()) and all(
        id(p) == i and type(p) is nn.Parameter and torch.equal(p, v)
        for (_, i, v), (_, p) in zip(before, model.named_parameters())
    )
    no_hooks = all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    units = auto_wrap(model, {nn.Linear})  # the retry, without the bad placement
    retried = len(units) == 4 and all(isinstance(p, DTensor) for p in model.parameters())
    loss = model(torch.randn(2, 4)).sum()
    loss.backward()
    return {"error": error, "untouched": untouched, "no_hooks": no_hooks, "retried": retried}


def test_auto_wrap_is_atomic() -> None:
    """A unit that fails in the middle of a plan leaves no module annotated (no
    class swap, no hooks, the same parameter objects and values), and the retry
    with the fix succeeds and trains."""
    for r in run_distributed(_auto_wrap_atomic_job, 2):
        assert "(4, 3)" in r["error"] or "[4, 3]" in r["error"] or "divisible" in r["error"], r
        assert r["untouched"] and r["no_hooks"] and r["retried"], r


def _newton_schulz_fails_job() -> dict:
    from fsdp_compose.whole_matrix import _muon

    model = _square_model()
    params = list(model.parameters())
    opt = enable_sharded_step(torch.optim.Muon(params, lr=0.1))
    _backward(model)
    before = [p.full_tensor() for p in params]
    real = _muon.newton_schulz
    calls = [0]

    def failing(*args: object, **kwargs: object) -> torch.Tensor:
        calls[0] += 1
        if dist.get_rank() == 1 and calls[0] == 1:  # rank 1's first matrix (matrix 1)
            raise torch.OutOfMemoryError("injected failure")
        return real(*args, **kwargs)

    _muon.newton_schulz = failing
    start = time.monotonic()
    try:
        opt.step()
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    finally:
        _muon.newton_schulz = real
    elapsed = time.monotonic() - start
    after = [p.full_tensor() for p in params]
    changed = [not torch.equal(a, b) for a, b in zip(after, before)]
    opt.zero_grad()
    _backward(model)
    opt.step()  # training goes on
    return {"error": error, "fast": elapsed < 10, "changed": changed, "usable": _pg_usable()}


def test_newton_schulz_failing_on_its_owner_raises_on_every_rank() -> None:
    """Newton-Schulz raises on the owner of one matrix: every rank finishes the
    exchange, skips that matrix (unchanged everywhere), applies the others and
    raises the same error quoting the owner's, within seconds; the next step runs."""
    results = run_distributed(_newton_schulz_fails_job, 2)
    assert results[0]["error"] == results[1]["error"], results
    for r in results:
        assert "rank 1" in r["error"] and "injected failure" in r["error"], r
        assert r["fast"] and r["usable"], r
        assert r["changed"] == [True, False, True, True], r


def _muon_subclass_job() -> str:
    class MyMuon(torch.optim.Muon):
        pass

    model = _square_model(n=2)
    try:
        enable_sharded_step(MyMuon(model.parameters(), lr=0.1))
    except ValueError as exc:
        return str(exc)
    return ""


def test_muon_subclass_is_refused_not_silently_slow() -> None:
    """A subclass of torch.optim.Muon may change the update: enable_sharded_step
    refuses it with the reason, rather than quietly keeping the DTensor path."""
    for message in run_distributed(_muon_subclass_job, 2):
        assert "MyMuon" in message and "not subclasses" in message, message


def _map_full_matrices_mismatch_job() -> dict:
    from fsdp_compose.whole_matrix import map_full_matrices

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6, bias=False), nn.Linear(6, 8, bias=False))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    matrices = [p.detach() for p in model.parameters()]
    if dist.get_rank() == 1:
        matrices = matrices[::-1]
    start = time.monotonic()
    try:
        map_full_matrices(matrices, lambda i, full: full)
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    return {"error": error, "fast": time.monotonic() - start < 10, "usable": _pg_usable()}


def test_map_full_matrices_with_other_shapes_on_one_rank_raises_everywhere() -> None:
    results = run_distributed(_map_full_matrices_mismatch_job, 2)
    assert results[0]["error"] == results[1]["error"], results
    for r in results:
        assert "matrices[0]" in r["error"] and "(6, 8)" in r["error"], r
        assert r["fast"] and r["usable"], r


def _load_fails_on_one_rank_job(tmp: str, case: str) -> dict:
    import safetensors.torch as st

    from fsdp_compose.safetensors_io import _load, load_safetensors

    rank = dist.get_rank()
    model = _square_model(n=2)
    good = os.path.join(tmp, f"good{rank}.safetensors")
    values = {f"{i}.weight": torch.full((8, 8), float(i + 1)) for i in range(2)}
    st.save_file(values, good)
    path = good
    if case == "corrupt" and rank == 1:  # rank 1's copy is not a safetensors file
        path = os.path.join(tmp, "corrupt.safetensors")
        with open(path, "wb") as f:
            f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    checked = _load.read_headers
    if case == "replaced" and rank == 1:  # replaced after its headers were checked

        def read_then_replace(p: object) -> object:
            entries = checked(p)
            st.save_file({k: torch.zeros(1, 8) for k in values}, good)
            return entries

        _load.read_headers = read_then_replace  # type: ignore[assignment]
    before = [p.detach().to_local().clone() for p in model.parameters()]
    start = time.monotonic()
    try:
        load_safetensors(model, path)
        error = ""
    except (ValueError, RuntimeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        _load.read_headers = checked  # type: ignore[assignment]
    elapsed = time.monotonic() - start
    unchanged = all(
        torch.equal(b, p.detach().to_local()) for b, p in zip(before, model.parameters())
    )
    usable = _pg_usable()
    st.save_file(values, good)
    load_safetensors(model, good)  # the retry loads
    loaded = all(
        torch.all(p.full_tensor() == i + 1).item() for i, p in enumerate(model.parameters())
    )
    return {
        "error": error,
        "fast": elapsed < 10,
        "unchanged": unchanged,
        "usable": usable,
        "loaded": loaded,
    }


@pytest.mark.parametrize("case", ["corrupt", "replaced"])
def test_load_safetensors_failing_on_one_rank_raises_on_every_rank(tmp_path, case: str) -> None:
    """Rank 1's file is corrupt (checked before anything changes) or replaced
    while loading (found while copying): rank 1 raises its ValueError naming the
    file or tensor, rank 0 a RuntimeError quoting it, within seconds; the
    process group stays usable and a retry loads."""
    pytest.importorskip("safetensors")
    results = run_distributed(_load_fails_on_one_rank_job, 2, str(tmp_path), case)
    assert results[1]["error"].startswith("ValueError"), results
    assert "corrupt.safetensors" in results[1]["error"] or "'0.weight'" in results[1]["error"]
    assert results[0]["error"].startswith("RuntimeError") and "rank 1" in results[0]["error"]
    assert ("nothing was loaded" if case == "corrupt" else "load again") in results[0]["error"]
    for r in results:
        assert r["fast"] and r["usable"] and r["loaded"], r
    if case == "corrupt":  # refused before any tensor was modified, on every rank
        assert results[0]["unchanged"] and results[1]["unchanged"], results


class _TwoExperts(nn.Module):
    """Two experts in one unit; each rank routes its tokens to the experts of ``route``."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(4, 4, bias=False) for _ in range(2)])

    def forward(self, x: torch.Tensor, route: list[int]) -> torch.Tensor:
        return sum(self.experts[e](x) for e in route)  # type: ignore[return-value]


def _unused_expert_job(mode: str) -> dict:
    import warnings

    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_compose import debug

    rank = dist.get_rank()
    routes = [[0, 1], [0]] if mode == "debug_one_sided" else [[0], [1]]
    torch.manual_seed(0)
    ref = _TwoExperts()
    ours, theirs = _TwoExperts(), _TwoExperts()
    ours.load_state_dict(ref.state_dict())
    theirs.load_state_dict(ref.state_dict())
    fully_shard(ours)
    torch_fully_shard(theirs)
    if mode == "fixed":
        ours.set_reduce_scatter_unused_params(True)
    x = torch.randn(3, 4) + rank
    xs = [torch.empty_like(x) for _ in range(2)]
    dist.all_gather(xs, x)
    for r in range(2):  # single-process reference: mean over both ranks' losses
        (ref(xs[r], routes[r]).sum() / 2).backward()
    error = ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if mode.startswith("debug"):
                with debug.collective_checks(ours, timeout=20):
                    ours(x, routes[rank]).sum().backward()
            else:
                ours(x, routes[rank]).sum().backward()
        except RuntimeError as exc:
            error = f"{type(exc).__name__}: {exc}"
    messages = [str(w.message) for w in caught if "fsdp_compose" in str(w.message)]
    out = {"error": error, "warnings": messages, "usable": _pg_usable()}
    if not error:
        theirs(x, routes[rank]).sum().backward()

        def local_grads(model: nn.Module) -> list[torch.Tensor]:
            return [
                p.grad.to_local() if p.grad is not None else torch.zeros_like(p.to_local())
                for p in model.parameters()
            ]

        expected = [q.grad.chunk(2)[rank] for q in ref.parameters()]
        out["ref_diff"] = max(
            (a - b).abs().max().item() for a, b in zip(local_grads(ours), expected)
        )
        out["same_as_fsdp2"] = all(
            torch.equal(a, b) for a, b in zip(local_grads(ours), local_grads(theirs))
        )
    return out


@pytest.mark.parametrize("mode", ["default", "fixed", "debug", "debug_one_sided"])
def test_expert_unused_on_one_rank(mode: str) -> None:
    """Two experts in one unit, each getting tokens on one rank only. By default
    the gradients are FSDP2's (the same collectives, silently mixed), with a
    warning on each rank naming the expert without a gradient and the fix;
    with set_reduce_scatter_unused_params(True) they match one process; in debug
    mode every rank raises, naming the experts, before the reduce-scatter (also
    where the sizes differ)."""
    results = run_distributed(_unused_expert_job, 2, mode)
    for rank, r in enumerate(results):
        assert r["usable"], r
        if mode == "default":
            assert r["same_as_fsdp2"] and r["ref_diff"] > 0.1, r
            assert len(r["warnings"]) == 1, r
            unused = f"experts.{1 - rank}.weight"
            assert unused in r["warnings"][0], r
            assert "set_reduce_scatter_unused_params(True)" in r["warnings"][0], r
        elif mode == "fixed":
            assert r["ref_diff"] < 1e-6 and not r["warnings"], r
        else:
            assert r["error"].startswith("CollectiveMismatchError"), r
            assert "experts.1.weight" in r["error"], r
            assert "set_reduce_scatter_unused_params(True)" in r["error"], r
    if mode == "debug":
        assert results[0]["error"] == results[1]["error"]
        assert "experts.0.weight" in results[0]["error"]
