"""Training with tensor-subclass parameters, against torch's FSDP2 in the same job:
torchao float8 training with float8 all-gather (trainable subclass weights, the
hooks' inputs, all-gather bytes against bf16), activation checkpointing, and
AdamW (``foreach`` / ``fused``) on zero-element local shards; the peak live
bytes of a dequantizing rebuild against FSDP2's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from test_tensor_subclass import CALLS, Int8RowWise, _model, _per_weight, _shard
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_compose import MixedPrecisionPolicy, fully_shard


def _torchao_float8() -> Any:
    return pytest.importorskip("torchao.float8")


class AllGatherBytes(TorchDispatchMode):
    """Counts the bytes that c10d all-gathers produce (FSDP2's and ours alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if "allgather" in str(func):  # c10d._allgather_base_: (output, input, ...)
            out = args[0]
            self.nbytes += out.numel() * out.element_size()
        return func(*args, **(kwargs or {}))


class LiveBytes:
    """The high-water mark of live bytes in the storages that tensor operations
    read or write while :attr:`mode` is active (re-read after every operation, so
    storages freed or re-allocated with ``resize_`` count at their size then)."""

    def __init__(self) -> None:
        from torch.utils.weak import WeakIdKeyDictionary

        self.live = WeakIdKeyDictionary()
        self.peak = 0  # over every operation: transients of the rebuild included
        self.at_layers = 0  # where :meth:`sample` is called (e.g. layer entries)
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(
                self, func: Any, types: Any, args: Any = (), kwargs: Any = None
            ) -> Any:
                from torch.utils._pytree import tree_leaves

                out = func(*args, **(kwargs or {}))
                for t in tree_leaves((out, args, kwargs)):
                    if isinstance(t, torch.Tensor) and type(t) is torch.Tensor:
                        counter.live[t.untyped_storage()] = True
                counter.peak = max(counter.peak, counter.live_bytes())
                return out

        self.mode = Mode()

    def live_bytes(self) -> int:
        return sum(s.nbytes() for s in self.live)

    def sample(self, *args: Any) -> None:
        self.at_layers = max(self.at_layers, self.live_bytes())


@contextlib.contextmanager
def _recorded_float8_hooks(calls: list[tuple[Any, ...]]) -> Iterator[None]:
    """Records torchao's float8 weight hooks' inputs and outputs (for this job only)."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Weight

    pre, post = Weight.fsdp_pre_all_gather, Weight.fsdp_post_all_gather

    def summary(ts: Any) -> list[tuple[Any, ...]]:
        return [(tuple(t.shape), t.dtype, float(t.float().sum())) for t in ts]

    def recorded_pre(self: Any, mesh: Any) -> Any:
        inputs, metadata = pre(self, mesh)
        shard = (tuple(self.shape), float(self._tensor.sum()))
        calls.append(("pre", shard, mesh.size(), summary(inputs), float(metadata[0])))
        return inputs, metadata

    def recorded_post(
        self: Any, outputs: Any, metadata: Any, dtype: Any, *, out: Any = None
    ) -> Any:
        calls.append(("post", summary(outputs), float(metadata[0]), dtype, out is not None))
        return post(self, outputs, metadata, dtype, out=out)

    Weight.fsdp_pre_all_gather, Weight.fsdp_post_all_gather = recorded_pre, recorded_post
    try:
        yield
    finally:
        Weight.fsdp_pre_all_gather, Weight.fsdp_post_all_gather = pre, post


def _float8_model(float8: bool = True, rows: int = 32, wrap: bool = False) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, rows), nn.ReLU(), nn.Linear(rows, 16))
    if float8:
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=config)
    if wrap:
        _checkpoint(model)
    return model


def _checkpoint(model: nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i in (0, 2):
        model[i] = checkpoint_wrapper(model[i])


def _steps(
    model: nn.Module, steps: int, same_batch: bool = False, d_in: int = 16, **adamw: Any
) -> dict:
    """Trains with AdamW; returns the losses, the first step's gradients and the
    final parameters (full tensors)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01, **adamw)
    torch.manual_seed(5 if same_batch else 1 + torch.distributed.get_rank())
    losses, grads = [], {}
    for step in range(steps):
        loss = model(torch.randn(8, d_in)).float().pow(2).mean()
        loss.backward()
        if step == 0:
            grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: _full(p) for n, p in model.named_parameters() if p.requires_grad}
    return {"losses": losses, "grads": grads, "params": params}


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return getattr(full, "_tensor", full)  # a float8 weight's high-precision tensor


