"""Importing fsdp_compose costs no more of torch than importing FSDP2 does."""

from __future__ import annotations

import os
import subprocess
import sys

_HEAVY = ("torch._dynamo", "torch._inductor", "torch.distributed.pipelining")

_PROBE = """
import sys
import {module}
print(sorted(m for m in {heavy} if m in sys.modules))
"""


def _heavy_modules_after(module: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_COMPOSE_")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    result = subprocess.run(
        [sys.executable, "-c", _PROBE.format(module=module, heavy=_HEAVY)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.splitlines()[-1]


def test_import_loads_no_more_than_fsdp2() -> None:
    # torch.compile's stack (torch._dynamo and what it pulls in) loads on first use,
    # as with FSDP2: the hooks defer it until they first run.
    fsdp2 = _heavy_modules_after("torch.distributed.fsdp")
    ours = _heavy_modules_after("fsdp_compose")
    assert ours == fsdp2, f"import fsdp_compose loads {ours}, import torch.distributed.fsdp {fsdp2}"


def test_lazy_public_names_still_resolve() -> None:
    import fsdp_compose

    assert fsdp_compose.PipelineStage.__name__ == "PipelineStage"
