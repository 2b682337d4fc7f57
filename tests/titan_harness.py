"""torchtitan's models trained by torchtitan's own FSDP code, on CPU gloo ranks.

The job below is torchtitan's ``Trainer`` reduced to what a CPU run needs: its
``ParallelDims`` and meshes, a debug model from its model registry, the model's
``parallelize_fn`` (which calls ``torchtitan.distributed.fsdp.apply_fsdp_to_decoder``
and so ``fully_shard``), its cross-entropy loss, its ``clip_grad_norm_``, AdamW, and
synthetic token batches in place of its tokenizer and dataset.

``train(..., fsdp="fsdp_compose")`` runs the same job with the FSDP2 names that
torchtitan's modules imported (``fully_shard``, ``FSDPModule``,
``MixedPrecisionPolicy``, ``CPUOffloadPolicy``) bound to fsdp_compose's, inside
the job only; torchtitan's FSDP code itself is not changed. What CPU needs, and
nothing else, is changed in the harness: torchtitan's device type (``"cuda"`` on a
machine without an accelerator) is set to ``"cpu"`` in the job, the process group is
gloo (the test's), on which FSDP2 reduces with a sum (gloo has no ``PREMUL_SUM``;
``set_force_sum_reduction_for_comms(True)``, on every unit), compile is off, the models attend with SDPA (causal) instead of
FlexAttention, which has no backward on CPU (the same attention for the one document
per sequence of the synthetic batches), and torchtitan's MinimalAsyncEP GPU kernels
module, which imports ``triton`` at import time, is replaced by a placeholder module
whose kernels raise if called (no CPU path calls them).

Used by ``tests/test_torchtitan_client.py`` and ``benchmarks/torchtitan_client.py``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import resource
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
# The modules that imported FSDP2's names (``from torch.distributed.fsdp import ...``).
_FSDP_CLIENT_MODULES = ("torchtitan.distributed.fsdp",)
_SWAPPED = ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "CPUOffloadPolicy")
# Where torchtitan read its device type at import.
_DEVICE_TYPE_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.models.common.token_dispatcher",
)
# model name -> (registry module, flavor, registry keywords)
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama3": ("torchtitan.models.llama3", "debugmodel", {}),
    "deepseek_v3": ("torchtitan.models.deepseek_v3", "debugmodel", {}),
}


def torchtitan_available() -> bool:
    """Whether torchtitan (and its ``spmd_types`` dependency) can be imported."""
    return all(importlib.util.find_spec(m) is not None for m in ("torchtitan", "spmd_types"))


def _placeholder_kernels() -> None:
    # torchtitan.models.common imports the MinimalAsyncEP dispatcher, whose kernels
    # module imports triton; without triton (CPU builds of torch) stand in for it.
    if _KERNELS in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    module = types.ModuleType(_KERNELS)

    def missing(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def kernel(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"{_KERNELS}.{name} needs triton and a GPU")

        return kernel

    module.__getattr__ = missing  # type: ignore[method-assign]
    sys.modules[_KERNELS] = module


@contextlib.contextmanager
def _cpu_torchtitan(fsdp: str) -> Iterator[None]:
    """torchtitan on CPU, with fsdp_compose's names in its FSDP module if asked."""
    _placeholder_kernels()
    with contextlib.ExitStack() as stack:
        for name in _DEVICE_TYPE_MODULES:
            module = importlib.import_module(name)
            stack.enter_context(mock.patch.object(module, "device_type", "cpu"))
        # FlexAttention has no CPU backward: the registries get SDPA (causal), which
        # computes the same attention for one document per sequence.
        from torchtitan.models.common.attention import ScaledDotProductAttention

        for name, *_ in MODELS.values():
            module = importlib.import_module(name)
            sdpa = mock.patch.object(
                module, "get_attention_config", lambda backend: ScaledDotProductAttention.Config()
            )
            stack.enter_context(sdpa)
        if fsdp == "fsdp_compose":
            import fsdp_compose

            for name in _FSDP_CLIENT_MODULES:
                module = importlib.import_module(name)
                for attr in _SWAPPED:
                    replacement = getattr(fsdp_compose, attr)
                    stack.enter_context(mock.patch.object(module, attr, replacement))
        elif fsdp != "fsdp2":
            raise ValueError(f"fsdp must be 'fsdp2' or 'fsdp_compose', got {fsdp!r}")
        yield


def _build(model: str, spmd_backend: str, ep: int) -> tuple[Any, Any, Any]:
    """(model spec, parallelism config, parallel dims) for this job."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    registry, flavor, kwargs = MODELS[model]
    spec = importlib.import_module(registry).model_registry(flavor, **kwargs)
    parallelism = ParallelismConfig(
        spmd_backend=spmd_backend,
        data_parallel_shard_degree=dist.get_world_size(),
        expert_parallel_degree=ep,
    )
    parallel_dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    parallel_dims.build_mesh()
    dist_utils.set_spmd_backend(spmd_backend)
    _update_from_config(spec.model, parallelism)
    return spec, parallelism, parallel_dims


def _update_from_config(config: Any, parallelism: Any) -> None:
    """``config.update_from_config`` as a non-Trainer caller (it sets the modules'
    sharding configs). It imports ``torchtitan.trainer`` for an ``isinstance`` check
    only; where the Trainer's data stack (torchdata, tensorboard, ...) is missing, a
    placeholder module stands in for it during the call."""
    caller = types.SimpleNamespace(parallelism=parallelism)
    try:
        importlib.import_module("torchtitan.trainer")
    except ImportError:
        placeholder = types.ModuleType("torchtitan.trainer")
        placeholder.Trainer = type("Trainer", (), {"Config": type("Config", (), {})})  # type: ignore[attr-defined]
        with mock.patch.dict(sys.modules, {"torchtitan.trainer": placeholder}):
            config.update_from_config(config=caller)
        return
    config.update_from_config(config=caller)


def _annotate_inputs(backend: str, parallel_dims: Any, inputs: Any, labels: Any) -> Any:
    """What the Trainer's ``post_dataloading_process`` does to a batch per backend."""
    if backend == "full_dtensor":
        from torchtitan.distributed import full_dtensor

        inputs, labels, _ = full_dtensor.parallelize_inputs(parallel_dims, inputs, labels, {})
    elif backend == "spmd_types":
        from torchtitan.distributed.spmd_types import annotate_input_spmd_types

        inputs, labels, _ = annotate_input_spmd_types(parallel_dims, inputs, labels, {})
    return inputs, labels


