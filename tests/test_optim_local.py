"""Optimizer steps on local shards (see fsdp_compose/_optim.py): bit-identical to
the DTensor path for torch's elementwise optimizers, states stay DTensors laid
out like their parameters, and anything not known to be elementwise keeps the
DTensor path."""

from __future__ import annotations

import copy

import pytest
import torch
from dist_utils import run_distributed
from gpt import GPT, GPTConfig, loss_fn, make_batch
from helpers import local_slice, rank_world
from models import TINY_GPT
from torch.distributed.tensor import DTensor

from fsdp_compose import _optim, enable_sharded_step, fully_shard

TINY = {**TINY_GPT, "n_layer": 2}
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9, nesterov=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-1),
    "rmsprop_centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, centered=True, momentum=0.5),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
}


def _train(name: str, local_steps: bool, steps: int = 3) -> tuple[GPT, torch.optim.Optimizer, list[float]]:
    rank, world = rank_world()
    cfg = GPTConfig(**TINY)
    torch.manual_seed(0)
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = OPTIMIZERS[name](model.parameters())
    sched = None
    losses = []
    if local_steps:
        enable_sharded_step(opt)
    try:
        for step in range(steps):
            x, y = make_batch(cfg, 2 * world, step)
            loss = loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world))
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step == 0:  # a scheduler created after the optimizer was accelerated
                sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            else:
                assert sched is not None
                sched.step()
            losses.append(loss.item())
    finally:
        pass
    return model, opt, losses


def _identical_job(name: str) -> dict:
    fast, fast_opt, fast_losses = _train(name, True)
    slow, slow_opt, slow_losses = _train(name, False)
    out = {
        "accelerated": fast_opt in _optim._records and slow_opt not in _optim._records,
        "losses_equal": fast_losses == slow_losses,
        "params_equal": all(
            torch.equal(a.to_local(), b.to_local()) for a, b in zip(fast.parameters(), slow.parameters())
        ),
        "param_groups_dtensors": all(isinstance(p, DTensor) for g in fast_opt.param_groups for p in g["params"]),
    }
    states_equal, layouts = True, True
    for a, b in zip(fast.parameters(), slow.parameters()):
        sa, sb = fast_opt.state[a], slow_opt.state[b]
        assert sa.keys() == sb.keys()
        for key in sa:
            va, vb = sa[key], sb[key]
            layouts &= type(va) is type(vb)
            if isinstance(va, DTensor):
                layouts &= va.placements == a.placements and va.shape == a.shape
                states_equal &= torch.equal(va.to_local(), vb.to_local())
            elif isinstance(va, torch.Tensor):
                states_equal &= torch.equal(va, vb)
    out["states_equal"], out["state_layouts"] = states_equal, layouts
    out["state_dict_keys"] = len(fast_opt.state_dict()["state"]) == len(list(fast.parameters()))
    return out


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_local_steps_are_bit_identical(name: str) -> None:
    for r in run_distributed(_identical_job, 2, name):
        assert r == {k: True for k in r}, r


def _not_accelerated_job() -> dict:
    cfg = GPTConfig(**TINY)
    torch.manual_seed(0)
    model = GPT(cfg)
    fully_shard(model)

    class MyAdamW(torch.optim.AdamW):  # a subclass might add a non-elementwise step
        pass

    opt = MyAdamW(model.parameters(), lr=1e-3)
    try:
        enable_sharded_step(opt)
    except ValueError:
        pass
    x, y = make_batch(cfg, 2, 0)
    for _ in range(2):
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    # An exception inside a local step leaves the optimizer holding its DTensors.
    opt2 = enable_sharded_step(torch.optim.AdamW(copy.copy(list(model.parameters())), lr=1e-3))
    loss_fn(model(x), y).backward()
    opt2.step()
    handle = opt2.register_step_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("boom")))
    try:
        opt2.step()
    except RuntimeError:
        pass
    handle.remove()
    restored = all(isinstance(p, DTensor) for g in opt2.param_groups for p in g["params"]) and all(
        isinstance(v, DTensor) for p in model.parameters() for k, v in opt2.state[p].items() if k != "step"
    )
    return {"subclass_not_accelerated": opt not in _optim._records,
            "restored_after_exception": restored and opt2 in _optim._records}


def test_subclasses_and_exceptions() -> None:
    for r in run_distributed(_not_accelerated_job, 2):
        assert r == {k: True for k in r}, r


