"""Every collective fsdp_compose issues goes through the runtime's launch path.

* Layout: no ``torch.distributed`` collective is called in ``fsdp_compose/``
  outside ``fsdp_compose/_runtime/`` (checked on the AST).
* Debug mode sees the tools' collectives: a rank that skips a Muon step makes
  every rank raise ``CollectiveMismatchError`` naming the exchange, within
  seconds, on gloo and on torch's threaded process group; one that orders its
  matrices differently gets the same error from Muon's agreement, before any
  exchange is issued.
* The timeline lists a Muon exchange and a safetensors export's collectives; with
  debug mode on as well, a valid program runs through.
"""

from __future__ import annotations

import ast
import os
import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch import nn

import fsdp_compose
from fsdp_compose import enable_sharded_step, fully_shard

PACKAGE = os.path.dirname(fsdp_compose.__file__)
_COLLECTIVE_PREFIXES = ("all_reduce", "all_gather", "all_to_all", "broadcast", "reduce_scatter")
_COLLECTIVE_NAMES = {
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "barrier",
    "monitored_barrier",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
}


def _is_collective(name: str) -> bool:
    return name.startswith(_COLLECTIVE_PREFIXES) or name in _COLLECTIVE_NAMES


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def collective_calls(source: str) -> list[str]:
    """The ``torch.distributed`` collectives (and functional-collective imports)
    that ``source`` calls or imports, as text."""
    tree = ast.parse(source)
    modules = {"torch.distributed"}  # names bound to torch.distributed
    functions: set[str] = set()  # names bound to one of its collectives
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if "_functional_collectives" in alias.name:
                    found.append(f"import {alias.name}")
                if alias.name == "torch.distributed" and alias.asname:
                    modules.add(alias.asname)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if "_functional_collectives" in full:
                    found.append(f"from {node.module} import {alias.name}")
                elif full == "torch.distributed":
                    modules.add(alias.asname or alias.name)
                elif node.module == "torch.distributed" and _is_collective(alias.name):
                    functions.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        imported = isinstance(func, ast.Name) and func.id in functions
        attribute = isinstance(func, ast.Attribute) and _is_collective(func.attr)
        if imported or (attribute and _dotted(func.value) in modules):  # type: ignore[attr-defined]
            found.append(ast.unparse(node))
    return found


def test_the_layout_check_finds_collectives() -> None:
    source = (
        "import torch.distributed as dist\n"
        "import torch\n"
        "from torch.distributed import all_to_all_single as a2a\n"
        "from torch.distributed import _functional_collectives\n"
        "dist.all_reduce(t)\n"
        "torch.distributed.send(t, dst=0)\n"
        "a2a(o, i)\n"
        "dist.get_rank()\n"
        "comms.all_reduce(t)\n"
    )
    found = collective_calls(source)
    assert any("_functional_collectives" in f for f in found), found
    assert "dist.all_reduce(t)" in found and "torch.distributed.send(t, dst=0)" in found, found
    assert "a2a(o, i)" in found and len(found) == 4, found


def test_no_collective_outside_the_runtime() -> None:
    """The tools, the checks and debug mode issue their collectives through the
    runtime (``ToolCollectives``), so observers see them all."""
    offenders = {}
    for root, _, files in os.walk(PACKAGE):
        rel_root = os.path.relpath(root, PACKAGE)
        if rel_root.split(os.sep)[0] == "_runtime":
            continue
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(root, name)) as f:
                    found = collective_calls(f.read())
                if found:
                    offenders[os.path.join(rel_root, name)] = found
    assert not offenders, offenders


# ---------------------------------------------------------------------------
# debug mode and the timeline see the tools' collectives
# ---------------------------------------------------------------------------