def _global_loss(loss: torch.Tensor) -> float:
    """The sum over ranks of each rank's loss (a DTensor's is already global)."""
    from torch.distributed.tensor import DTensor

    if isinstance(loss, DTensor):
        return float(loss.full_tensor())
    loss = loss.clone()
    dist.all_reduce(loss)
    return float(loss)


def _units(model: torch.nn.Module) -> dict[str, int]:
    """How many modules torch's FSDP2 annotated and how many fsdp_compose did (whose
    modules pass ``isinstance`` checks for torch's ``FSDPModule`` too)."""
    from torch.distributed.fsdp import FSDPModule

    import fsdp_compose

    modules = list(model.modules())
    ours = sum(isinstance(m, fsdp_compose.FSDPModule) for m in modules)
    return {"fsdp2": sum(isinstance(m, FSDPModule) for m in modules) - ours, "fsdp_compose": ours}


def _load_full(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copies ``full`` (an unsharded state dict) into ``model``'s sharded parameters."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            value = full[name]
            if isinstance(tensor, DTensor):
                value = distribute_tensor(value, tensor.device_mesh, tensor.placements)
                tensor.to_local().copy_(value.to_local())
            else:
                tensor.copy_(value)


def train(
    fsdp: str,
    *,
    model: str = "llama3",
    spmd_backend: str = "partial_dtensor",
    ep: int = 1,
    steps: int = 10,
    batch: int = 2,
    seq_len: int = 64,
    symm_mem: bool = False,
) -> dict[str, Any]:
    """Trains ``model`` for ``steps`` steps on this rank (inside a gloo process group),
    with ``fsdp`` (``"fsdp2"`` or ``"fsdp_compose"``) under torchtitan's FSDP code.
    ``symm_mem`` turns on torchtitan's ``enable_fsdp_symm_mem`` (its config refuses it
    without CUDA, so it is set after the config's checks; FSDP2 needs CUDA for it).

    Returns how many modules each library annotated (``units``); the global loss per
    step (the sum over ranks of each rank's summed token losses over the global token
    count, as torchtitan logs it) and the gradient norm per step; the median step time
    (seconds, this rank, the first step left out); the process's peak resident set
    size (bytes, ``ru_maxrss``: meaningful for a process that ran nothing else) and its
    resident set size when the job started.
    """
    start_rss = _current_rss()
    with _cpu_torchtitan(fsdp):
        result = _train(model, spmd_backend, ep, steps, batch, seq_len, symm_mem)
    result["start_rss_bytes"] = start_rss
    return result


def _current_rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def _train(
    model_name: str,
    spmd_backend: str,
    ep: int,
    steps: int,
    batch: int,
    seq_len: int,
    symm_mem: bool,
) -> dict[str, Any]:
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed import utils as dist_utils

    spec, parallelism, parallel_dims = _build(model_name, spmd_backend, ep)
    parallelism.enable_fsdp_symm_mem = symm_mem
    torch.manual_seed(0)
    full_model = spec.model.build()
    with torch.no_grad():
        full_model.init_weights(buffer_device=None)
    full = {k: v.detach().clone() for k, v in full_model.state_dict().items()}
    del full_model
    with torch.device("meta"):
        model = spec.model.build()
    with tempfile.TemporaryDirectory() as dump_folder:
        model = spec.parallelize_fn(
            model,
            parallel_dims=parallel_dims,
            training=TrainingConfig(mixed_precision_param="float32"),
            parallelism=parallelism,
            compile_config=CompileConfig(enable=False),
            ac_config=None,
            dump_folder=dump_folder,
        )
    # torchtitan sets gradient_divide_factor=1.0, which FSDP2 reduces with
    # ReduceOp.PREMUL_SUM, which gloo lacks: sum, then divide by 1 (what
    # enable_fsdp_symm_mem asks for too).
    for module in model.modules():
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # buffers (RoPE caches)
    _load_full(model, full)
    model.train()
    loss_fn = CrossEntropyLoss.Config().build()
    optim = torch.optim.AdamW(model.parameters(), lr=8e-4, foreach=True)
    context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab = spec.model.vocab_size
    losses, norms, times = [], [], []
    for step in range(steps):
        start = time.perf_counter()
        generator = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=generator)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        global_tokens = torch.tensor(float(batch * seq_len * world))
        optim.zero_grad()
        inputs, labels = _annotate_inputs(spmd_backend, parallel_dims, inputs, labels)
        with context():
            pred = model(inputs)
            loss, _ = loss_fn(pred, labels, global_tokens)
            loss.backward()
        norm = dist_utils.clip_grad_norm_(
            list(model.parameters()), 1.0, foreach=True, ep_enabled=parallel_dims.ep_enabled
        )
        optim.step()
        times.append(time.perf_counter() - start)
        losses.append(_global_loss(loss.detach()))
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
    later = sorted(times[1:]) or times
    return {
        "units": _units(model),
        "losses": losses,
        "grad_norms": norms,
        "step_s": later[len(later) // 2],
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