def _assert_same(a: dict, b: dict, what: str) -> None:
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), msg=what)
    for key in ("grads", "params"):
        assert a[key].keys() == b[key].keys(), (what, key)
        for name in a[key]:
            torch.testing.assert_close(a[key][name], b[key][name], msg=f"{what}: {key} {name}")


def _float8_parity_job(param_dtype: Any) -> dict[str, int]:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    runs, nbytes = {}, {}
    sides = (("torch", torch_fully_shard, TorchMP), ("ours", fully_shard, MixedPrecisionPolicy))
    for name, shard_fn, mp_cls in sides:
        policy = mp_cls(param_dtype=param_dtype)
        for float8 in (True, False):  # the bytes of one training step, float8 and not
            model = _float8_model(float8)
            _shard(model, shard_fn, mp_policy=policy)
            with AllGatherBytes() as counter:
                model(torch.randn(8, 16)).float().pow(2).mean().backward()
            nbytes[f"{name} float8={float8}"] = counter.nbytes
        model = _float8_model()
        _shard(model, shard_fn, mp_policy=policy)
        local = model[0].weight._local_tensor
        assert isinstance(local, WeightWithDynamicFloat8CastTensor), type(local)
        assert model[0].weight.requires_grad  # a trainable subclass weight
        calls: list[tuple[Any, ...]] = []
        with _recorded_float8_hooks(calls):
            runs[name] = _steps(model, 3)
        runs[name]["calls"] = calls
    (t, o) = runs["torch"], runs["ours"]
    assert o["calls"] and _group(o["calls"]) == _group(t["calls"]), (t["calls"], o["calls"])
    _assert_same(o, t, "float8 against FSDP2")
    # The float8 weights cross the wire as one byte per element, as with FSDP2.
    assert nbytes["ours float8=True"] == nbytes["torch float8=True"], nbytes
    assert nbytes["ours float8=False"] == nbytes["torch float8=False"], nbytes
    return {**nbytes, "hook calls": len(o["calls"])}


def _group(calls: list[tuple[Any, ...]]) -> dict[Any, list[tuple[Any, ...]]]:
    """Calls per weight, in order (FSDP2 issues the units' backward prefetch later)."""
    grouped: dict[Any, list[tuple[Any, ...]]] = {}
    for c in calls:
        shape = c[1][0] if c[0] == "pre" else c[1][0][0]
        grouped.setdefault((c[0], shape[-1]), []).append(c)
    return grouped


def test_float8_all_gather_parity_with_fsdp2() -> None:
    """torchao float8 training (``enable_fsdp_float8_all_gather=True``, CPU): the
    hooks' inputs and outputs, losses, gradients and updates equal FSDP2's; with
    bf16 compute, each step all-gathers 1 byte per weight element instead of 2."""
    _torchao_float8()
    (result, *_) = run_distributed(_float8_parity_job, 2, torch.bfloat16)
    # 2 layers' weights (16 x 32 each) per all-gather, forward and backward: the
    # float8 step saves one byte per weight element per gather on every rank.
    weight_elems = 2 * 16 * 32
    saved = result["ours float8=False"] - result["ours float8=True"]
    assert saved == 2 * weight_elems, result


