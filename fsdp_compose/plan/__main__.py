"""``python -m fsdp_compose.plan``: per-rank memory, communication and a plan, before launch.

    python -m fsdp_compose.plan CONFIG --world-size N --batch B --seq S [--budget 80GiB] [--json]

CONFIG is a Hugging Face ``config.json`` (or a folder holding one), or a Python
factory ``package.module:function`` returning an ``nn.Module``. The model is
built on the meta device: no weights are materialized and no ranks launched.

Runs longer than a few seconds report their progress on stderr.

Exit status: 0 when the plan fits (or no --budget was given), 1 when nothing
fits the budget, 2 for bad input (options, config, factory).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import sys
import time
from typing import Any, TextIO

import torch
from torch import nn

from .._runtime import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._cost import CostModel
from ._estimate import OPTIMIZERS, MemoryEstimate, _check_mesh, estimate
from ._planner import plan_to_budget
from ._policy import resolve_plan
from ._profile import profile_model
from ._result import PlanResult
from ._units import budget_text, format_bytes, format_count, parse_bytes

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


class UsageError(Exception):
    """Bad command-line input: printed without a traceback."""


def load_model(config: str, dtype: torch.dtype) -> nn.Module:
    """Builds the model CONFIG names on the meta device."""
    if ":" in config and not os.path.exists(config):
        module_name, _, attr = config.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise UsageError(f"cannot import the factory {config!r}: {exc}") from None
        try:
            with torch.device("meta"):
                model = factory()
        except Exception as exc:
            raise UsageError(f"the factory {config} raised {type(exc).__name__}: {exc}") from None
        if not isinstance(model, nn.Module):
            raise UsageError(f"{config} returned {type(model).__name__}, not an nn.Module")
        return model.to(dtype) if dtype != torch.float32 else model
    path = os.path.join(config, "config.json") if os.path.isdir(config) else config
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path} is not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise UsageError(
            f'{path} is not a model config: no "model_type" key (expected a Hugging Face config.json, '
            "or a factory written module:function)"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise UsageError(
            "reading a config.json needs transformers (pip install transformers)"
        ) from None
    try:
        cfg = AutoConfig.for_model(**data)
    except Exception as exc:
        raise UsageError(f"{path}: transformers cannot read this config: {exc}") from None
    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        except ValueError as exc:
            raise UsageError(
                f"{path}: no causal-LM class for model_type {data['model_type']!r}: {exc}"
            ) from None
        except Exception as exc:  # a value the model's constructor cannot use
            raise UsageError(
                f"{path}: cannot build the model from this config "
                f"({type(exc).__name__}: {exc}); check its values"
            ) from None


def _reshard(text: str) -> bool | int:
    low = text.lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected true, false or an int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"an int reshard_after_forward must be >= 1, got {value}")
    return value


def _mesh(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(x) for x in text.replace("x", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected SHARD or REPLICATE,SHARD, got {text!r}"
        ) from None
    if not 1 <= len(dims) <= 2 or min(dims) < 1:
        raise argparse.ArgumentTypeError(
            f"expected SHARD or REPLICATE,SHARD of positive ints, got {text!r}"
        )
    return dims


_SIZE_UNITS = "B, KiB, MiB, GiB, TiB (binary) or KB, MB, GB, TB (decimal)"


def _size(text: str) -> str:
    """A size with a unit: a bare number is refused (``80`` is more likely 80 GiB
    than 80 bytes)."""
    stripped = text.strip()
    if stripped and not stripped[-1].isalpha():
        raise argparse.ArgumentTypeError(
            f"{text!r} has no unit; write e.g. 80GiB or 80GB (units: {_SIZE_UNITS})"
        )
    try:
        parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (units: {_SIZE_UNITS})") from None
    return text


def _rate(text: str) -> float:
    try:
        return float(parse_bytes(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive rate such as 400e12 or 25G, got {text!r}"
        ) from None


_EPILOG = (
    "Sizes: GiB/MiB/KiB are binary (2**30 ...), GB/MB/KB decimal (10**9 ...); the budget is "
    "printed in both. Exit status: 0 the plan fits (or no --budget), 1 nothing fits the "
    "budget, 2 bad input."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fsdp_compose.plan",
        description="Per-rank memory and communication of an fsdp_compose training step, "
        "and a plan that fits a budget, without launching ranks.",
        epilog=_EPILOG,
    )
    p.add_argument("config", help="a Hugging Face config.json (or its folder), or module:function")
    p.add_argument("--world-size", type=int, required=True, help="number of ranks")
    p.add_argument("--mesh-shape", type=_mesh, default=None, help="SHARD or REPLICATE,SHARD (HSDP)")
    p.add_argument("--batch", type=int, required=True, help="micro-batch per rank (sequences)")
    p.add_argument("--seq", type=int, required=True, help="sequence length (tokens)")
    p.add_argument(
        "--budget", type=_size, help="memory per rank, e.g. 80GiB or 80GB: plan to fit it"
    )
    p.add_argument(
        "--dtype", choices=sorted(_DTYPES), default="fp32", help="parameter (master) dtype"
    )
    p.add_argument(
        "--param-dtype", choices=sorted(_DTYPES), default=None, help="mixed-precision compute dtype"
    )
    p.add_argument(
        "--reduce-dtype", choices=sorted(_DTYPES), default=None, help="gradient reduction dtype"
    )
    p.add_argument(
        "--offload", action="store_true", help="CPUOffloadPolicy (shards, grads, optimizer on host)"
    )
    p.add_argument(
        "--offload-by-budget",
        action="store_true",
        help="with --budget: the planner may offload the units that free the most device "
        "memory per byte copied (per-unit CPUOffloadPolicy) when a plan does not fit",
    )
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    p.add_argument(
        "--reshard", type=_reshard, default=None, help="reshard_after_forward of non-root units"
    )
    p.add_argument("--prefetch", type=int, default=None, help="prefetch depth (default 1)")
    p.add_argument(
        "--checkpointing", action="store_true", help="activation checkpointing of every unit"
    )
    p.add_argument(
        "--no-checkpointing-in-plan", action="store_true", help="the planner may not use it"
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where training runs")
    p.add_argument(
        "--set-to-none",
        action="store_true",
        help="with --device cpu: the loop calls zero_grad(set_to_none=True) (torch's default) "
        "rather than keeping the gradients between steps",
    )
    p.add_argument(
        "--headroom",
        type=float,
        default=None,
        help="the fraction of --budget the plan leaves free for what the estimate does not "
        "model (default with --device cpu, where glibc's heap grows over the first steps: "
        "0.13, or 0.18 for a plan that checkpoints; else 0)",
    )
    p.add_argument(
        "--policy",
        default=None,
        help="module class names (comma separated) or a parameter count (default: _no_split_modules)",
    )
    p.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        metavar="M",
        help="micro-batches per optimizer step: with --budget, each unit's gradient "
        "accumulation (unsharded or sharded) is chosen and both costs printed (default 1)",
    )
    _add_cost_model_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _add_cost_model_arguments(p: argparse.ArgumentParser) -> None:
    """The planner's cost-model rates (compute, network, host copies, host step)."""
    p.add_argument(
        "--flop-rate",
        type=_rate,
        default=None,
        help="FLOP/s per rank (planner; default per --device)",
    )
    p.add_argument(
        "--bandwidth",
        type=_rate,
        default=None,
        help="bytes/s per rank (planner; default per --device)",
    )
    p.add_argument(
        "--host-budget",
        type=_size,
        default=None,
        help="host memory per rank the offloaded state may take, e.g. 128GiB (with --offload)",
    )
    p.add_argument(
        "--host-bandwidth",
        type=_rate,
        default=None,
        help="bytes/s of host-device copies per rank, each way (planner, with --offload; "
        "default 25e9)",
    )
    p.add_argument(
        "--host-optimizer-rate",
        type=_rate,
        default=None,
        help="bytes/s of offloaded state the host optimizer step goes through per rank "
        "(planner, with --offload; default 10e9)",
    )
    p.add_argument(
        "--overlap",
        type=float,
        default=None,
        help="fraction of communication time that can pass during compute, 0-1 (planner; "
        "1: a GPU's own engine, near 0: gloo on a CPU the ranks already fill)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # bad combinations, reported by the library in words
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _cost_model(args: argparse.Namespace) -> CostModel:
    """The device's defaults, with the rates given on the command line replacing them."""
    default = CostModel.for_device(args.device)
    given = {
        k: v
        for k, v in (
            ("flop_rate", args.flop_rate),
            ("bandwidth", args.bandwidth),
            ("overlap", args.overlap),
            ("host_bandwidth", args.host_bandwidth),
            ("host_optimizer_rate", args.host_optimizer_rate),
        )
        if v is not None
    }
    if not given:
        return default
    flags = ", ".join("--" + k.replace("_", "-") for k in given)
    rest = f"; the rest {default.source}" if len(given) < 5 else ""
    return dataclasses.replace(default, **given, source=f"given: {flags}{rest}")


def _policy(text: str | None) -> Any:
    if text is None:
        return None
    return int(text) if text.isdigit() else [s.strip() for s in text.split(",") if s.strip()]


class _Progress:
    """Progress lines on stderr, once a run has taken more than ``after`` seconds
    (short runs print nothing), at most one every ``every`` seconds."""

    def __init__(self, after: float = 2.0, every: float = 2.0, stream: TextIO | None = None):
        self.start = time.monotonic()
        self.after, self.every, self.stream = after, every, stream
        self.last = -math.inf

    def stage(self, text: str) -> None:
        self._say(text, force=True)

    def __call__(self, done: int, total: int) -> None:
        self._say(f"{done}/{total} candidates evaluated", force=done == total)

    def _say(self, text: str, force: bool) -> None:
        now = time.monotonic()
        if now - self.start < self.after or (not force and now - self.last < self.every):
            return
        self.last = now
        stream = self.stream or sys.stderr  # looked up late: tests capture sys.stderr
        print(f"plan: {text} ({now - self.start:.0f} s)", file=stream, flush=True)


def _run(args: argparse.Namespace) -> int:
    for name in ("world_size", "batch", "seq", "grad_accum"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive int")
    if args.host_budget is not None and (
        args.budget is None or not (args.offload or args.offload_by_budget)
    ):
        raise UsageError(
            "--host-budget bounds the offloaded state: give it with --offload (or "
            "--offload-by-budget) and --budget"
        )
    if args.grad_accum > 1 and args.budget is None:
        raise UsageError(
            "--grad-accum chooses each unit's accumulation mode: give it with --budget"
        )
    if args.offload_by_budget and (args.budget is None or args.offload or args.device != "cuda"):
        raise UsageError(
            "--offload-by-budget chooses units to offload to fit --budget on a GPU: give it "
            "with --budget, without --offload (which offloads every unit) and --device cuda"
        )
    _check_mesh(args.world_size, args.mesh_shape)  # before the (slow) model build
    progress = _Progress()
    model = load_model(args.config, _DTYPES[args.dtype])
    progress.stage("model built on the meta device")
    est, result = _predict(args, model, progress)
    params = sum(p.numel() for p in model.parameters())
    budget = None if args.budget is None else budget_text(args.budget)
    if args.json:
        out = est.to_dict()
        out.pop("units")
        out["model"] = {"config": args.config, "class": type(model).__name__, "parameters": params}
        if result is not None:
            plan = {"budget": budget, **result.to_dict()}
            plan["estimate"].pop("units")
            out["plan"] = plan
        print(json.dumps(out))
        return 0 if result is None or result.fits else 1
    print(
        f"{type(model).__name__}: {format_count(params)} parameters ({args.dtype}), "
        f"W={args.world_size}, micro-batch {args.batch} x {args.seq} tokens per rank"
    )
    print(est.table())
    if result is not None:
        print()
        host = (
            ""
            if args.host_budget is None
            else f" ({format_bytes(parse_bytes(args.host_budget))} of host memory)"
        )
        print(f"plan for a budget of {budget} per rank{host}:")
        print(result.table())
    return 0 if result is None or result.fits else 1


def _predict(
    args: argparse.Namespace, model: nn.Module, progress: _Progress
) -> tuple[MemoryEstimate, PlanResult | None]:
    """The estimate of the plan the options describe, and the plan for --budget
    (one profile of the model serves both)."""
    mp = MixedPrecisionPolicy(
        param_dtype=_DTYPES[args.param_dtype] if args.param_dtype else None,
        reduce_dtype=_DTYPES[args.reduce_dtype] if args.reduce_dtype else None,
    )
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=False) if args.offload else OffloadPolicy()
    policy = _policy(args.policy)
    leaves = [m for u in resolve_plan(model, policy).units[:-1] for m in u.modules]
    profile = profile_model(
        model, leaves, batch=args.batch, seq=args.seq, compute_dtype=mp.param_dtype
    )
    progress.stage("model profiled")
    common: dict[str, Any] = {
        "batch": args.batch,
        "seq": args.seq,
        "world_size": args.world_size,
        "mesh_shape": args.mesh_shape,
        "policy": policy,
        "mp_policy": mp,
        "offload_policy": offload,
        "optimizer": args.optimizer,
        "device": args.device,
        "set_to_none": args.set_to_none,
        "profile": profile,
    }
    est = estimate(
        model,
        reshard_after_forward=args.reshard,
        prefetch_depth=args.prefetch,
        activation_checkpointing=True if args.checkpointing else None,
        **common,
    )
    if args.budget is None:
        return est, None
    result = plan_to_budget(
        model,
        args.budget,
        activation_checkpointing=not args.no_checkpointing_in_plan,
        cost=_cost_model(args),
        headroom=args.headroom,
        host_budget=args.host_budget,
        offload_by_budget=args.offload_by_budget,
        grad_accum=args.grad_accum,
        progress=progress,
        **common,
    )
    return est, result


if __name__ == "__main__":
    sys.exit(main())
