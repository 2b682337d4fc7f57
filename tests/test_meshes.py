"""Meshes: ``dp_mesh_dims`` on a full SPMD mesh (FSDP, HSDP, with tensor parallel)
against one process and torch's FSDP2, per-parameter meshes (MoE experts on an
expert-data-parallel mesh), and the data-parallel mesh fully_shard builds, shared by
the units of one layout and released with the model."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn
from dist_utils import run_distributed
from helpers import fake_process_group
from torch.distributed import fsdp as torch_fsdp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp._fully_shard import _fsdp_common
from torch.distributed.tensor import Replicate, distribute_module, distribute_tensor

from fsdp_compose import DataParallelMeshDims, fully_shard

# FSDP2 features newer than torch 2.11 (the oldest release supported): where the
# installed torch lacks them, the comparisons with torch's own fully_shard are left out.
TORCH_HAS_DP_MESH_DIMS = hasattr(torch_fsdp, "DataParallelMeshDims")
TORCH_HAS_PLACEMENT_RESULT = hasattr(_fsdp_common, "ShardPlacementResult")


def _spmd_linear(mesh: DeviceMesh) -> nn.Linear:
    """A linear layer whose parameters are replicated DTensors on all of ``mesh``."""
    m = nn.Linear(4, 4)
    for name, p in list(m.named_parameters()):
        placements = [Replicate()] * mesh.ndim
        setattr(m, name, nn.Parameter(distribute_tensor(p.detach(), mesh, placements)))
    return m


def test_dp_mesh_shared_by_units_and_released_with_the_model() -> None:
    # HSDP over (r, s) of an (r, s, tp) mesh: fully_shard concatenates the r and s
    # sub-meshes into one data-parallel mesh.
    from fsdp_compose._runtime import _compat

    dims = DataParallelMeshDims(shard="s", replicate="r")
    with fake_process_group(8, 3):
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("r", "s", "tp"))
        units = [fully_shard(_spmd_linear(mesh), mesh=mesh, dp_mesh_dims=dims) for _ in range(2)]
        built = list(_compat._spmd_meshes.values())
        assert len(built) == 1, built  # one mesh for both units, though each sliced anew
        dp_mesh = weakref.ref(built[0])
        del units, built, mesh
        gc.collect()
        assert dp_mesh() is None, "the mesh cache keeps a dropped model's mesh alive"
        assert len(_compat._spmd_meshes) == 0


def test_a_second_model_on_an_equal_mesh() -> None:
    # torch's DTensor may hand the second model's parameters the first, equal mesh
    # object (its spec caches): FSDP2 2.13, which compares mesh objects, refuses the
    # second fully_shard; fsdp_compose compares meshes by value and accepts it.
    dims = DataParallelMeshDims(shard="dp")
    with fake_process_group(4, 1):
        for _ in range(2):
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
            distribute_module(model, mesh)
            fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
            assert all(p.device_mesh == mesh for p in model.parameters())


def _max_diff(model: nn.Module, ref: nn.Module, *, grads: bool = False) -> float:
    """Largest difference of the sharded model's full parameters (or gradients)
    from the one-process reference's."""
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        ours, theirs = (
            (p.grad, ref_params[name].grad) if grads else (p.detach(), ref_params[name].detach())
        )
        worst = max(worst, (ours.full_tensor() - theirs).abs().max().item())
    return worst


def _step(*optimizers: torch.optim.Optimizer) -> None:
    for optim in optimizers:
        optim.step()
        optim.zero_grad()


# -- dp_mesh_dims: parameters as DTensors on the full SPMD mesh ------------------

_LAYOUTS = {
    # mesh dim names -> (shard, replicate) names; the remaining dim is tensor parallel
    "dp_tp": (("dp", "tp"), "dp", None),
    "tp_dp": (("tp", "dp"), "dp", None),
    "hsdp": (("rep", "dp"), "dp", "rep"),
}


