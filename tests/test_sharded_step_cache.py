"""The sharded Adam step keeps its update lists from one step to the next
([Note: cached update lists] in ``fsdp_compose/_optim_direct.py``) and runs
torch's foreach Adam on CPU tensors itself ([Note: foreach Adam on the CPU]).
Each test runs torch's FSDP2 and fsdp_compose with ``enable_sharded_step`` side
by side through events that change what the lists must hold (a parameter losing
and regaining its gradient, a state replaced in its dict, ``load_state_dict`` of
an earlier state, ``add_param_group``, accumulated gradients, a new learning
rate) and requires bit-identical parameters after every step: a cache that
missed one of them would update stale tensors."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch import nn

import fsdp_compose
from fsdp_compose import _optim_direct, enable_sharded_step

# A weight shard of 96 x 192 float32 (73,728 bytes) is at least _optim_direct._LARGE:
# its square root is taken on its own; biases and LayerNorm shards go together.
WIDTH = 192
OPTIMIZERS = {
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adam_foreach_l2": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adam_foreach_maximize": lambda ps: torch.optim.Adam(
        ps, lr=1e-2, weight_decay=0.1, maximize=True, foreach=True
    ),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adam_amsgrad_foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, foreach=True),
}


def _model(impl: str) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)) for _ in range(3)]
    )
    shard = torch.distributed.fsdp.fully_shard if impl == "fsdp2" else fsdp_compose.fully_shard
    for block in model:
        shard(block)
    shard(model)
    return model


def _backward(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    model(torch.randn(4, WIDTH, generator=g)).square().mean().backward()


def _run(name: str, impl: str) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Trains through the events; the parameters after each step, and how many
    times each step built its lists."""
    model = _model(impl)
    # The last block joins later, through add_param_group.
    opt = OPTIMIZERS[name]([p for block in model[:2] for p in block.parameters()])
    if impl != "fsdp2":
        enable_sharded_step(opt)
    builds: list[int] = []
    build = _optim_direct._adam_lists

    def counted(*args: Any) -> Any:
        builds[-1] += 1
        return build(*args)

    _optim_direct._adam_lists = counted  # type: ignore[assignment]
    after: list[list[torch.Tensor]] = []
    saved: dict[str, Any] = {}
    try:
        for step in range(11):
            _backward(model, step)
            params = opt.param_groups[0]["params"]
            if step == 3:  # a parameter without a gradient for one step
                model[0][0].bias.grad = None
            if step == 5:  # a state replaced in its dict
                saved = copy.deepcopy(opt.state_dict())
                state = opt.state[model[1][0].weight]
                state["exp_avg"] = state["exp_avg"] * 0.5
            if step == 7:  # back to the state saved two steps earlier
                opt.load_state_dict(saved)
            if step == 8:
                opt.add_param_group({"params": list(model[2].parameters())})
            if step == 9:
                opt.param_groups[0]["lr"] = 3e-3
            builds.append(0)
            opt.step()
            assert opt.param_groups[0]["params"] is params, "the group's own list is back"
            after.append([p.detach().to_local().clone() for p in model.parameters()])
            # Steps 1 and 2 accumulate into the same gradients; the others get new ones.
            opt.zero_grad(set_to_none=step not in (0, 1))
    finally:
        _optim_direct._adam_lists = build  # type: ignore[assignment]
    return after, builds


def _job(name: str) -> dict[str, Any]:
    reference, _ = _run(name, "fsdp2")
    sharded, builds = _run(name, "sharded")
    return {
        "identical_steps": [all(map(torch.equal, a, b)) for a, b in zip(reference, sharded)],
        "builds": builds,
    }


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_cached_lists_follow_every_change(name: str) -> None:
    for r in run_distributed(_job, 2, name, timeout=300):
        assert all(r["identical_steps"]), r
        # Steps with no event reuse the lists; the others rebuild them.
        builds = r["builds"]
        assert [builds[s] for s in (2, 6, 10)] == [0, 0, 0], builds
        assert all(builds[s] > 0 for s in (1, 3, 4, 5, 7, 8)), builds


def _forget_job() -> dict[str, Any]:
    model = _model("sharded")
    opt = enable_sharded_step(torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True))
    for step in range(2):
        _backward(model, step)
        opt.step()
    held = [s["exp_avg"] for s in opt.state.values()]
    cached_before = bool(_optim_direct._caches[opt].groups)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    refs = [weakref.ref(t) for t in held]
    del held
    gc.collect()
    return {
        "cached_before": cached_before,
        "dropped_on_load": _optim_direct._caches[opt].groups == [],
        "old_states_freed": all(r() is None for r in refs),
    }


def test_load_state_dict_frees_the_cached_states() -> None:
    for r in run_distributed(_forget_job, 2, timeout=300):
        assert r == {k: True for k in r}, r


VARIANTS = [  # (weight decay, decoupled, maximize)
    (False, False, False),
    (False, False, True),
    (True, False, False),
    (True, False, True),
    (True, True, False),
    (True, True, True),
]


@pytest.mark.parametrize("variant", VARIANTS)
def test_cpu_foreach_adam_agrees_with_the_installed_torch(variant: tuple[bool, ...]) -> None:
    """The copy of torch's multi-tensor Adam gives torch's bits on this torch. If this
    fails on a new torch, the sharded step already falls back to torch's function
    for that variant (next test): update ``_adam_ops`` to the new op sequence."""
    assert _optim_direct._compare_with_torch(*variant)


def test_a_copy_that_disagrees_with_torch_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the copy's bits differ from the installed torch's (simulated: one op
    changed), the check says so, once per variant, and the step calls torch's function."""
    real_ops = _optim_direct._adam_ops

    def changed_ops(values: list[list[Any]], group: dict[str, Any]) -> None:
        real_ops(values, {**group, "eps": group["eps"] * 2})

    monkeypatch.setattr(_optim_direct, "_adam_ops", changed_ops)
    monkeypatch.setattr(_optim_direct, "_agreement", {})
    group = {"weight_decay": 0.1, "decoupled_weight_decay": True, "maximize": False}
    assert not _optim_direct._agrees_with_torch(group)
    assert _optim_direct._agreement == {(True, True, False): False}
    monkeypatch.setattr(_optim_direct, "_adam_ops", real_ops)
    assert not _optim_direct._agrees_with_torch(group)  # decided once per process
