"""GPU benchmark: a ~1B-parameter Llama-style decoder in bf16 on one GPU (NCCL, W=1).

    python benchmarks/gpu_llama.py                    # all three, one fresh process each
    python benchmarks/gpu_llama.py --impl fsdp_compose --steps 20

Compares ``fsdp_compose.fully_shard``, torch FSDP2 and the unwrapped model at
world size 1: with one rank nothing is communicated, so the difference is what
each FSDP costs around the same compute (hooks, copies, stream synchronization).
Each implementation gets the same model (same seed), data, optimizer and steps;
FSDP is applied per transformer block, then to the root.

Reports per implementation: median step time over the timed steps (after
``torch.cuda.synchronize()``), tokens/s, MFU and peak allocated GPU memory.

    MFU = tokens/s * FLOPs per token / peak bf16 FLOP/s of the device
    FLOPs per token = 6 * N_matmul + 12 * n_layers * dim * seq_len

(N_matmul: parameters of every matrix multiply, including the output head and
excluding the embedding lookup; the second term is attention's QK^T and AV,
forward + backward, counted without the causal-mask saving, as PaLM does.)

Dtypes: by default the parameters *are* bf16 (``--dtype bf16``), so all three run
exactly the same math; ``--dtype mixed`` keeps fp32 parameters and computes in bf16
(FSDP: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; unwrapped:
``torch.autocast``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

IMPLS = ("unwrapped", "fsdp2", "fsdp_compose")

# Dense bf16 tensor-core peak (no sparsity), FLOP/s; --peak-tflops overrides.
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    dim: int = 2048
    n_layers: int = 18
    n_heads: int = 16
    ffn_dim: int = 5632
    seq_len: int = 2048
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return norm.type_as(x) * self.weight


def rope_tables(cfg: LlamaConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim = cfg.dim // cfg.n_heads
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(cfg.seq_len, device=device).float(), inv)
    return angles.cos(), angles.sin()  # (T, head_dim / 2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, D); rotate pairs (even, odd) by the position's angle.
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in self.wqkv(x).split(C, -1))
        q, k = apply_rope(q, cos[:T], sin[:T]), apply_rope(k, cos[:T], sin[:T])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)  # gate and up, fused
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.dim), Attention(cfg)
        self.ffn_norm, self.ffn = RMSNorm(cfg.dim), FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg, self.tok_emb.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        return self.output(self.norm(x))


def flops_per_token(model: Llama) -> float:
    cfg = model.cfg
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "tok_emb" not in n)
    return 6 * matmul + 12 * cfg.n_layers * cfg.dim * cfg.seq_len


def peak_flops(override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def build_model(cfg: LlamaConfig, param_dtype: torch.dtype, device: torch.device | str) -> Llama:
    """The model with its parameters created in ``param_dtype`` on ``device`` (the
    RoPE tables stay fp32: they are built with an explicit ``.float()``)."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(param_dtype)
    try:
        with torch.device(device):
            return Llama(cfg)
    finally:
        torch.set_default_dtype(default_dtype)