class _SpmdMLP(nn.Module):
    """fc1 (column-parallel) -> relu -> fc2 (row-parallel) -> head, on DTensors."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate

        mesh = getattr(self, "spmd_mesh", None)
        if mesh is not None:
            x = DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim)
        y = self.fc2(torch.relu(self.fc1(x)))
        if mesh is not None:
            y = y.redistribute(mesh, [Replicate()] * mesh.ndim)
        out = self.head(y)
        return out.to_local() if mesh is not None else out


def _distribute(model: _SpmdMLP, mesh, tp_dim: int | None) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    tp_placements = {"fc1.weight": Shard(0), "fc1.bias": Shard(0), "fc2.weight": Shard(1)}
    for module_name, module in model.named_children():
        for name, p in list(module.named_parameters()):
            placements = [Replicate()] * mesh.ndim
            if tp_dim is not None:
                placements[tp_dim] = tp_placements.get(f"{module_name}.{name}", Replicate())
            setattr(
                module, name, nn.Parameter(distribute_tensor(p.detach().clone(), mesh, placements))
            )
    model.spmd_mesh = mesh


def _dp_mesh_dims_job(layout: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from fsdp_compose import DataParallelMeshDims

    names, shard, replicate = _LAYOUTS[layout]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    dp_rank = mesh.get_local_rank(names.index(shard))
    rep_rank = mesh.get_local_rank(names.index(replicate)) if replicate else 0
    dp_index, dp_world = (rep_rank * 2 + dp_rank, 4) if replicate else (dp_rank, 2)
    tp_dim = None if replicate else 1 - names.index(shard)
    dims = DataParallelMeshDims(shard=shard, replicate=replicate)

    torch.manual_seed(0)
    ref = _SpmdMLP()
    model = _SpmdMLP()
    model.load_state_dict(ref.state_dict())
    _distribute(model, mesh, tp_dim)
    fully_shard(model.fc1, mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    out: dict = {
        "placements": {
            n: (str(p.device_mesh.mesh_dim_names), str(p.placements))
            for n, p in model.named_parameters()
        },
        "all_dtensor": all(
            isinstance(p, DTensor) and p.device_mesh == mesh for p in model.parameters()
        ),
    }
    # the same layout as torch's FSDP2 gives
    out["torch_placements"] = out["placements"]
    if TORCH_HAS_DP_MESH_DIMS:
        theirs = _SpmdMLP()
        _distribute(theirs, mesh, tp_dim)
        torch_fsdp.fully_shard(theirs.fc1, mesh=mesh, dp_mesh_dims=dims)  # type: ignore[call-arg]
        torch_fsdp.fully_shard(theirs, mesh=mesh, dp_mesh_dims=dims)  # type: ignore[call-arg]
        out["torch_placements"] = {
            n: (str(p.device_mesh.mesh_dim_names), str(p.placements))
            for n, p in theirs.named_parameters()
        }
    if layout == "dp_tp":
        out["errors"] = _dp_mesh_dims_errors(mesh, dims)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.manual_seed(1)
    loss_diffs, grad_diffs = [], []
    for _ in range(3):
        x = torch.randn(8, 8)
        per = 8 // dp_world
        loss = model(x[dp_index * per : (dp_index + 1) * per]).square().mean()
        loss.backward()
        ref_loss = ref(x).square().mean()
        ref_loss.backward()
        # mean over the data-parallel ranks of the per-rank losses = the full-batch loss
        mean_loss = torch.tensor([loss.item()])
        torch.distributed.all_reduce(mean_loss)
        loss_diffs.append(abs(mean_loss.item() / 4 - ref_loss.item()))
        grad_diffs.append(_max_diff(model, ref, grads=True))
        _step(opt, ref_opt)
    out["param_diff"] = _max_diff(model, ref)
    out["loss_diff"], out["grad_diff"] = max(loss_diffs), max(grad_diffs)
    # state dicts: a full plain one, and one laid out as before fully_shard, load
    # into the shards
    torch.manual_seed(3)
    plain = _SpmdMLP()
    model.load_state_dict(plain.state_dict())
    loaded = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    spmd = _SpmdMLP()
    spmd.load_state_dict(plain.state_dict())
    _distribute(spmd, mesh, tp_dim)
    model.load_state_dict(spmd.state_dict())
    out["load_diffs"] = [
        max((loaded[n] - v).abs().max().item() for n, v in plain.state_dict().items()),
        max(
            (p.detach().full_tensor() - plain.state_dict()[n]).abs().max().item()
            for n, p in model.named_parameters()
        ),
    ]
    return out


def _dp_mesh_dims_errors(mesh, dims) -> dict:
    from fsdp_compose import DataParallelMeshDims

    def spmd_model() -> _SpmdMLP:
        m = _SpmdMLP()
        _distribute(m, mesh, 1)
        return m

    cases = {
        "plain_param": (lambda: fully_shard(_SpmdMLP(), mesh=mesh, dp_mesh_dims=dims), ValueError),
        "unknown_dim": (
            lambda: fully_shard(
                spmd_model(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="fsdp")
            ),
            ValueError,
        ),
        "replicate_only": (
            lambda: fully_shard(
                spmd_model(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(replicate="dp")
            ),
            NotImplementedError,
        ),
        "reshard_int": (
            lambda: fully_shard(
                spmd_model(), mesh=mesh, dp_mesh_dims=dims, reshard_after_forward=2
            ),
            NotImplementedError,
        ),
        "not_dims": (lambda: fully_shard(spmd_model(), mesh=mesh, dp_mesh_dims="dp"), TypeError),
    }
    out = {}
    for name, (fn, expected) in cases.items():
        try:
            fn()
            out[name] = "no exception"
        except expected:
            out[name] = "ok"
        except Exception as exc:  # noqa: BLE001
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_dp_mesh_dims_parity(layout: str) -> None:
    results = run_distributed(_dp_mesh_dims_job, 4, layout)
    for r in results:
        assert r["all_dtensor"], r["placements"]
        assert r["placements"] == r["torch_placements"]
        assert r["load_diffs"] == [0.0, 0.0], r["load_diffs"]
        assert all(v == "ok" for v in r.get("errors", {}).values()), r["errors"]
        assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, r
    print(layout, results[0]["placements"])


# -- per-parameter meshes: MoE experts on an expert-data-parallel mesh -----------

_E, _D, _H, _TOKENS = 4, 8, 12, 6


class _MoE(nn.Module):
    """A dense mixture of experts: every token goes to every expert, weighted by
    the router. With ``ep_group`` set, each rank holds ``E / ep`` experts (DTensor
    ``Shard(0)`` on the ep mesh) and the ep group exchanges tokens and outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(_D, _D)
        self.router = nn.Linear(_D, _E)
        self.w_in = nn.Parameter(torch.randn(_E, _D, _H) * 0.3)
        self.w_out = nn.Parameter(torch.randn(_E, _H, _D) * 0.3)
        self.ep_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        gate = torch.softmax(self.router(x), dim=-1)
        if self.ep_group is None:
            h = torch.relu(torch.einsum("nd,edh->neh", x, self.w_in))
            return x + torch.einsum("neh,ehd,ne->nd", h, self.w_out, gate)
        import warnings

        import torch.distributed.nn.functional as dnn  # differentiable collectives

        warnings.filterwarnings("ignore", "torch.distributed.nn.functional", FutureWarning)

        ep, rank, n = (
            dist_size(self.ep_group),
            torch.distributed.get_rank(self.ep_group),
            x.shape[0],
        )
        w_in, w_out = self.w_in.to_local(), self.w_out.to_local()
        local = slice(rank * w_in.shape[0], (rank + 1) * w_in.shape[0])

        def gather(t: torch.Tensor) -> torch.Tensor:  # differentiable all-gather over ep
            padded = torch.zeros(ep * n, *t.shape[1:], dtype=t.dtype)
            padded = padded.index_copy(0, torch.arange(rank * n, (rank + 1) * n), t)
            return dnn.all_reduce(padded, group=self.ep_group)

        xs, gs = gather(x), gather(gate)
        h = torch.relu(torch.einsum("nd,edh->neh", xs, w_in))
        ys = dnn.all_reduce(
            torch.einsum("neh,ehd,ne->nd", h, w_out, gs[:, local]), group=self.ep_group
        )
        return x + ys[rank * n : (rank + 1) * n]


