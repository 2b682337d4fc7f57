"""Tensor-subclass parameters with FSDP2's all-gather extension
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``), against torch's FSDP2 in the
same job: losses, parameters, and the hooks' calls and inputs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from dist_utils import run_distributed
from torch import nn

from fsdp_compose import MixedPrecisionPolicy, fully_shard

aten = torch.ops.aten

# The hooks' calls on this rank, in order (cleared by each run).
CALLS: list[tuple[Any, ...]] = []


class Int8RowWise(torch.Tensor):
    """A weight stored as int8 rows and one scale per row, reading as
    ``data * scale[:, None]``; all-gathers its int8 data and scales (FSDP2's
    extension), and computes every other operation on the dequantized values."""

    _data: torch.Tensor
    _scale: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, shape: Any = None) -> Int8RowWise:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, shape or data.shape, dtype=scale.dtype, device=data.device
        )

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, shape: Any = None) -> None:
        self._data, self._scale = data, scale

    @staticmethod
    def quantize(weight: torch.Tensor) -> Int8RowWise:
        scale = weight.abs().amax(dim=1).clamp(min=1e-6) / 127
        return Int8RowWise(torch.round(weight / scale[:, None]).to(torch.int8), scale)

    def dequantize(self) -> torch.Tensor:
        return self._data.to(self._scale.dtype) * self._scale[:, None]

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data", "_scale"], tuple(self.shape)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: Any, size: Any, stride: Any) -> Int8RowWise:
        return Int8RowWise(inner["_data"], inner["_scale"], meta)

    def __repr__(self) -> str:
        return f"Int8RowWise(shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        x = args[0]
        new = type(x)
        if func in (aten.detach.default, aten.alias.default, aten.clone.default):
            return new(func(x._data), func(x._scale), x.shape)
        if func is aten.new_zeros.default:
            size = args[1]
            return new(x._data.new_zeros(size), x._scale.new_zeros(size[:1]))
        if func is aten.view.default:  # FSDP2 keeps a flat view of the padded shard
            return new(x._data, x._scale, torch.empty(x.shape, device="meta").view(args[1]).shape)
        if func is aten.as_strided.default and tuple(args[1]) == tuple(x.shape):
            return new(x._data, x._scale, x.shape)  # FSDP2's unsharded view
        if func is aten.slice.Tensor:
            assert args[1] == 0, "row slices only"
            return new(func(x._data, *args[1:]), func(x._scale, *args[1:]))
        if func is aten.split.Tensor:  # torch.chunk, as FSDP2 cuts shards
            assert kwargs.get("dim", args[2] if len(args) > 2 else 0) == 0, "row splits only"
            pairs = zip(x._data.split(args[1]), x._scale.split(args[1]))
            return [new(d, sc) for d, sc in pairs]
        if func is aten.copy_.default and isinstance(args[1], Int8RowWise):
            x._data.copy_(args[1]._data)
            x._scale.copy_(args[1]._scale)
            return x
        if func is aten._to_copy.default and kwargs.get("dtype", x.dtype) == x.dtype:
            device = kwargs.get("device", x.device)
            return new(x._data.to(device), x._scale.to(device))
        unwrap = lambda t: t.dequantize() if isinstance(t, Int8RowWise) else t  # noqa: E731
        return func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs))

    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: Any,
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        world = mesh.size()
        CALLS.append(
            (
                "pre",
                tuple(self.shape),
                tuple(outer_size),
                tuple(outer_stride),
                world,
                type(module).__mro__[1].__name__,
                mp_policy.param_dtype,
                int(self._data.sum()),
                float(self._scale.sum()),
            )
        )
        # Uneven shards: every rank contributes the padded shard's rows (FSDP2's rule).
        pad = -(-outer_size[0] // world) - self._data.shape[0]
        data, scale = F.pad(self._data, (0, 0, 0, pad)), F.pad(self._scale, (0, pad))
        if mp_policy.param_dtype is not None:
            scale = scale.to(mp_policy.param_dtype)
        return (data, scale), (outer_size[0],)

    def fsdp_post_all_gather(
        self,
        outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        CALLS.append(
            (
                "post",
                [(tuple(o.shape), o.dtype) for o in outputs],
                metadata,
                param_dtype,
                out is not None,
                int(outputs[0].sum()),
                float(outputs[1].sum()),
            )
        )
        (rows,) = metadata
        data, scale = outputs[0][:rows], outputs[1][:rows]
        cast = scale.dtype != param_dtype
        scale = scale.to(param_dtype)
        if out is not None:
            assert isinstance(out, Int8RowWise)
            # The out= fast path: out's inner tensors are the (refilled) outputs.
            assert out._data.untyped_storage().data_ptr() == outputs[0].untyped_storage().data_ptr()
            if cast:
                out._scale.copy_(scale)
            return None
        return type(self)(data, scale), ((scale,) if cast else ())


class Int8RowWiseMeshOnly(Int8RowWise):
    """The same weight with FSDP2's older one-argument pre-all-gather hook."""

    def fsdp_pre_all_gather(self, mesh: Any) -> tuple[tuple[torch.Tensor, ...], Any]:  # type: ignore[override]
        CALLS.append(("pre1", tuple(self.shape), mesh.size(), int(self._data.sum())))
        return (self._data, self._scale), (self._data.shape[0] * mesh.size(),)


