"""Where FSDP2 + torchft breaks: several meshes, another thread's state dict, timeouts.

* ``test_all_reduce_hook_on_every_mesh``: a MoE-like model whose experts are
  sharded on a mesh of their own (per-parameter meshes). 2 replica groups x 2
  ranks (W=4): first an all-reduce hook per mesh (``set_all_reduce_hook_on_mesh(mesh,
  hook)``) averaging across the groups by hand, then the real thing through
  ``fsdp_compose.ft.enable_torchft`` (a lighthouse, a ``torchft.Manager`` per rank,
  asynchronous quorum). Gradients and parameters match one process on the global
  batch; torch's FSDP2 refuses the hook on such a module (recorded, not asserted).
* ``test_state_dict_from_another_thread_mid_step``: a thread takes ``state_dict()``
  and the torchft recovery state (``shard_state_dict``) while the main thread is
  inside a unit's forward, then inside its backward, and waits for it: the running
  unit keeps its unsharded parameters, the outputs and gradients equal an
  undisturbed step, the state dicts hold the shards, and the thread issues no
  collective. The same with torch's FSDP2 is recorded (not asserted).
* ``test_timeouts_*``: the timeout rule of ``fsdp_compose.ft`` and its errors.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_compose import FSDPModule, Observer, fully_shard
from fsdp_compose.ft import Timeouts, check_timeouts, shard_state_dict, torchft_timeouts

_E, _D, _H, _TOKENS, _STEPS, _LR = 4, 8, 6, 4, 3, 0.05


class _Experts(nn.Module):
    """Every token goes to every expert, weighted by a router (no expert parallel:
    what matters here is that the experts' weights live on a mesh of their own)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(_D, _E)
        self.w_in = nn.Parameter(torch.randn(_E, _D, _H) * 0.3)
        self.w_out = nn.Parameter(torch.randn(_E, _H, _D) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.softmax(self.router(x), dim=-1)
        h = torch.relu(torch.einsum("nd,edh->neh", x, self.w_in))
        return x + torch.einsum("neh,ehd,ne->nd", h, self.w_out, gate)


class _MoEModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(_D, _D)
        self.block = _Experts()
        self.head = nn.Linear(_D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x)))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4 * _TOKENS, _D, generator=torch.Generator().manual_seed(100 + step))


def _reference() -> list[dict[str, torch.Tensor]]:
    """Full parameters after each step of one process on the global batch."""
    torch.manual_seed(0)
    model = _MoEModel()
    optim = torch.optim.AdamW(model.parameters(), lr=_LR)
    out = []
    for step in range(_STEPS):
        model(_batch(step)).square().mean().backward()
        optim.step()
        optim.zero_grad()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


class _Threads(Observer):
    """Notes the thread that issues each collective."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def on_collective(self, event: Any, info: Any) -> None:
        if event == "issue":
            self.names.add(threading.current_thread().name)


def _groups(rank: int) -> tuple[int, int, dist.ProcessGroup, dist.ProcessGroup, dist.ProcessGroup]:
    """Replica group ``rank // 2`` of 2 ranks: its dense group, a second group over
    the same ranks for the experts' mesh, and the cross-group pair of this rank."""
    timeout = timedelta(seconds=40)
    dense = [dist.new_group([2 * g, 2 * g + 1], timeout=timeout) for g in range(2)]
    experts = [dist.new_group([2 * g, 2 * g + 1], timeout=timeout) for g in range(2)]
    across = [dist.new_group([r, r + 2]) for r in range(2)]
    group, group_rank = divmod(rank, 2)
    return group, group_rank, dense[group], experts[group], across[group_rank]


def _mesh_of(group: dist.ProcessGroup) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, "cpu")