def trace_one_step(step: Any, sync: Any, path: str, cpu_only: bool) -> None:
    """Records one more step with ``torch.profiler`` into a Chrome trace at ``path``
    (after the timed steps, so that profiling costs none of them)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([] if cpu_only else [ProfilerActivity.CUDA])
    with profile(activities=activities) as prof:
        step()
        sync()
    prof.export_chrome_trace(path)


# ---------------------------------------------------------------------------
# one implementation, in this process
# ---------------------------------------------------------------------------


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    smoke = args.smoke  # CPU + gloo, tiny model: checks the script without a GPU
    dist.init_process_group("gloo" if smoke else "nccl", rank=0, world_size=1)
    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    sync = (lambda: None) if smoke else torch.cuda.synchronize
    if not smoke:
        torch.cuda.set_device(device)
    cfg = LlamaConfig(vocab_size=args.vocab, n_layers=args.layers, dim=args.dim,
                      n_heads=args.heads, ffn_dim=args.ffn_dim, seq_len=args.seq_len)
    torch.manual_seed(0)
    model = build_model(cfg, torch.bfloat16 if args.dtype == "bf16" else torch.float32, device)
    n_params = sum(p.numel() for p in model.parameters())
    fpt = flops_per_token(model)

    autocast = args.dtype == "mixed" and args.impl == "unwrapped"
    if args.impl != "unwrapped":
        if args.impl == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        else:
            from fsdp_compose import MixedPrecisionPolicy, fully_shard
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if args.dtype == "mixed" else MixedPrecisionPolicy())
        mesh = init_device_mesh(device.type, (1,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)

    gen = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), device=device, generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step() -> float:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        return loss.detach()

    losses, times = [], []
    if not smoke:
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup + args.steps):
        sync()
        start = time.perf_counter()
        losses.append(step())
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    peak_allocated = 0.0 if smoke else torch.cuda.max_memory_allocated() / 2**30
    if args.trace:
        trace_one_step(step, sync, os.path.join(args.trace, f"trace_{args.impl}.json.gz"), smoke)
    dist.destroy_process_group()

    step_s = statistics.median(times)
    tokens_per_s = args.batch * cfg.seq_len / step_s
    peak = None if smoke else peak_flops(args.peak_tflops)
    return {
        "impl": args.impl,
        "device": "cpu (smoke test)" if smoke else torch.cuda.get_device_name(),
        "config": asdict(cfg),
        "batch": args.batch,
        "dtype": args.dtype,
        "params": n_params,
        "step_time_s": step_s,
        "step_times_s": times,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * fpt / peak if peak else None,
        "peak_allocated_gib": peak_allocated,
        "losses": [float(v) for v in losses],
    }


# ---------------------------------------------------------------------------
# driver: one fresh process per implementation
# ---------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=IMPLS, help="run only this one, in this process")
    p.add_argument("--dtype", choices=["bf16", "mixed"], default="bf16")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn-dim", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--peak-tflops", type=float, default=None, help="device bf16 peak, TFLOP/s")
    p.add_argument("--json", default=None, help="write the result(s) here")
    p.add_argument("--trace", default=None,
                   help="folder: a torch.profiler trace of one step per implementation (trace_<impl>.json.gz)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU/gloo with a tiny model: checks the script where there is no GPU")
    args = p.parse_args()
    if args.smoke:
        args.layers, args.dim, args.heads, args.ffn_dim, args.vocab = 2, 64, 4, 128, 256
        args.seq_len, args.batch, args.warmup, args.steps = 32, 2, 1, 2
    return args


def _run_forked(args: argparse.Namespace, impl: str) -> dict[str, Any]:
    """``run_one`` for ``impl`` in a forked child: each implementation gets a fresh
    process (its own process group, allocator and compile caches) without starting
    another interpreter; the parent has only imported torch, and touched no device."""
    out = f"/tmp/gpu_llama_{impl}_{os.getpid()}.json"
    pid = os.fork()
    if pid == 0:  # the child: run, write the result, leave without the parent's cleanup
        code = 1
        try:
            result = run_one(argparse.Namespace(**{**vars(args), "impl": impl}))
            with open(out, "w") as f:
                json.dump(result, f)
            code = 0
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"gpu_llama.py: the {impl} run failed (exit status {status})")
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return result


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available() and not args.smoke:
        raise SystemExit("gpu_llama.py needs a CUDA device (or --smoke; see BENCHMARKS.md)")
    if args.impl:
        result = run_one(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f)
        print(json.dumps({k: v for k, v in result.items() if k not in ("step_times_s", "losses")}))
        return
    results = []
    for impl in IMPLS:
        results.append(_run_forked(args, impl))
    base = results[0]["step_time_s"]
    print(f"\n{results[0]['device']}, {results[0]['params'] / 1e9:.2f}B params, {args.dtype}, "
          f"batch {args.batch} x {args.seq_len} tokens, median of {args.steps} steps")
    print("| impl | step time (s) | vs unwrapped | tokens/s | MFU | peak allocated (GiB) | final loss |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "—"
        print(f"| {r['impl']} | {r['step_time_s']:.4f} | {r['step_time_s'] / base:.3f} | "
              f"{r['tokens_per_s']:,.0f} | {mfu} | {r['peak_allocated_gib']:.1f} | {r['losses'][-1]:.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