class Released(Int8RowWise):
    """Dequantizes at post-all-gather and lets the gathered buffers go at once."""

    def fsdp_should_release_all_gather_outputs_after_post_all_gather(self) -> bool:
        return True

    def fsdp_post_all_gather(  # type: ignore[override]
        self,
        outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        (rows,) = metadata
        full = outputs[0][:rows].to(param_dtype) * outputs[1][:rows, None].to(param_dtype)
        CALLS.append(("post_released", out is not None, float(full.sum())))
        if out is not None:
            # Backward may hold the unsharded weight: refill it as FSDP2 refills
            # gathered parameters, without bumping its version.
            with torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(full)
            return None
        return full, (full,)


class QLinear(nn.Module):
    """A frozen quantized linear with a trainable low-rank adapter (QLoRA's shape)."""

    def __init__(self, d_in: int, d_out: int, kind: type = Int8RowWise) -> None:
        super().__init__()
        q = Int8RowWise.quantize(torch.randn(d_out, d_in))
        self.weight = nn.Parameter(kind(q._data, q._scale), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(2, d_in) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(d_out, 2) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) + x @ self.lora_a.t() @ self.lora_b.t()


def _model(kind: type = Int8RowWise, uneven: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if uneven:  # 6 and 7 rows: W=4 leaves the first weight's last shard empty, W=3 is uneven
        return nn.Sequential(QLinear(16, 6, kind), nn.ReLU(), QLinear(6, 7, kind), nn.Linear(7, 5))
    # FSDP2 takes subclass weights whose rows divide evenly (else every all-gather input
    # must have the padded shard's shape); the adapters (2 rows) and the head (5 rows)
    # give these units uneven and empty shards at W=3 and W=4.
    return nn.Sequential(QLinear(16, 12, kind), nn.ReLU(), QLinear(12, 12, kind), nn.Linear(12, 5))


def _shard(model: nn.Module, shard_fn: Any, **kwargs: Any) -> None:
    for layer in (model[0], model[2]):
        shard_fn(layer, **kwargs)
    shard_fn(model, **kwargs)


def _train(model: nn.Module, steps: int, accumulate: bool) -> list[float]:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    torch.manual_seed(1 + torch.distributed.get_rank())
    losses = []
    for _ in range(steps):
        micro = 2 if accumulate else 1
        for i in range(micro):
            model.set_requires_gradient_sync(i == micro - 1)
            loss = model(torch.randn(4, 16)).pow(2).mean()
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        local = p._local_tensor
        if isinstance(local, Int8RowWise):  # the subclass must survive sharding
            out[name + ".data"] = torch.tensor(
                [float(local._data.sum()), float(local._scale.sum())]
            )
        else:
            out[name] = p.full_tensor().detach()
    return out


def _parity_job(reshard: bool, accumulate: bool, param_dtype: Any, kind_name: str) -> str | None:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    kind = {"5": Int8RowWise, "1": Int8RowWiseMeshOnly}[kind_name]
    runs = {}
    for name, shard_fn, mp_cls in (
        ("torch", torch_fully_shard, TorchMP),
        ("ours", fully_shard, MixedPrecisionPolicy),
    ):
        model = _model(kind)
        _shard(
            model,
            shard_fn,
            reshard_after_forward=reshard,
            mp_policy=mp_cls(param_dtype=param_dtype),
        )
        for fqn, p in model.named_parameters():
            assert isinstance(p._local_tensor, kind) == (not p.requires_grad), fqn
        CALLS.clear()
        losses = _train(model, 3, accumulate)
        runs[name] = (losses, _full(model), list(CALLS))
    (l_t, p_t, c_t), (l_o, p_o, c_o) = runs["torch"], runs["ours"]
    assert c_o, "the hooks were never called"
    # Per weight (the units' order differs: fsdp_compose issues a backward prefetch
    # before copying out the current unit, FSDP2 after).
    assert _per_weight(c_o) == _per_weight(c_t), f"hook calls differ:\ntorch {c_t}\nours  {c_o}"
    torch.testing.assert_close(torch.tensor(l_o), torch.tensor(l_t), rtol=1e-5, atol=1e-6)
    assert p_o.keys() == p_t.keys()
    for k in p_t:
        torch.testing.assert_close(p_o[k], p_t[k], rtol=1e-5, atol=1e-6, msg=k)
    return f"{len(c_o)} hook calls"


def _per_weight(calls: list[tuple[Any, ...]]) -> dict[Any, list[tuple[Any, ...]]]:
    """The calls grouped by weight: its global rows and columns."""
    grouped: dict[Any, list[tuple[Any, ...]]] = {}
    for c in calls:
        key = c[2] if c[0] == "pre" else c[1][0][0] if c[0] == "post" else c[1]
        grouped.setdefault(("post" if c[0] == "post" else "pre", key[-1]), []).append(c)
    return grouped


@pytest.mark.parametrize("world", [2, 3, 4])
def test_int8_subclass_parity_with_fsdp2(world: int) -> None:
    """W=2 even, W=3 uneven, W=4 an empty trailing shard; reshard after forward."""
    results = run_distributed(_parity_job, world, True, False, None, "5")
    assert all(r and r.endswith("hook calls") for r in results)


@pytest.mark.parametrize("reshard, accumulate", [(False, False), (True, True), (False, True)])
def test_int8_subclass_no_reshard_and_no_sync(reshard: bool, accumulate: bool) -> None:
    run_distributed(_parity_job, 3, reshard, accumulate, None, "5")


def test_int8_subclass_mixed_precision() -> None:
    """param_dtype reaches both hooks; the scales are cast, the out= path refills them."""
    run_distributed(_parity_job, 2, True, False, torch.bfloat16, "5")


def test_one_argument_pre_all_gather_hook() -> None:
    run_distributed(_parity_job, 2, True, False, None, "1")


def _release_job() -> None:
    model = _model(Released)
    _shard(model, fully_shard)
    reference = _model(Int8RowWise)
    CALLS.clear()
    x = torch.randn(4, 16)
    for _ in range(2):
        torch.testing.assert_close(model(x), reference(x))
    assert [c[1] for c in CALLS if c[0] == "post_released"] == [False] * 2 + [True] * 2
    # Unsharded, the gathered int8 data and scales are gone; the rebuilt weight is not.
    model[0].unshard()
    (unit,) = model[0]._units(recurse=False)
    outputs = [o for pg in unit.extension.params for o in pg.outputs]
    weight = model[0].weight
    assert type(weight) is nn.Parameter and weight.untyped_storage().size() > 0
    assert [o.untyped_storage().size() for o in outputs[:2]] == [0, 0]  # the weight's
    assert all(o.untyped_storage().size() > 0 for o in outputs[2:])  # the adapters'
    model[0].reshard()
    assert weight.untyped_storage().size() == 0
    # Backward re-gathers through out= while autograd holds the weight.
    for m in (model, reference):
        m(x).pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)


def test_release_hook_and_out_path() -> None:
    run_distributed(_release_job, 2)


def _sharding_job() -> list[Any]:
    model = _model(uneven=True)
    full = {
        n: (p._data.clone(), p._scale.clone())
        for n, p in model.named_parameters()
        if isinstance(p, Int8RowWise)
    }
    _shard(model, fully_shard)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    shapes = []
    for name, p in model.named_parameters():
        if name not in full:
            continue
        local = p._local_tensor
        assert isinstance(local, Int8RowWise), type(local)
        assert p.shape == full[name][0].shape  # the DTensor's global shape
        rows = -(-full[name][0].shape[0] // world)
        start = min(rank * rows, full[name][0].shape[0])
        torch.testing.assert_close(local._data, full[name][0][start : start + rows])
        torch.testing.assert_close(local._scale, full[name][1][start : start + rows])
        shapes.append(tuple(local.shape))
    sd = model.state_dict()
    assert isinstance(sd["0.weight"]._local_tensor, Int8RowWise)
    assert sd["0.weight"].placements == model[0].weight.placements
    with torch.device("meta"):
        meta_model = _model(uneven=True)
    _shard(meta_model, fully_shard)
    local = meta_model[0].weight._local_tensor
    assert isinstance(local, Int8RowWise) and local.is_meta, type(local)
    return shapes


def test_subclass_stays_the_local_tensor_with_empty_shards() -> None:
    """W=4 over 6 rows: 2, 2, 2, 0 (an empty trailing shard); meta-device models too."""
    shapes = run_distributed(_sharding_job, 4)
    assert [s[0] for s in shapes] == [(2, 16), (2, 16), (2, 16), (0, 16)]


def _uneven_job() -> None:
    # FSDP2 refuses this layout (an int8 weight's scales are not of the padded
    # shard's shape); fsdp_compose takes any inputs equal across ranks. Checked
    # against the unsharded model, every rank feeding the same batch.
    reference, model = _model(uneven=True), _model(uneven=True)
    _shard(model, fully_shard)
    opts = [
        torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
        for m in (reference, model)
    ]
    torch.manual_seed(5)
    for _ in range(3):
        x = torch.randn(4, 16)
        losses = []
        for m, opt in zip((reference, model), opts):
            loss = m(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[0]), losses
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.full_tensor(), q.detach(), msg=name)


@pytest.mark.parametrize("world", [3, 4])
def test_uneven_and_empty_subclass_shards_match_one_process(world: int) -> None:
    run_distributed(_uneven_job, world)


class RankDependent(Int8RowWise):
    """A broken subclass: rank 1 gathers float64 scales."""

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp: Any
    ) -> Any:
        (data, scale), meta = super().fsdp_pre_all_gather(
            mesh, outer_size, outer_stride, module, mp
        )
        if torch.distributed.get_rank() == 1:
            scale = scale.double()
        return (data, scale), meta


