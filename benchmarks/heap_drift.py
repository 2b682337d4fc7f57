"""The resident peak over consecutive steps in one process, with and without fsdp_compose.

    python benchmarks/heap_drift.py fsdp|plain gpt|llama no|ac

One rank (W=1, gloo), the estimator benchmark's model at its "bench" scale, AdamW,
one warm-up step, then 8 steps; prints ``VmHWM - RSS at reset`` (MiB) after each.
``plain`` is the same model without fsdp_compose (torch only), to tell growth that
glibc's heap shows in any torch process from growth of fsdp_compose's own.
"""

import os
import sys
import tempfile

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.join(_here, "..", "examples"), os.path.join(_here, "..")]
import estimator_accuracy as ea
import measure
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

torch.set_num_threads(1)
variant, model_name, ckpt = sys.argv[1], sys.argv[2], sys.argv[3] == "ac"
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
torch.manual_seed(0)
if variant == "fsdp":
    from fsdp_compose import auto_wrap

    model = ea.build_meta(model_name, "bench")
    auto_wrap(
        model, ea._policy(model), mesh=init_device_mesh("cpu", (1,)), activation_checkpointing=ckpt
    )
else:
    with torch.device("meta"):
        model = ea.build_meta(model_name, "bench")
ea.materialize(model)
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
step = ea.training_step(model, optim, ea.Case(model_name, 1), seed=0)
step()
r0 = measure.reset_peak_rss()
vals = []
for _ in range(8):
    step()
    vals.append((measure.peak_rss_bytes() - r0) / 2**20)
print(variant, model_name, "ac" if ckpt else "", " ".join(f"{v:.1f}" for v in vals), flush=True)
os._exit(0)