def dist_size(group) -> int:
    return torch.distributed.get_world_size(group)


class _MoEModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(_D, _D)  # so that the block's input requires grad
        self.block = _MoE()
        self.head = nn.Linear(_D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x)))


def _per_param_mesh_job(mode: str) -> dict:
    """``mode`` "ep": experts expert-parallel on ("edp", "ep"), sharded over edp;
    "hsdp": experts whole on every rank, HSDP on a (rep, shard) mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        HSDPMeshInfo,
        ShardPlacementResult,
    )
    from torch.distributed.tensor import Shard, distribute_tensor

    from fsdp_compose import Observer

    rank = torch.distributed.get_rank()
    dp_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    ref = _MoEModel()
    model = _MoEModel()
    model.load_state_dict(ref.state_dict())
    block = model.block
    if mode == "ep":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
        for name in ("w_in", "w_out"):  # expert parallel: 2 of the 4 experts per rank
            full = getattr(block, name).detach()
            setattr(block, name, nn.Parameter(distribute_tensor(full, mesh["ep"], [Shard(0)])))
        block.ep_group = mesh["ep"].get_group()
        edp_info = FSDPMeshInfo(mesh["edp"], shard_mesh_dim=0)
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
        edp_info = HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    experts = {block.w_in, block.w_out}

    def placement(param: nn.Parameter):
        return ShardPlacementResult(Shard(0), edp_info) if param in experts else None

    fully_shard(block, mesh=dp_mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=dp_mesh)
    if mode == "ep":  # experts' gradients sum all 4 ranks' tokens (ep x edp): average by 4
        block.set_gradient_divide_factor(4.0)
    out: dict = {
        "meshes": {n: str(p.device_mesh.mesh_dim_names) for n, p in model.named_parameters()},
        "placements": {n: str(p.placements) for n, p in model.named_parameters()},
    }
    try:
        block.set_custom_all_gather(None)
        out["custom_comm"] = "accepted"
    except ValueError:
        out["custom_comm"] = "ValueError"

    events: list[tuple[str, str, str]] = []

    class Listen(Observer):
        def on_collective(self, event, info) -> None:  # type: ignore[no-untyped-def]
            if event in ("issue", "wait_begin") and info.label.startswith("block"):
                events.append((event, str(info.kind), info.label))

    listen = Listen()

    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    torch.manual_seed(1)
    loss_diffs = []
    model.register_observer(listen)
    try:
        for step in range(3):
            x = torch.randn(4 * _TOKENS, _D)
            events.clear()
            loss = model(x[rank * _TOKENS : (rank + 1) * _TOKENS]).square().mean()
            loss.backward()
            ref_loss = (
                sum(ref(x[r * _TOKENS : (r + 1) * _TOKENS]).square().mean() for r in range(4)) / 4
            )
            ref_loss.backward()
            mean = torch.tensor([loss.item()])
            torch.distributed.all_reduce(mean)
            loss_diffs.append(abs(mean.item() / 4 - ref_loss.item()))
            if step == 0:  # no recorded order yet: no implicit prefetch hides the grouping
                out["events"] = list(events)
            if step == 1:
                out["grad_diff"] = _max_diff(model, ref, grads=True)
            _step(opt, ref_opt)
    finally:
        model.unregister_observer(listen)
    out["param_diff"] = _max_diff(model, ref)
    out["loss_diff"] = max(loss_diffs)
    # a full (plain) state dict loads into both meshes' shards
    torch.manual_seed(5)
    model.load_state_dict(_MoEModel().state_dict())
    torch.manual_seed(5)
    fresh = _MoEModel()
    out["load_diff"] = max(
        (p.detach().full_tensor() - fresh.state_dict()[n]).abs().max().item()
        for n, p in model.named_parameters()
    )
    return out


def _issued_before_first_wait(events: list[tuple[str, str, str]], kind: str) -> set[str]:
    """Labels of ``kind`` collectives issued before the first wait on one of them."""
    labels: set[str] = set()
    for event, k, label in events:
        if kind not in k:
            continue
        if event == "wait_begin":
            break
        labels.add(label)
    return labels


@pytest.mark.parametrize("mode", ["ep", "hsdp"])
def test_per_parameter_meshes_moe(mode: str) -> None:
    if not TORCH_HAS_PLACEMENT_RESULT:
        pytest.skip(f"torch {torch.__version__} has no ShardPlacementResult to pass")
    results = run_distributed(_per_param_mesh_job, 4, mode)
    expert_mesh, label = (
        ("('edp', 'ep')", "block [edp]")
        if mode == "ep"
        else ("('rep', 'shard')", "block [rep,shard]")
    )
    expert_placements = (
        "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        if mode == "ep"
        else "(Replicate(), Shard(dim=0))"
    )
    for r in results:
        assert (
            r["meshes"]["block.w_in"] == expert_mesh
            and r["meshes"]["block.proj.weight"] == "('dp',)"
        )
        assert r["placements"]["block.w_in"] == expert_placements, r["placements"]
        assert r["custom_comm"] == "ValueError"
        assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, r
        assert r["load_diff"] == 0.0
        # the two meshes' collectives overlap: both issued before either is waited on
        both = {"block", label}
        assert _issued_before_first_wait(r["events"], "all_gather") >= both, r["events"]
        assert _issued_before_first_wait(r["events"], "reduce_scatter") >= both, r["events"]