def _bad_job() -> str:
    model = _model(RankDependent)
    _shard(model, fully_shard)
    try:
        model(torch.randn(4, 16))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_inconsistent_hooks_raise_naming_the_parameter() -> None:
    messages = run_distributed(_bad_job, 2, timeout=60)
    for m in messages:
        assert "'0.weight'" in m and "fsdp_pre_all_gather" in m, m


def _nf4_job() -> list[float]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4

    class NF4LoRA(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(to_nf4(torch.randn(256, 256)), requires_grad=False)
            self.lora_a = nn.Parameter(torch.randn(4, 256) * 0.05)
            self.lora_b = nn.Parameter(torch.randn(256, 4) * 0.05)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return linear_nf4(x, self.weight) + x @ self.lora_a.t() @ self.lora_b.t()

    results = []
    for shard_fn in (torch_fully_shard, fully_shard):
        torch.manual_seed(0)
        model = nn.Sequential(NF4LoRA(), NF4LoRA())
        for layer in model:
            shard_fn(layer)
        shard_fn(model)
        assert type(model[0].weight._local_tensor).__name__ == "NF4Tensor"
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        torch.manual_seed(1 + torch.distributed.get_rank())
        losses = []
        for _ in range(3):
            loss = model(torch.randn(4, 256)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        results.append(losses)
    torch.testing.assert_close(
        torch.tensor(results[1]), torch.tensor(results[0]), rtol=0, atol=1e-4
    )
    return results[1]


def test_torchao_nf4_parity_with_fsdp2() -> None:
    """QLoRA's frozen NF4 weights (torchao), as torchtune runs them under FSDP2."""
    pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    run_distributed(_nf4_job, 2)
