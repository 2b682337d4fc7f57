"""Offload by budget: ``fully_shard``'s per-parameter ``offload_policy`` mapping,
``cpu_offload_by_budget`` (torch main's draft for FSDP2) and the planner's
``offload_by_budget``.

On a CPU mesh, offloading moves nothing (everything already lives on the CPU), as
for ``CPUOffloadPolicy`` itself: these tests check the choices, the bookkeeping and
that training is unchanged; the host/device split needs a CUDA mesh
(``tests/test_offload.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import fake_process_group

import fsdp_compose
from fsdp_compose import CPUOffloadPolicy, OffloadPolicy, cpu_offload_by_budget, fully_shard

WIDTH = 8


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(_Block(), _Block(), _Block(), nn.Linear(WIDTH, WIDTH))


def _off(module: nn.Module, prefix: str = "") -> dict[str, OffloadPolicy]:
    """Every parameter of ``module`` offloaded, FQNs relative to it, under ``prefix``."""
    return {prefix + n: CPUOffloadPolicy(pin_memory=False) for n, _ in module.named_parameters()}


# --- the mapping: numerics against FSDP2 on 2 gloo ranks ----------------------------


def _train(model: nn.Module, steps: int = 3) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        model(torch.randn(4, WIDTH, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().to_local().clone() for p in model.parameters()]


def _mapping_job() -> dict[str, Any]:
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffload
    from torch.distributed.fsdp import OffloadPolicy as TorchNoOffload
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    # FSDP2 (torch 2.13) takes one policy per call: block 0 and the root offloaded.
    ref = _model()
    torch_fully_shard(ref[0], offload_policy=TorchCPUOffload(pin_memory=False))
    for block in ref[1:3]:
        torch_fully_shard(block, offload_policy=TorchNoOffload())
    torch_fully_shard(ref, offload_policy=TorchCPUOffload(pin_memory=False))
    # fsdp_compose: the same policies per unit, given as per-parameter mappings
    # (torch's policy objects as values, as an FSDP2 program passes them).
    ours = _model()
    fully_shard(ours[0], offload_policy=_off(ours[0]))
    fully_shard(ours[1], offload_policy={})
    fully_shard(ours[2], offload_policy={"lin.weight": TorchCPUOffload(pin_memory=False)})
    fully_shard(
        ours,
        offload_policy={
            "3.weight": CPUOffloadPolicy(pin_memory=False),
            "3.bias": CPUOffloadPolicy(pin_memory=False),
        },
    )
    from fsdp_compose._runtime import unit_infos

    infos = unit_infos(ours)
    expected, got = _train(ref), _train(ours)
    return {
        "equal": len(expected) == len(got) and all(map(torch.equal, expected, got)),
        # On a CPU mesh nothing moves: no unit reports offload, shards stay CPU tensors.
        "offload_flags": [i.options.offload for i in infos],
        "units": len(infos),
        "devices": sorted({p.to_local().device.type for p in ours.parameters()}),
    }


def test_mapping_matches_fsdp2_per_module() -> None:
    from dist_utils import run_distributed

    for r in run_distributed(_mapping_job, 2, timeout=180):
        assert r["equal"], r
        assert r["units"] == 4 and r["offload_flags"] == [False] * 4, r
        assert r["devices"] == ["cpu"], r


# --- the mapping: resolution and bad keys (one process, fake backend) ----------------


def test_mapping_resolves_per_parameter() -> None:
    from fsdp_compose._runtime._fully_shard import (
        _managed_modules,
        _managed_params,
        _offload_policies,
    )

    with fake_process_group(2, 0):
        model = _model()
        fully_shard(model[0])
        modules = (model,)
        owners = _managed_params(_managed_modules(modules), set())
        cpu = CPUOffloadPolicy(pin_memory=False)
        resolved = _offload_policies({"1.lin.weight": cpu, "3.bias": cpu}, modules, owners)
        names = {id(p): n for n, p in model.named_parameters()}
        chosen = sorted(names[id(p)] for p, pol in resolved.items() if pol is cpu)
        assert chosen == ["1.lin.weight", "3.bias"]
        assert len(resolved) == len(owners)  # every managed parameter, the rest not offloaded
        assert all(type(pol) is OffloadPolicy for p, pol in resolved.items() if pol is not cpu)
        # a single policy applies to every parameter, as before
        assert set(_offload_policies(cpu, modules, owners).values()) == {cpu}


@pytest.mark.parametrize(
    "key, match",
    [
        ("1.lin.weigth", "no parameter it manages"),  # a typo
        ("0.lin.weight", "no parameter it manages"),  # an earlier call's parameter
        ("1.lin", "no parameter it manages"),  # a module, not a parameter
    ],
)
def test_mapping_bad_key_is_refused_before_any_change(key: str, match: str) -> None:
    with fake_process_group(2, 0):
        model = _model()
        fully_shard(model[0])
        before = dict(model.named_parameters())
        with pytest.raises(ValueError, match=match) as info:
            fully_shard(model, offload_policy={key: CPUOffloadPolicy()})
        assert repr(key) in str(info.value) and "1.lin.weight" in str(info.value)
        after = dict(model.named_parameters())
        assert all(after[n] is p for n, p in before.items())  # nothing replaced
        assert not isinstance(model, fsdp_compose.FSDPModule)
        fully_shard(model, offload_policy={"1.lin.weight": CPUOffloadPolicy()})  # the fix


def test_mapping_of_grouped_call_and_wrong_types() -> None:
    with fake_process_group(2, 0):
        model = _model()
        with pytest.raises(ValueError, match="several listed modules"):
            fully_shard([model[0], model[1]], offload_policy={"lin.weight": CPUOffloadPolicy()})
        with pytest.raises(TypeError, match=r"FQNs \(str\) to OffloadPolicy"):
            fully_shard(model[0], offload_policy={"lin.weight": True})  # type: ignore[dict-item]
        with pytest.raises(TypeError, match="or a mapping"):
            fully_shard(model[0], offload_policy="cpu")  # type: ignore[arg-type]
        # relative to each listed module when the name is unambiguous
        fully_shard([model[0], model[3]], offload_policy={"weight": CPUOffloadPolicy()})


# --- cpu_offload_by_budget -----------------------------------------------------------


class _ThreeParams(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Parameter(torch.zeros(100))  # 400 bytes
        self.mid = nn.Parameter(torch.zeros(50))  # 200 bytes
        self.mid2 = nn.Parameter(torch.zeros(50))  # 200 bytes (ties with mid)
        self.small = nn.Parameter(torch.zeros(10))  # 40 bytes


@pytest.mark.parametrize(
    "budget, expected",
    [
        (0, []),
        (399, []),
        (400, ["big"]),
        (600, ["big", "mid"]),  # the tie breaks in FQN order
        (799, ["big", "mid"]),  # mid2 would exceed; small is not taken past it
        (800, ["big", "mid", "mid2"]),
        (840, ["big", "mid", "mid2", "small"]),
        (10**12, ["big", "mid", "mid2", "small"]),
    ],
)
def test_budget_largest_first(budget: int, expected: list[str]) -> None:
    chosen = cpu_offload_by_budget(_ThreeParams(), budget)
    assert list(chosen) == expected
    assert all(isinstance(p, CPUOffloadPolicy) and p.pin_memory for p in chosen.values())


def test_budget_never_exceeded_and_monotonic() -> None:
    model = _model()
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    total, previous = sum(sizes.values()), set()
    for budget in range(0, total + 64, 16):
        chosen = set(cpu_offload_by_budget(model, budget))
        assert sum(sizes[n] for n in chosen) <= budget
        assert previous <= chosen
        previous = chosen
    assert previous == set(sizes)


def test_budget_arguments_and_meta_model() -> None:
    assert not any(
        p.pin_memory
        for p in cpu_offload_by_budget(_ThreeParams(), 10**6, pin_memory=False).values()
    )  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="non-negative"):
        cpu_offload_by_budget(_ThreeParams(), -1)
    with pytest.raises(TypeError, match="an int"):
        cpu_offload_by_budget(_ThreeParams(), 1.5e3)  # type: ignore[arg-type]
    with torch.device("meta"):
        meta = _model()
    assert cpu_offload_by_budget(meta, 10**6) == cpu_offload_by_budget(_model(), 10**6)
    tied = _model()
    tied[3].weight = tied[0].lin.weight  # counted once, under its first name
    assert "3.weight" not in cpu_offload_by_budget(tied, 10**6)


def test_budget_feeds_fully_shard() -> None:
    with fake_process_group(2, 0):
        model = _model()
        choice = cpu_offload_by_budget(model, 600)
        assert set(choice) == {"0.lin.weight", "1.lin.weight"}  # 256 bytes each, then 32s
        # per block: the entries under it, relative to it
        for name, block in list(model.named_children())[:3]:
            sub = {
                k.removeprefix(f"{name}."): v for k, v in choice.items() if k.startswith(f"{name}.")
            }
            fully_shard(block, offload_policy=sub)
        rest = {k: v for k, v in choice.items() if k.startswith("3.")}
        fully_shard(model, offload_policy=rest)
        assert isinstance(model, fsdp_compose.FSDPModule)


# --- the planner: offload_by_budget ---------------------------------------------------


def _tiny_lm() -> nn.Module:
    """Token ids -> embedding (16 x 32) -> four Linear(32, 32) blocks -> head (32 x 16):
    the root's parameters (1,024 elements) are a little smaller than a block's (1,056)."""

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 32)
            self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
            self.head = nn.Linear(32, 16, bias=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.emb(ids)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    with torch.device("meta"):
        return Tiny()


# One candidate: W = 2, fp32, AdamW, the last block (and the root) kept after forward.
_ONE: dict[str, Any] = {
    "batch": 1,
    "seq": 4,
    "world_size": 2,
    "policy": lambda m, fqn: fqn.startswith("blocks."),
    "groups": (1,),
    "depths": (1,),
    "keeps": (1,),
    "activation_checkpointing": False,
}


def _states(u: Any) -> int:
    return u.sharded_bytes + u.grad_bytes + u.optimizer_bytes


def test_planner_offloads_most_freed_per_byte_moved_until_it_fits() -> None:
    from fsdp_compose.plan import plan_to_budget
    from fsdp_compose.plan._cost import step_cost

    model = _tiny_lm()
    free = plan_to_budget(model, 10**9, **_ONE)
    peak, units = free.estimate.peak_bytes_per_rank, {u.name: u for u in free.estimate.units}
    # Kept after forward, blocks.3 and the root are gathered once: they copy half as
    # much per step as the other blocks for the same freed memory; blocks.3 is larger.
    for budget, expected in (
        (peak - 1, ["blocks.3"]),
        (peak - _states(units["blocks.3"]), ["blocks.3"]),
        (peak - _states(units["blocks.3"]) - 1, ["blocks.3", "<root>"]),
        (peak - _states(units["blocks.3"]) - _states(units["<root>"]) - 1,
         ["blocks.3", "<root>", "blocks.0"]),
    ):  # fmt: skip
        assert not plan_to_budget(model, budget, **_ONE).fits
        result = plan_to_budget(model, budget, offload_by_budget=True, **_ONE)
        assert result.fits and result.plan is not None, result.table()
        assert list(result.choice["offload"]) == expected
        assert sorted(u.name for u in result.plan.units if u.offload) == sorted(expected)
        est = result.estimate
        assert est.peak_bytes_per_rank == peak - sum(_states(units[n]) for n in expected)
        assert result.host_bytes == sum(_states(units[n]) for n in expected)
        # predicted slower than the same plan on the device: copies and the host step
        assert result.step is not None and result.step.host_optimizer_s > 0
        assert result.step_time_s > step_cost(free.estimate, free.cost, 1).step_s
        # the dry run says what is offloaded and the predicted step time
        text = result.table()
        assert f"offloaded (offload_by_budget): {len(expected)} of 5 units" in text, text
        assert f"step {result.step_time_s * 1e3:.1f} ms" in text and "host optimizer step" in text
        offloaded = {
            u["modules"][0] or "<root>" for u in result.to_dict()["plan"]["units"] if u["offload"]
        }
        assert offloaded == set(expected)


def test_planner_offload_by_budget_limits() -> None:
    from fsdp_compose.plan import plan_to_budget

    model = _tiny_lm()
    # the activations and gathered parameters alone exceed it: offloading cannot help
    result = plan_to_budget(model, 2000, offload_by_budget=True, **_ONE)
    assert not result.fits and "DOES NOT FIT" in result.table()
    peak = plan_to_budget(model, 10**9, **_ONE).estimate.peak_bytes_per_rank
    # the host budget bounds what may be offloaded
    result = plan_to_budget(model, peak - 1, offload_by_budget=True, host_budget=100, **_ONE)
    assert not result.fits
    with pytest.raises(ValueError, match="device='cuda'"):
        plan_to_budget(model, peak, offload_by_budget=True, device="cpu", **_ONE)
    with pytest.raises(ValueError, match="does not already offload every unit"):
        plan_to_budget(
            model, peak, offload_by_budget=True, offload_policy=CPUOffloadPolicy(), **_ONE
        )
    # without the need, nothing is offloaded (and the plan is the one without the option)
    same = plan_to_budget(model, peak, offload_by_budget=True, **_ONE)
    assert same.fits and "offload" not in same.choice
    assert not any(u.offload for u in same.plan.units)  # type: ignore[union-attr]


def test_auto_wrap_offloads_the_units_the_plan_offloads(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_compose.plan import ShardingPlan, UnitPlan, _autowrap, auto_wrap

    calls: list[tuple[str, str]] = []
    real = _autowrap.fully_shard

    def recording(module: Any, **kwargs: Any) -> Any:
        calls.append((type(module).__name__, type(kwargs["offload_policy"]).__name__))
        return real(module, **kwargs)

    monkeypatch.setattr(_autowrap, "fully_shard", recording)
    plan = ShardingPlan((UnitPlan(("0",), offload=True), UnitPlan(("1",)), UnitPlan(("",))))
    with fake_process_group(2, 0):
        auto_wrap(_model(), plan=plan)
    # the dry run on the meta copy, then the model: block 0 offloaded, the rest not
    assert calls[-3:] == [("_Block", "CPUOffloadPolicy"), ("_Block", "OffloadPolicy"),
                          ("Sequential", "OffloadPolicy")]  # fmt: skip


def test_cli_offload_by_budget(capsys: pytest.CaptureFixture[str]) -> None:
    from fsdp_compose.plan.__main__ import main

    factory = "test_offload_budget:_tiny_lm"
    args = [factory, "--world-size", "2", "--batch", "1", "--seq", "4", "--policy", "Linear"]
    assert main([*args, "--offload-by-budget"]) == 2
    assert "--offload-by-budget chooses units" in capsys.readouterr().err
    assert main([*args, "--budget", "1MiB", "--offload", "--offload-by-budget"]) == 2
    capsys.readouterr()
    assert (
        main([*args, "--budget", "60KiB", "--offload-by-budget", "--no-checkpointing-in-plan"]) == 0
    )
    out = capsys.readouterr().out
    assert "offloaded (offload_by_budget):" in out and "host optimizer step" in out, out
    assert main([*args, "--budget", "60KiB", "--no-checkpointing-in-plan"]) == 1  # without it
    assert "DOES NOT FIT" in capsys.readouterr().out