def _float8_uneven_job() -> None:
    # 6 rows over 3 ranks would be even; 7 rows give 3, 3, 1 (FSDP2 raises on the
    # padded rank: torchao returns unpadded all-gather inputs, pytorch/ao#3982).
    reference, model = _float8_model(rows=7), _float8_model(rows=7)
    _shard(model, fully_shard)
    _assert_same(_steps(model, 3, same_batch=True), _steps(reference, 3, same_batch=True), "")


def test_float8_uneven_shards_match_one_process() -> None:
    _torchao_float8()
    run_distributed(_float8_uneven_job, 3)


def _float8_empty_shard_job() -> None:
    # 4 rows over 3 ranks: 2, 2 and an empty shard on rank 2. torchao's pre-all-gather
    # hook takes the amax of its input (max() of an empty tensor raises) and
    # all-reduces it: an empty shard's hooks see its padding rows, zeros.
    reference, model = _float8_model(rows=4), _float8_model(rows=4)
    _shard(model, fully_shard)
    assert model[0].weight.to_local().numel() == 0 or torch.distributed.get_rank() != 2
    _assert_same(_steps(model, 3, same_batch=True), _steps(reference, 3, same_batch=True), "")


def test_float8_empty_shard_matches_one_process() -> None:
    _torchao_float8()
    run_distributed(_float8_empty_shard_job, 3)


# -- activation checkpointing --------------------------------------------


def _ac_job(kind: str) -> int:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    runs = {}
    for name, shard_fn in (("torch", torch_fully_shard), ("ours", fully_shard)):
        calls: list[tuple[Any, ...]]
        if kind == "float8":
            model, calls = _float8_model(wrap=True), []
            with _recorded_float8_hooks(calls):
                _shard(model, shard_fn)
                runs[name] = _steps(model, 3)
        else:  # frozen int8 weights, trainable adapters
            model = _model(Int8RowWise)
            _checkpoint(model)
            _shard(model, shard_fn)
            CALLS.clear()
            runs[name] = _steps(model, 3)
            calls = list(CALLS)
        runs[name]["calls"] = calls
    (t, o) = runs["torch"], runs["ours"]
    group = _group if kind == "float8" else _per_weight
    assert o["calls"] and group(o["calls"]) == group(t["calls"]), (t["calls"], o["calls"])
    _assert_same(o, t, f"{kind} with activation checkpointing")
    return len(o["calls"])


@pytest.mark.parametrize("kind", ["int8", "float8"])
def test_activation_checkpointing_parity_with_fsdp2(kind: str) -> None:
    """checkpoint_wrapper around each subclass layer: the recomputed forward
    reuses the unsharded weights (no extra hook calls) exactly as under FSDP2."""
    if kind == "float8":
        _torchao_float8()
    run_distributed(_ac_job, 2, kind)


# -- zero-element shards and foreach / fused AdamW -----------------------


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    # 3 rows over 4 ranks: rank 3's shard of each first weight and bias is empty.
    return nn.Sequential(nn.Linear(8, 3), nn.ReLU(), nn.Linear(3, 9), nn.ReLU(), nn.Linear(9, 3))


def _empty_shard_job(flag: str) -> None:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    adamw = {flag: True, "d_in": 8}
    reference = _steps(_tiny_model(), 3, same_batch=True, **adamw)
    for shard_fn in (torch_fully_shard, fully_shard):
        model = _tiny_model()
        _shard(model, shard_fn)
        empty = model[0].weight._local_tensor.numel() == 0
        assert empty == (torch.distributed.get_rank() == 3)
        _assert_same(_steps(model, 3, same_batch=True, **adamw), reference, shard_fn.__module__)
    adamw["d_in"] = 16
    # A frozen subclass weight with an empty shard next to trainable adapters.
    subclass_ref = _model(uneven=True)
    model = _model(uneven=True)
    _shard(model, fully_shard)
    ours = _steps(model, 3, same_batch=True, **adamw)
    _assert_same(ours, _steps(subclass_ref, 3, same_batch=True, **adamw), "subclass")


