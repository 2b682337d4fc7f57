"""What fully_shard does to a module in place: names, classes, DTensor placements,
state dicts, unshard/reshard, meta-device init, extra forward methods."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from dist_utils import run_distributed
from gpt import GPT, GPTConfig, loss_fn, make_batch
from helpers import local_slice, max_param_diff, rank_world
from models import TINY_GPT
from torch.distributed.tensor import DTensor, Shard

from fsdp_compose import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method

TINY = {**TINY_GPT, "n_layer": 2}


def _structure_job() -> dict:
    rank, world = rank_world()
    torch.manual_seed(0)
    ref = GPT(GPTConfig(**TINY))
    model = copy.deepcopy(ref)
    names_before = [n for n, _ in model.named_parameters()]
    keys_before = list(model.state_dict().keys())
    for block in model.blocks:
        fully_shard(block)
    result = fully_shard(model)
    out: dict = {"returned_same": result is model}
    out["names_same"] = [n for n, _ in model.named_parameters()] == names_before
    out["keys_same"] = list(model.state_dict().keys()) == keys_before
    out["isinstance"] = (
        isinstance(model, FSDPModule)
        and isinstance(model, GPT)
        and all(isinstance(b, FSDPModule) for b in model.blocks)
        and not isinstance(model.ln_f, FSDPModule)
    )
    out["class_name"] = type(model).__name__
    checks = []
    for (name, p), (_, ref_p) in zip(model.named_parameters(), ref.named_parameters()):
        expected_local = ref_p.chunk(world, dim=0)
        local = expected_local[rank] if rank < len(expected_local) else ref_p[:0]
        checks.append(
            isinstance(p, nn.Parameter)
            and isinstance(p, DTensor)
            and p.placements == (Shard(0),)
            and p.shape == ref_p.shape
            and p.to_local().shape == local.shape
            and torch.equal(p.to_local(), local)
            and torch.equal(p.full_tensor(), ref_p.detach())
        )
    out["params_ok"] = all(checks)
    out["sd_dtensor"] = all(isinstance(v, DTensor) for v in model.state_dict().values())

    # unshard / reshard toggle full plain tensors and DTensors (not recursive)
    block = model.blocks[0]
    assert block.unshard() is None
    w = block.attn.q.weight
    out["unsharded_plain"] = (
        not isinstance(w, DTensor) and w.shape == ref.blocks[0].attn.q.weight.shape
    )
    out["unsharded_values"] = torch.equal(w.detach(), ref.blocks[0].attn.q.weight.detach())
    out["child_still_sharded"] = isinstance(model.blocks[1].attn.q.weight, DTensor)
    out["root_still_sharded"] = isinstance(model.tok_emb.weight, DTensor)
    block.reshard()
    out["resharded"] = isinstance(block.attn.q.weight, DTensor)
    handle = model.blocks[1].unshard(async_op=True)
    out["handle_type"] = isinstance(handle, UnshardHandle)
    handle.wait()
    out["async_unsharded"] = not isinstance(model.blocks[1].mlp.fc.weight, DTensor)
    model.blocks[1].reshard()

    # after a training forward the root keeps its unsharded parameters, but the
    # state dict still holds shards
    x, y = make_batch(GPTConfig(**TINY), 2 * world, 0)
    loss = loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world))
    out["sd_after_forward_dtensor"] = all(
        isinstance(v, DTensor) for v in model.state_dict().values()
    )
    loss.backward()
    out["grads_dtensor"] = all(
        isinstance(p.grad, DTensor) and p.grad.placements == (Shard(0),) for p in model.parameters()
    )
    out["all_sharded_after_backward"] = all(isinstance(p.data, DTensor) for p in model.parameters())
    return out


def test_structure_in_place() -> None:
    for r in run_distributed(_structure_job, 2):
        assert r["returned_same"], r
        assert r["names_same"] and r["keys_same"]
        assert r["isinstance"] and r["class_name"] == "FSDPGPT"
        assert r["params_ok"], r
        assert r["sd_dtensor"] and r["sd_after_forward_dtensor"]
        assert r["unsharded_plain"] and r["unsharded_values"]
        assert r["child_still_sharded"] and r["root_still_sharded"] and r["resharded"]
        assert r["handle_type"] and r["async_unsharded"]
        assert r["grads_dtensor"] and r["all_sharded_after_backward"]


def _state_dict_job() -> dict:
    rank, world = rank_world()
    torch.manual_seed(0)
    cfg = GPTConfig(**TINY)
    ref = GPT(cfg)
    other = GPT(cfg)  # different weights
    model = copy.deepcopy(other)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    out = {}
    # a full (plain tensor) state dict is sharded on the fly
    missing, unexpected = model.load_state_dict(ref.state_dict())
    out["full_load"] = max_param_diff(model, ref)[0] == 0.0 and not missing and not unexpected
    # a sharded state dict round-trips
    sharded = {k: v.clone() for k, v in model.state_dict().items()}
    model2 = copy.deepcopy(other)
    for block in model2.blocks:
        fully_shard(block)
    fully_shard(model2)
    model2.load_state_dict(sharded)
    out["sharded_load"] = max_param_diff(model2, ref)[0] == 0.0
    # and the loaded model trains like the reference
    x, y = make_batch(cfg, 2 * world, 0)
    a = loss_fn(model2(local_slice(x, rank, world)), local_slice(y, rank, world)).item()
    b = loss_fn(ref(local_slice(x, rank, world)), local_slice(y, rank, world)).item()
    out["loss_equal"] = abs(a - b) < 1e-6
    return out


def test_state_dict_load_full_and_sharded() -> None:
    for r in run_distributed(_state_dict_job, 2):
        assert r == {"full_load": True, "sharded_load": True, "loss_equal": True}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def _meta_init_job() -> dict:
    rank, world = rank_world()
    cfg = GPTConfig(vocab_size=32000, block_size=64, n_layer=2, n_head=8, n_embd=512)
    with torch.device("meta"):
        model = GPT(cfg)
    full_bytes = sum(p.numel() * 4 for p in model.parameters())
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    before = _rss_mb()
    model.to_empty(device="cpu")
    after_materialize = _rss_mb()
    local_bytes = sum(p.to_local().numel() * 4 for p in model.parameters())
    model.init_weights(seed=3)
    torch.manual_seed(0)
    ref = GPT(cfg)
    ref.init_weights(seed=3)
    out = {
        "full_mb": full_bytes / 2**20,
        "local_mb": local_bytes / 2**20,
        "rss_growth_mb": after_materialize - before,
        "init_diff": max_param_diff(model, ref),
    }
    # trains at parity
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    diffs = []
    for step in range(2):
        x, y = make_batch(cfg, 2 * world, step)
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = torch.tensor([loss.item()])
        torch.distributed.all_reduce(t)
        diffs.append(abs(t.item() / world - ref_loss.item()))
    out["loss_diffs"] = diffs
    return out


def test_meta_device_init() -> None:
    for r in run_distributed(_meta_init_job, 2, timeout=240):
        assert abs(r["local_mb"] - r["full_mb"] / 2) < 1.0
        # materialising allocates this rank's shards only (not the full model)
        assert r["rss_growth_mb"] < 0.75 * r["full_mb"], r
        assert r["init_diff"][0] == 0.0, r["init_diff"]
        assert max(r["loss_diffs"]) < 1e-5, r["loss_diffs"]


def _impls() -> list[tuple[str, object]]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    return [("fsdp2", torch_fully_shard), ("fsdp_compose", fully_shard)]


def _two_tensor_linear(device: str, requires_grad: bool = True) -> nn.Linear:
    """``nn.Linear(8, 6)`` on ``device`` whose weight is a ``TwoTensor`` (a tensor
    subclass without FSDP2's all-gather extension) of the weight and twice it."""
    from torch.testing._internal.two_tensor import TwoTensor

    with torch.device(device):
        model = nn.Linear(8, 6)
        weight = model.weight.detach()
        model.weight = nn.Parameter(TwoTensor(weight, 2 * weight), requires_grad=requires_grad)
    return model


def _meta_subclass_job() -> dict:
    """A tensor-subclass parameter made on the meta device: its local shard keeps the
    subclass through ``fully_shard``, ``to_empty`` and a load, as under FSDP2."""
    out: dict = {}
    for impl, shard in _impls():
        model = _two_tensor_linear("meta", requires_grad=False)
        shard(model)  # type: ignore[operator]
        seen = [type(model.weight.to_local()).__name__, model.weight.to_local().device.type]
        model.to_empty(device="cpu")
        seen.append(type(model.weight.to_local()).__name__)
        state = model.state_dict()
        for tensor in state.values():
            tensor.fill_(0.5)
        model.load_state_dict(state)
        local = model.weight.to_local()
        seen.append(type(local).__name__)
        out[impl] = (seen, local.a.tolist(), local.b.tolist())
    return out


def test_meta_subclass_parameter_keeps_its_subclass() -> None:
    for r in run_distributed(_meta_subclass_job, 2):
        assert r["fsdp_compose"] == r["fsdp2"], r
        assert r["fsdp2"][0] == ["TwoTensor", "meta", "TwoTensor", "TwoTensor"], r


def _subclass_training_job() -> dict:
    """A tensor-subclass parameter without all-gather extension, made on the meta
    device or not: what the forward computes with (FSDP2 gathers the subclass into a
    plain tensor, on one rank too), the gradient, and the state dict."""
    from torch.testing._internal.two_tensor import TwoTensor

    rank = rank_world()[0]
    out: dict = {}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    for impl, shard in _impls():
        for meta in (False, True):
            torch.manual_seed(0)
            model = _two_tensor_linear("meta" if meta else "cpu")
            shard(model)  # type: ignore[operator]
            if meta:
                model.to_empty(device="cpu")
                torch.manual_seed(1)
                full = {"weight": torch.randn(6, 8), "bias": torch.randn(6)}
                full["weight"] = TwoTensor(full["weight"], 2 * full["weight"])
                state = {
                    name: torch.distributed.tensor.distribute_tensor(
                        full[name], value.device_mesh, value.placements
                    )
                    for name, value in model.state_dict().items()
                }
                model.load_state_dict(state, assign=True)
            y = model(x)
            seen = [type(y).__name__, type(model.weight).__name__]
            y.sum().backward()
            grad = model.weight.grad.to_local()
            seen.append(type(grad).__name__)
            seen.append({k: type(v.to_local()).__name__ for k, v in model.state_dict().items()})
            values = [t.detach() for t in (y, grad)]  # (a subclass as its inner tensors)
            values = [[t.a, t.b] if isinstance(t, TwoTensor) else [t] for t in values]
            out[impl, meta] = (seen, [[t.tolist() for t in ts] for ts in values])
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_subclass_parameter_gathers_as_under_fsdp2(world: int) -> None:
    for r in run_distributed(_subclass_training_job, world):
        for meta in (False, True):
            assert r["fsdp_compose", meta] == r["fsdp2", meta], (meta, r)
            assert r["fsdp2", meta][0][:3] == ["Tensor", "Parameter", "Tensor"], r


def _registered_after_eval_job() -> dict:
    """What ``named_parameters()`` holds after a no-grad forward (an evaluation),
    training around evaluations (bit-identical to FSDP2), and an optimizer built after
    one (which FSDP2 gives the root's unsharded parameters)."""
    rank = rank_world()[0]
    out: dict = {}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    for impl, shard in _impls():
        for optimizer_after_eval in (False, True):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 4))
            shard(model[0])  # type: ignore[operator]
            shard(model[2], reshard_after_forward=False)  # type: ignore[operator]
            shard(model)  # type: ignore[operator]  # the root: stays unsharded after forward
            before = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
            if not optimizer_after_eval:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            seen, losses = [], []
            for _ in range(2):
                with torch.no_grad():
                    model(x)
                seen.append({n: type(p).__name__ for n, p in model.named_parameters()})
                if optimizer_after_eval and not losses:
                    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            after = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
            updated = sorted(n for n in after if not torch.equal(after[n], before[n]))
            out[impl, optimizer_after_eval] = (seen, losses, after, updated)
    return out