def _sharded_moe(
    shard: Any, dense_group: dist.ProcessGroup, expert_group: dist.ProcessGroup
) -> tuple[nn.Module, Any, Any]:
    """The model sharded by ``shard`` (fsdp_compose's or torch's fully_shard), the
    experts on their own mesh; returns it and the two meshes."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    dense_mesh, expert_mesh = _mesh_of(dense_group), _mesh_of(expert_group)
    torch.manual_seed(0)
    model = _MoEModel()
    experts = {model.block.w_in, model.block.w_out}
    info = FSDPMeshInfo(expert_mesh, shard_mesh_dim=0)

    def placement(param: nn.Parameter) -> Any:
        return ShardPlacementResult(Shard(0), info) if param in experts else None

    shard(model.block, mesh=dense_mesh, shard_placement_fn=placement)
    shard(model, mesh=dense_mesh)
    return model, dense_mesh, expert_mesh


def _fsdp2_hook_outcome(dense: dist.ProcessGroup, experts: dist.ProcessGroup) -> str:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    try:
        model, _, _ = _sharded_moe(torch_fully_shard, dense, experts)
        model.block.set_all_reduce_hook(lambda t: None)
        return "accepted"
    except Exception as e:  # recorded for the comparison
        return f"{type(e).__name__}: {e}"


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach() for n, p in model.named_parameters()}


def _hook_per_mesh_run(
    dense: dist.ProcessGroup, experts: dist.ProcessGroup, across: dist.ProcessGroup, dp_rank: int
) -> dict[str, Any]:
    """One hook per mesh, each averaging across the replica groups by hand."""
    model, dense_mesh, expert_mesh = _sharded_moe(fully_shard, dense, experts)
    calls = {"dense": 0, "experts": 0}

    def across_groups(kind: str) -> Any:
        def hook(output: torch.Tensor) -> None:
            calls[kind] += 1
            dist.all_reduce(output, group=across)
            output.div_(2)

        return hook

    block = model.block
    assert isinstance(block, FSDPModule) and isinstance(model, FSDPModule)
    block.set_all_reduce_hook_on_mesh(dense_mesh, across_groups("dense"))
    block.set_all_reduce_hook_on_mesh(expert_mesh, across_groups("experts"))
    model.set_all_reduce_hook(across_groups("dense"))
    try:
        block.set_all_reduce_hook_on_mesh(_mesh_of(across), lambda t: None)
        wrong_mesh = "accepted"
    except ValueError:
        wrong_mesh = "ValueError"
    optim = torch.optim.AdamW(model.parameters(), lr=_LR)
    params = []
    for step in range(_STEPS):
        rows = slice(dp_rank * _TOKENS, (dp_rank + 1) * _TOKENS)
        model(_batch(step)[rows]).square().mean().backward()
        optim.step()
        optim.zero_grad()
        params.append(_full_params(model))
    return {"calls": calls, "wrong_mesh": wrong_mesh, "params": params}


def _torchft_run(
    dense: dist.ProcessGroup, experts: dist.ProcessGroup, group: int, group_rank: int
) -> dict[str, Any]:
    """The same training through enable_torchft: a lighthouse on rank 0, a store per
    replica group, a Manager per rank with the asynchronous quorum."""
    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer

    from fsdp_compose.ft import _timeouts_in_use, enable_torchft

    rank = dist.get_rank()
    lighthouse = None
    stores: list[dist.TCPStore] = []
    if rank == 0:
        lighthouse = LighthouseServer(
            bind="[::]:0", min_replicas=2, join_timeout_ms=200, heartbeat_timeout_ms=2000
        )
        stores = [dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
                  for _ in range(2)]  # fmt: skip
    shared = [lighthouse.address() if lighthouse else None, [s.port for s in stores]]
    dist.broadcast_object_list(shared, src=0)
    address, ports = shared
    model, dense_mesh, expert_mesh = _sharded_moe(fully_shard, dense, experts)
    optim = torch.optim.AdamW(model.parameters(), lr=_LR)
    timeouts = torchft_timeouts(timedelta(seconds=10), quorum=timedelta(seconds=30))
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeouts.process_group),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=2,
        use_async_quorum=True,
        init_sync=False,  # both groups start from the same seed
        timeout=timeouts.manager,
        quorum_timeout=timeouts.quorum,
        connect_timeout=timedelta(seconds=10),
        rank=group_rank,
        world_size=2,
        store_addr="localhost",
        store_port=ports[group],
        lighthouse_addr=address,
        replica_id=f"group{group}",
    )
    threads = _Threads()
    assert isinstance(model, FSDPModule)
    model.register_observer(threads)
    out: dict[str, Any] = {"params": [], "participants": []}
    try:
        out["timeouts"] = _timeouts_in_use(manager, [dense_mesh, expert_mesh])
        ft = enable_torchft(model, optim, manager, replica_group=group, num_replica_groups=2)
        rows = slice(ft.dp_rank * _TOKENS, (ft.dp_rank + 1) * _TOKENS)
        out["dp"] = (ft.dp_rank, ft.dp_size)
        while manager.current_step() < _STEPS:
            ft.optimizer.zero_grad()  # starts the quorum; the forward runs alongside it
            step = manager.current_step()
            model(_batch(step)[rows]).square().mean().backward()
            ft.optimizer.step()
            assert manager.current_step() == step + 1, "a step without failure did not commit"
            out["participants"].append(manager.num_participants())
            out["params"].append(_full_params(model))
        out["collective_threads"] = sorted(threads.names)
    finally:
        model.unregister_observer(threads)
        dist.barrier()  # every rank is done with the quorum before the lighthouse goes
        manager.shutdown(wait=False)
        dist.barrier()
        if lighthouse is not None:
            lighthouse.shutdown()
    return out


def _every_mesh_job() -> dict[str, Any]:
    rank = dist.get_rank()
    group, group_rank, dense, experts, across = _groups(rank)
    return {
        "fsdp2": _fsdp2_hook_outcome(dense, experts),
        "by_hand": _hook_per_mesh_run(dense, experts, across, rank),
        "torchft": _torchft_run(dense, experts, group, group_rank),
    }


def _assert_params(got: list[dict[str, torch.Tensor]], ref: list[dict[str, torch.Tensor]]) -> None:
    assert len(got) == len(ref)
    for step, (g, r) in enumerate(zip(got, ref)):
        for name in r:
            torch.testing.assert_close(g[name], r[name], atol=1e-5, rtol=0, msg=f"{step} {name}")


def test_all_reduce_hook_on_every_mesh() -> None:
    pytest.importorskip("torchft")
    results = run_distributed(_every_mesh_job, 4, timeout=180)
    reference = _reference()
    print("torch FSDP2, set_all_reduce_hook on a module with two meshes:", results[0]["fsdp2"])
    for rank, r in enumerate(results):
        by_hand = r["by_hand"]
        # one call per unit and step: the root and the block on the dense mesh, the
        # block's experts on theirs
        assert by_hand["calls"] == {"dense": 2 * _STEPS, "experts": _STEPS}, by_hand["calls"]
        assert by_hand["wrong_mesh"] == "ValueError"
        _assert_params(by_hand["params"], reference)
        ft = r["torchft"]
        assert ft["dp"] == (rank, 4)
        assert ft["participants"] == [2] * _STEPS
        assert ft["timeouts"] == Timeouts(
            process_group=timedelta(seconds=10),
            manager=timedelta(seconds=10),
            quorum=timedelta(seconds=30),
            replica_group=timedelta(seconds=40),
        )
        # the quorum and recovery threads issue none of the model's collectives
        assert ft["collective_threads"] == ["MainThread"], ft["collective_threads"]
        _assert_params(ft["params"], reference)
        for step in range(_STEPS):  # the groups hold the same parameters, bit for bit
            other = results[(rank + 2) % 4]["torchft"]["params"][step]
            for name, value in ft["params"][step].items():
                assert torch.equal(value, other[name]), (rank, step, name)


# -- state_dict() from another thread while a step runs -------------------------


def _two_linear_blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(3))
    )


def _probe_mid_step(shard: Any, threads: _Threads | None) -> dict[str, Any]:
    """Runs two steps; in the second, a thread takes the state dicts from inside
    block 1's forward and block 0's backward while the main thread waits for it."""
    model = _two_linear_blocks()
    for block in model:
        shard(block)
    shard(model)
    if threads is not None:
        model.register_observer(threads)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    rank = dist.get_rank()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    optim.step()  # so that the optimizer has state to send
    optim.zero_grad()
    idle = {n: t.to_local().clone() for n, t in model.state_dict().items()}
    idle_optim = shard_state_dict(model, optim)["optim"]
    taken: dict[str, Any] = {}

    def take(where: str) -> None:
        def run() -> None:
            try:
                taken[where] = (model.state_dict(), shard_state_dict(model, optim))
            except Exception as e:  # recorded for the assertion
                taken[where] = e

        thread = threading.Thread(target=run, name=f"recovery-{where}")
        thread.start()
        thread.join()

    seen: dict[str, bool] = {}

    def mid_forward(module: nn.Module, args: Any) -> None:
        take("forward")
        seen["forward_unsharded"] = not isinstance(module.weight, DTensor)

    def mid_backward(module: nn.Module, grad: Any) -> None:
        take("backward")
        seen["backward_unsharded"] = not isinstance(module.weight, DTensor)

    handles = [
        model[1][2].register_forward_pre_hook(mid_forward),
        model[0][2].register_full_backward_pre_hook(mid_backward),
    ]
    out: dict[str, Any] = {}
    try:
        loss = model(x).sum()
        loss.backward()
        out["loss"] = loss.item()
    except Exception as e:  # FSDP2's outcome is recorded, not raised
        out["error"] = f"{type(e).__name__}: {e}"
    for h in handles:
        h.remove()
    out["grads"] = {
        n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None
    }
    optim.zero_grad()
    undisturbed = model(x).sum()
    undisturbed.backward()
    out["undisturbed_loss"] = undisturbed.item()
    out["undisturbed_grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    out["seen"] = seen
    out["taken"] = {}
    for where, value in taken.items():
        if isinstance(value, Exception):
            out["taken"][where] = f"{type(value).__name__}: {value}"
            continue
        sd, ft_sd = value
        out["taken"][where] = {
            "all_shards": all(isinstance(t, DTensor) for t in sd.values()),
            "model_equal": all(torch.equal(sd[n].to_local(), v) for n, v in idle.items())
            and all(torch.equal(ft_sd["model"][n], v) for n, v in idle.items()),
            "optim_equal": _tree_equal(ft_sd["optim"], idle_optim),
        }
    if threads is not None:
        model.unregister_observer(threads)
    return out


def _tree_equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_tree_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_tree_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return bool(a == b)


def _mid_step_job() -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    threads = _Threads()
    ours = _probe_mid_step(fully_shard, threads)
    ours["collective_threads"] = sorted(threads.names)
    root = fully_shard(nn.Sequential(fully_shard(nn.Linear(8, 8))))  # no parameters of its own
    root.set_all_reduce_hook(lambda t: None)  # accepted, as in FSDP2: nothing to hook
    try:
        fsdp2: dict[str, Any] = _probe_mid_step(torch_fully_shard, None)
    except Exception as e:  # recorded for the comparison
        fsdp2 = {"error": f"{type(e).__name__}: {e}", "seen": {}, "taken": {}}
    return {"ours": ours, "fsdp2": fsdp2}


def test_state_dict_from_another_thread_mid_step() -> None:
    results = run_distributed(_mid_step_job, 2, timeout=120)
    for r in results:
        ours = r["ours"]
        assert "error" not in ours, ours["error"]
        assert ours["seen"] == {"forward_unsharded": True, "backward_unsharded": True}
        for where in ("forward", "backward"):
            taken = ours["taken"][where]
            assert taken == {"all_shards": True, "model_equal": True, "optim_equal": True}, (
                where,
                taken,
            )
        assert ours["loss"] == ours["undisturbed_loss"]
        assert ours["grads"].keys() == ours["undisturbed_grads"].keys()
        for name, grad in ours["grads"].items():
            assert torch.equal(grad, ours["undisturbed_grads"][name]), name
        # the state dicts' threads issued no collective: only the main thread did
        assert ours["collective_threads"] == ["MainThread"], ours["collective_threads"]
    fsdp2 = results[0]["fsdp2"]
    print(
        "torch FSDP2, state_dict() from a thread mid-step:",
        fsdp2.get("error", "no error"),
        fsdp2["seen"],
        fsdp2["taken"],
    )


# -- timeouts ---------------------------------------------------------------------


def test_timeouts_chosen_consistently() -> None:
    s = timedelta(seconds=1)
    t = torchft_timeouts(10 * s)
    assert t == Timeouts(process_group=10 * s, manager=10 * s, quorum=20 * s, replica_group=20 * s)
    assert torchft_timeouts(10 * s, quorum=10 * s).quorum == 10 * s
    check_timeouts(
        Timeouts(process_group=5 * s, manager=10 * s, quorum=60 * s, replica_group=11 * s)
    )


@pytest.mark.parametrize(
    ("timeouts", "fix"),
    [
        ((20, 10, 60, 60), r"set Manager\(timeout=\) to at least 0:00:20"),
        ((10, 10, 5, 60), r"set Manager\(quorum_timeout=\) to at least 0:00:10"),
        ((10, 10, 60, 10), r"init_process_group\(timeout=\) above 0:00:10"),
        ((10, 30, 60, 20), r"init_process_group\(timeout=\) above 0:00:30"),
    ],
)
def test_timeouts_inconsistent(timeouts: tuple[int, int, int, int], fix: str) -> None:
    pg, manager, quorum, group = (timedelta(seconds=v) for v in timeouts)
    with pytest.raises(ValueError, match=fix):
        check_timeouts(
            Timeouts(process_group=pg, manager=manager, quorum=quorum, replica_group=group)
        )
    with pytest.raises(ValueError, match="quorum_timeout"):
        torchft_timeouts(timedelta(seconds=10), quorum=timedelta(seconds=5))
