"""fully_shard is atomic (a failed call leaves the module exactly as it was, and
the retry with the suggested fix succeeds), and misuse gets a message naming the
real cause: a module shared by two sibling units, ignored_params that are not the
module's (accepted, as in FSDP2), a mesh on the meta device."""

from __future__ import annotations


import torch
from dist_utils import run_distributed
from helpers import rank_world
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from fsdp_compose import FSDPModule, fully_shard


class _LateScalar(nn.Module):
    """Valid parameters first; the last one (a 0-dim scalar) cannot be sharded."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("running", torch.zeros(4))
        self.temperature = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) / self.temperature


def _snapshot(module: nn.Module) -> dict:
    return {
        "params": [(n, id(p), type(p).__name__) for n, p in module.named_parameters()],
        "buffers": [(n, id(b)) for n, b in module.named_buffers()],
        "class": type(module).__name__,
        "hooks": (len(module._forward_pre_hooks), len(module._forward_hooks)),
        "dict": sorted(module.__dict__),
    }


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _atomic_job() -> dict:
    _, world = rank_world()
    out: dict = {}

    # A later parameter fails: nothing was changed, and the suggested fix works.
    m = _LateScalar()
    before = _snapshot(m)
    out["scalar_error"] = _error(lambda: fully_shard(m))
    out["scalar_unchanged"] = _snapshot(m) == before
    fully_shard(m, ignored_params={m.temperature})
    out["scalar_retry"] = isinstance(m, FSDPModule) and isinstance(m.fc.weight, DTensor)
    x = torch.randn(3, 4)
    out["scalar_forward"] = tuple(m(x).shape)

    # shard_placement_fn: valid for the first parameter, invalid for a later one.
    m2 = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 4))  # 2nd weight: dim 1 of 3
    before = _snapshot(m2)
    out["placement_error"] = _error(
        lambda: fully_shard(m2, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    )
    out["placement_unchanged"] = _snapshot(m2) == before
    fully_shard(m2, shard_placement_fn=lambda p: Shard(0))
    out["placement_retry"] = tuple(m2(x).shape)

    # A module shared by two sibling units: name the sharing, not "bottom-up".
    shared = nn.Linear(4, 4)
    parent = nn.Module()
    parent.a, parent.b = nn.Sequential(shared, nn.ReLU()), nn.Sequential(shared, nn.Tanh())
    fully_shard(parent.a)
    out["sibling_error"] = _error(lambda: fully_shard(parent.b))
    # A parent annotated before its child still gets the bottom-up message.
    p2 = nn.Sequential(nn.Linear(4, 4))
    fully_shard(p2)
    out["bottom_up_error"] = _error(lambda: fully_shard(p2[0]))

    # ignored_params that are not the module's: accepted and left alone, as in FSDP2
    # (one set for the whole model may be passed to every call).
    other = nn.Linear(3, 2)
    m3 = nn.Sequential(nn.Linear(4, 4))
    out["ignored_error"] = _error(lambda: fully_shard(m3, ignored_params={other.weight}))
    out["ignored_unchanged"] = isinstance(m3, FSDPModule) and not isinstance(other.weight, DTensor)
    # The original of a parameter a nested unit already sharded is accepted.
    tree = nn.Sequential(nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 4))
    inner_weight = tree[0][0].weight
    fully_shard(tree[0])
    fully_shard(tree, ignored_params={inner_weight, tree[1].bias})
    out["ignored_nested"] = not isinstance(tree[1].bias, DTensor)

    # A mesh on the meta device would destroy real values.
    m4 = nn.Linear(4, 4)
    weight = m4.weight.detach().clone()
    meta_mesh = DeviceMesh("meta", list(range(world)))
    out["meta_mesh_error"] = _error(lambda: fully_shard(m4, mesh=meta_mesh))
    out["meta_mesh_unchanged"] = (not m4.weight.is_meta) and torch.equal(m4.weight, weight)
    return out


def test_fully_shard_is_atomic_and_messages_name_the_cause() -> None:
    for r in run_distributed(_atomic_job, 2):
        assert "0-dim" in r["scalar_error"] and "ignored_params" in r["scalar_error"], r
        assert r["scalar_unchanged"] and r["scalar_retry"] and r["scalar_forward"] == (3, 4), r
        assert "divisible" in r["placement_error"], r
        assert r["placement_unchanged"] and r["placement_retry"] == (3, 4), r
        assert "a module shared by two fully_shard units" in r["sibling_error"], r
        assert "bottom-up" not in r["sibling_error"], r
        assert "bottom-up" in r["bottom_up_error"], r
        assert r["ignored_error"] == "no error", r
        assert r["ignored_unchanged"] and r["ignored_nested"], r
        assert "ValueError: fully_shard got a mesh on the meta device" in r["meta_mesh_error"], r
        assert r["meta_mesh_unchanged"], r