def _meta_init_job() -> dict:
    """Parameters materialised with to_empty() after fully_shard keep the local path."""
    cfg = GPTConfig(**TINY)
    with torch.device("meta"):
        model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    opt = enable_sharded_step(torch.optim.AdamW(model.parameters(), lr=1e-3))
    x, y = make_batch(cfg, 2, 0)
    for _ in range(2):
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {"accelerated": opt in _optim._records, "eligible": _optim._eligible(opt)}


def test_meta_init_parameters_take_the_local_path() -> None:
    for r in run_distributed(_meta_init_job, 2):
        assert r == {"accelerated": True, "eligible": True}, r


def _scheduler_job(sched_name: str, optim_name: str) -> dict:
    """LR schedulers, a user step pre-hook and post-hook, and a closure on an
    optimizer that takes fsdp_compose's sharded step: no warning, and the same
    result as the DTensor path (elementwise) or as one device (Muon)."""
    import warnings

    rank, world = rank_world()
    cfg = GPTConfig(**TINY)

    def run(local_steps: bool) -> tuple[list[float], list[torch.Tensor], dict]:
        torch.manual_seed(0)
        model = GPT(cfg)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        params = list(model.parameters())
        if optim_name == "muon":
            opt = torch.optim.Muon([p for p in params if p.ndim == 2 and p.shape[0] != cfg.vocab_size], lr=1e-2)
        else:
            opt = torch.optim.AdamW(params, lr=1e-2)
        no_step_attr = "step" not in vars(opt)  # before a scheduler wraps it
        if sched_name == "lambda":
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        else:
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
        seen: dict = {"pre_dtensor_grads": True, "post_grads": True}

        def pre(o: torch.optim.Optimizer, args: object, kwargs: object) -> None:
            for g in o.param_groups:
                for p in g["params"]:
                    seen["pre_dtensor_grads"] &= isinstance(p, DTensor) and (
                        p.grad is None or isinstance(p.grad, DTensor)
                    )
                    if p.grad is not None:
                        p.grad.mul_(0.5)  # must take effect, as before torch's own update

        def post(o: torch.optim.Optimizer, args: object, kwargs: object) -> None:
            seen["post_grads"] &= all(p.grad is not None for g in o.param_groups for p in g["params"])

        opt.register_step_pre_hook(pre)
        opt.register_step_post_hook(post)
        if local_steps:
            enable_sharded_step(opt)
        losses = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for step in range(3):
                    x, y = make_batch(cfg, 2 * world, step)

                    def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                        opt.zero_grad()
                        loss = loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world))
                        loss.backward()
                        return loss

                    if step < 2:
                        loss = closure()
                        opt.step()
                    else:  # the closure runs after the pre-hooks, before the update
                        loss = opt.step(closure)
                    losses.append(loss.item())
                    sched.step()
        finally:
            pass
        seen["warnings"] = [str(w.message) for w in caught]
        seen["marker"] = hasattr(opt.step, "_wrapped_by_lr_sched")
        seen["accelerated"] = opt in _optim._records
        seen["no_step_attr"] = no_step_attr
        return losses, [p.full_tensor() for p in params], seen

    fast_losses, fast_params, seen = run(True)
    out = dict(seen)
    if optim_name != "muon":
        slow_losses, slow_params, _ = run(False)
        out["same_as_dtensor_path"] = fast_losses == slow_losses and all(
            torch.equal(a, b) for a, b in zip(fast_params, slow_params)
        )
    return out


@pytest.mark.parametrize("sched_name,optim_name", [("lambda", "adamw"), ("cosine", "muon")])
def test_lr_schedulers_hooks_and_closures(sched_name: str, optim_name: str) -> None:
    for r in run_distributed(_scheduler_job, 2, sched_name, optim_name):
        assert r.pop("warnings") == [], r
        assert all(r.values()), r


def test_optimizers_without_sharded_parameters_are_left_alone() -> None:
    """The sharded step is refused for an optimizer holding no parameter sharded
    by fsdp_compose: it gets no step hook and keeps torch's own step."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pre_hooks = len(opt._optimizer_step_pre_hooks)
    with pytest.raises(ValueError, match="holds no parameter sharded by fsdp_compose"):
        enable_sharded_step(opt)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert opt not in _optim._records, "a plain optimizer was given the local step"
    assert len(opt._optimizer_step_pre_hooks) == pre_hooks, opt._optimizer_step_pre_hooks
