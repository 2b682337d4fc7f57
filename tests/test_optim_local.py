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
from torch.distributed.tensor import DTensor

from fsdp_compose import _optim, fully_shard

TINY = dict(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=32)
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
    previous = _optim.enabled
    _optim.enabled = lambda: local_steps  # type: ignore[assignment]
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
        _optim.enabled = previous  # type: ignore[assignment]
    return model, opt, losses


def _identical_job(name: str) -> dict:
    fast, fast_opt, fast_losses = _train(name, True)
    slow, slow_opt, slow_losses = _train(name, False)
    out = {
        "accelerated": fast_opt in _optim._accelerated and slow_opt not in _optim._accelerated,
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
    x, y = make_batch(cfg, 2, 0)
    for _ in range(2):
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    # An exception inside a local step leaves the optimizer holding its DTensors.
    opt2 = torch.optim.AdamW(copy.copy(list(model.parameters())), lr=1e-3)
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
    return {"subclass_not_accelerated": opt not in _optim._accelerated,
            "restored_after_exception": restored and opt2 in _optim._accelerated}


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
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = make_batch(cfg, 2, 0)
    for _ in range(2):
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {"accelerated": opt in _optim._accelerated, "eligible": _optim._eligible(opt)}


def test_meta_init_parameters_take_the_local_path() -> None:
    for r in run_distributed(_meta_init_job, 2):
        assert r == {"accelerated": True, "eligible": True}, r