def test_parameters_registered_after_a_no_grad_forward() -> None:
    for r in run_distributed(_registered_after_eval_job, 2):
        ours, fsdp2 = r["fsdp_compose", False], r["fsdp2", False]
        assert ours[1] == fsdp2[1], (ours[1], fsdp2[1])  # losses, bit-identical
        for name, value in ours[2].items():
            assert torch.equal(value, fsdp2[2][name]), name
        # FSDP2 leaves the unsharded parameters of units that stay gathered (the root,
        # model[2]) registered after an evaluation; fsdp_compose shows the shards
        # again (docs/fsdp2_compatibility.md, "Remaining differences").
        assert fsdp2[0][0]["3.weight"] == fsdp2[0][0]["2.weight"] == "Parameter", fsdp2[0]
        assert set(ours[0][0].values()) == {"DTensor"}, ours[0]
        # So an optimizer built after an evaluation updates every parameter, where
        # FSDP2's would leave those units' parameters as they were.
        ours_late, fsdp2_late = r["fsdp_compose", True], r["fsdp2", True]
        assert len(ours_late[3]) == 6 and ours_late[1] == ours[1], ours_late
        assert "3.weight" not in fsdp2_late[3] and "0.weight" in fsdp2_late[3], fsdp2_late[3]


def _state_dict_reshards_job() -> dict:
    """``state_dict()`` between a forward and its backward, with every unit staying
    gathered (``reshard_after_forward=False``): torch's state-dict save/load scenario."""
    import threading

    rank = rank_world()[0]
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    out: dict = {}
    for impl, shard in _impls():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
        shard(model[0], reshard_after_forward=False)  # type: ignore[operator]
        shard(model, reshard_after_forward=False)  # type: ignore[operator]
        loss = model(x).square().mean()
        gathered = sorted({type(p).__name__ for p in model.parameters()})
        sd = model.state_dict()
        shards = {
            n: (type(p).__name__, p.to_local().detach().clone())
            for n, p in model.named_parameters()
        }
        saved = {k: (type(v).__name__, v.to_local().detach().clone()) for k, v in sd.items()}
        loss.backward()  # (the units gather again for backward)
        grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
        out[impl] = (gathered, shards, saved, loss.item(), grads)
        if impl == "fsdp_compose":  # from another thread, mid-step: the units stay as they are
            model(x)
            other: list = []

            def save(into: list = other, module: nn.Module = model) -> None:
                into.append(module.state_dict())

            thread = threading.Thread(target=save)
            thread.start()
            thread.join()
            registered = sorted({type(p).__name__ for p in model.parameters()})
            values = {
                k: (type(v).__name__, v.to_local().detach().clone()) for k, v in other[0].items()
            }
            out["other_thread"] = (registered, values)
    return out