def _square_model(n: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
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


def _muon_skip_job() -> dict:
    """Rank 1 skips the second Muon step, in debug mode."""
    from fsdp_compose import debug

    rank = dist.get_rank()
    model = _square_model()
    opt = enable_sharded_step(torch.optim.Muon(model.parameters(), lr=0.1))
    error, kind, elapsed, steps = "", "", 0.0, 0
    with debug.collective_checks(model, timeout=20):
        for step in range(3):
            opt.zero_grad()
            start = time.monotonic()
            try:
                _backward(model)
                if not (rank == 1 and step == 1):
                    opt.step()
            except RuntimeError as exc:
                error, kind, elapsed = str(exc), type(exc).__name__, time.monotonic() - start
                break
            steps += 1
    return {
        "error": error,
        "kind": kind,
        "fast": bool(error) and elapsed < 10,
        "steps": steps,
        "usable": _pg_usable(),
    }


def _check_skip_results(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["kind"] == "CollectiveMismatchError", r
        assert "rank 0 issued all_reduce for muon.exchange" in r["error"], r
        assert "rank 1 issued all_gather" in r["error"], r
        # Rank 0 fails in its second step's Muon, rank 1 in its third forward.
        assert r["fast"] and r["steps"] == 1 + rank and r["usable"], r


def test_debug_names_a_skipped_muon_step_on_every_rank() -> None:
    _check_skip_results(run_distributed(_muon_skip_job, 2))


@pytest.mark.skipif(torch.__version__ < "2.13", reason="the threaded process group crashes")
def test_debug_names_a_skipped_muon_step_on_threaded_ranks() -> None:
    from test_backends import run_threaded

    _check_skip_results(run_threaded(2, _muon_skip_job, timeout=60.0))


def _muon_reorder_job() -> dict:
    """Rank 1 builds Muon from the matrices in another order, in debug mode."""
    from fsdp_compose import debug

    rank = dist.get_rank()
    model = _square_model()
    params = list(model.parameters())
    opt = enable_sharded_step(torch.optim.Muon(params[::-1] if rank else params, lr=0.1))
    error, kind, elapsed = "", "", 0.0
    with debug.collective_checks(model, timeout=20):
        _backward(model)
        start = time.monotonic()
        try:
            opt.step()
        except RuntimeError as exc:
            error, kind, elapsed = str(exc), type(exc).__name__, time.monotonic() - start
    return {
        "error": error,
        "kind": kind,
        "fast": bool(error) and elapsed < 10,
        "usable": _pg_usable(),
    }


def test_debug_names_a_reordered_muon_exchange_on_every_rank() -> None:
    """Matrices in another order on one rank would pair the wrong matrices in the
    exchange: every rank raises ``CollectiveMismatchError`` naming the exchange
    before any is issued, within seconds, and the process group stays usable."""
    results = run_distributed(_muon_reorder_job, 2)
    assert results[0]["error"] == results[1]["error"], results
    for r in results:
        assert r["kind"] == "CollectiveMismatchError", r
        assert "muon.exchange collectives would not match" in r["error"], r
        assert r["fast"] and r["usable"], r


def _trace_job(out_dir: str) -> dict:
    """A Muon step and a safetensors export, recorded, with debug mode on too."""
    from fsdp_compose import debug, trace
    from fsdp_compose.safetensors_io import save_safetensors

    model = _square_model()
    opt = enable_sharded_step(torch.optim.Muon(model.parameters(), lr=0.1))
    with trace.recording(model) as timeline, debug.collective_checks(model, timeout=20):
        _backward(model)
        opt.step()
        save_safetensors(model, out_dir)
    names = [e["name"] for e in timeline.events() if e.get("ph") == "X"]
    return {"names": names, "usable": _pg_usable()}


def test_the_timeline_lists_the_tools_collectives(tmp_path) -> None:
    for r in run_distributed(_trace_job, 2, str(tmp_path)):
        names = set(r["names"])
        assert "all_to_all muon.exchange" in names, names
        assert "all_reduce muon.exchange" in names, names  # the ranks' agreement
        assert "send_recv safetensors.export" in names, names
        assert "all_reduce safetensors.export" in names, names
        assert "wait all_to_all muon.exchange" in names, names
        assert r["usable"], r