@pytest.mark.parametrize("flag", ["foreach", "fused"])
def test_empty_local_shards_with_foreach_and_fused_adamw(flag: str) -> None:
    """W=4, 3-row parameters: rank 3 holds zero-element shards; every parameter
    equals the one-process AdamW run's (same flag), so no neighbour is corrupted."""
    run_distributed(_empty_shard_job, 4, flag)


# -- memory of the per-parameter all-gather ---------------------------------


def _rebuild_peak_job(which: str) -> int:
    """Live bytes at their highest in one forward + backward of three frozen int8
    layers dequantized at rebuild (release hook on), after a warm-up step."""
    from test_tensor_subclass import QLinear, Released
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[QLinear(64, 64, Released) for _ in range(3)])
    shard = fully_shard if which == "ours" else torch_fully_shard
    for layer in model:
        shard(layer)
    shard(model)
    x = torch.randn(4, 64)
    model(x).pow(2).mean().backward()
    counter = LiveBytes()
    with counter.mode:
        model(x).pow(2).mean().backward()
    return counter.peak


def test_packed_all_gather_output_freed_before_rebuild() -> None:
    """The peak over all operations is no higher than FSDP2's: the unit's packed
    all-gather output is freed once copied out, before ``fsdp_post_all_gather``
    dequantizes, while the next unit's backward prefetch may already be in flight
    (FSDP2 issues that prefetch after the rebuild and frees its own output then)."""
    ours = run_distributed(_rebuild_peak_job, 2, "ours")
    theirs = run_distributed(_rebuild_peak_job, 2, "torch")
    for mine, fsdp2 in zip(ours, theirs):
        assert mine <= fsdp2, (mine, fsdp2)


def _patched_extension_job() -> dict:
    """torch's monkey-patch scenario: FSDP2's all-gather hooks set on each weight's
    local tensor after ``fully_shard`` (no subclass), gathering in bf16. FSDP2 looks for
    the hooks at each all-gather, so they count; against FSDP2 in the same job."""
    from torch.autograd.grad_mode import _unsafe_preserve_version_counter
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.testing._internal.common_fsdp import MLP

    out = {}
    for name, shard in (("fsdp2", torch_fully_shard), ("fsdp_compose", fully_shard)):
        calls: list[int] = []

        def pre(self: Any, mesh: Any, size: Any, stride: Any, module: Any, mp: Any) -> Any:
            calls.append(1)  # noqa: B023 (run inside this iteration)
            return (self.to(torch.bfloat16),), None

        @torch.no_grad()
        def post(self: Any, outputs: Any, metadata: Any, dtype: Any, *, out: Any = None) -> Any:
            (gathered,) = outputs
            if out is not None:
                with _unsafe_preserve_version_counter(out):  # as torch's own test hooks
                    out.copy_(gathered)
                return None
            upcast = gathered.to(dtype)
            return upcast, (gathered, upcast)

        torch.manual_seed(0)
        model = nn.Sequential(*[MLP(8, bias=False) for _ in range(2)])
        for mlp in model:
            shard(mlp)
        shard(model)
        for param_name, param in model.named_parameters():
            if "weight" in param_name:
                local = param._local_tensor
                local.fsdp_pre_all_gather = pre.__get__(local)
                local.fsdp_post_all_gather = post.__get__(local)
        optim = torch.optim.SGD(model.parameters(), lr=1e-2)
        inp = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
        losses = []
        for _ in range(2):
            loss = model(inp).sum()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        out[name] = (losses, len(calls), [p.full_tensor().detach() for p in model.parameters()])
    return out


def test_all_gather_hooks_set_after_fully_shard_as_fsdp2() -> None:
    for r in run_distributed(_patched_extension_job, 2):
        (losses, calls, params), fsdp2 = r["fsdp_compose"], r["fsdp2"]
        assert losses == fsdp2[0] and calls == fsdp2[1] > 0, (losses, calls, fsdp2[:2])
        assert all(torch.equal(a, b) for a, b in zip(params, fsdp2[2]))