def test_state_dict_reshards_as_under_fsdp2() -> None:
    for r in run_distributed(_state_dict_reshards_job, 2):
        (gathered, shards, saved, loss, grads), fsdp2 = r["fsdp_compose"], r["fsdp2"]
        assert gathered == fsdp2[0] == ["Parameter"], (gathered, fsdp2[0])
        # [Note: state_dict reshards]: afterwards model.parameters() shows the shards.
        assert {t for t, _ in shards.values()} == {"DTensor"}, shards
        for name, (kind, value) in shards.items():
            assert kind == fsdp2[1][name][0] and torch.equal(value, fsdp2[1][name][1]), name
            assert saved[name][0] == "DTensor" and torch.equal(saved[name][1], value), name
        assert loss == fsdp2[3]
        assert all(torch.equal(g, fsdp2[4][n]) for n, g in grads.items()), grads
        # From another thread (torchft's recovery) the shards are saved, and the units
        # of the step in progress keep their unsharded parameters registered.
        registered, values = r["other_thread"]
        assert registered == ["Parameter"], registered
        assert values.keys() == saved.keys(), values
        for key, (kind, value) in values.items():  # (no optimizer step: the same shards)
            assert kind == "DTensor" and torch.equal(value, saved[key][1]), key


class _WithMethod(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def double(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.lin(x)


def _forward_method_job() -> dict:
    torch.manual_seed(0)
    ref = _WithMethod()
    model = copy.deepcopy(ref)
    fully_shard(model, reshard_after_forward=True)
    register_fsdp_forward_method(model, "double")
    x = torch.randn(3, 8)
    y = model.double(x)
    out = {
        "equal": torch.allclose(y, ref.double(x)),
        "resharded": isinstance(model.lin.weight, DTensor),
    }
    y.sum().backward()
    out["grad"] = isinstance(model.lin.weight.grad, DTensor)
    register_fsdp_forward_method(nn.Linear(2, 2), "forward")  # no-op on plain modules
    return out


def test_register_fsdp_forward_method() -> None:
    for r in run_distributed(_forward_method_job, 2):
        assert r == {"equal": True, "resharded": True, "grad": True}


def _group_job() -> dict:
    rank, world = rank_world()
    torch.manual_seed(0)
    cfg = GPTConfig(**{**TINY, "tie_weights": True})
    ref = GPT(cfg)
    model = copy.deepcopy(ref)
    for block in model.blocks:
        fully_shard(block)
    grouped = fully_shard([model.tok_emb, model.lm_head])  # tied weight in one unit
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    diffs = []
    for step in range(3):
        x, y = make_batch(cfg, 2 * world, step)
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = torch.tensor([loss.item()])
        torch.distributed.all_reduce(t)
        diffs.append(abs(t.item() / world - ref_loss.item()))
    return {
        "returned_list": isinstance(grouped, list)
        and all(isinstance(m, FSDPModule) for m in grouped),
        "tied": model.lm_head.weight is model.tok_emb.weight,
        "diffs": diffs,
        "param_diff": max_param_diff(model, ref)[0],
    }


def test_grouped_unit_with_tied_weights() -> None:
    for r in run_distributed(_group_job, 2):
        assert r["returned_list"] and r["tied"]
        assert max(r["diffs"]) < 1e-5
        assert r["param_diff"] < 1e-4
