"""The one-GPU check (``benchmarks/gpu/check.sh``) in its CPU smoke mode.

A device is lent for minutes at a time, so the command must not fail there on a
typo, an import error or a missing file: this runs every section of it on the
CPU (gloo, tiny models) and checks that both summaries were written, with every
section present, passing, and marked as a smoke run.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The smoke run needs about 45 s of two idle cores; on a loaded, shared machine
# it has taken over two minutes.
SMOKE_TIMEOUT_S = 300
SECTIONS = ("tests", "parity", "stress", "features", "speed", "memory")


@pytest.mark.slow
def test_gpu_check_smoke_writes_every_section(tmp_path) -> None:
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH")) if p),
    }
    env.pop("OUT", None)
    start = time.monotonic()
    proc = subprocess.run(
        ["bash", os.path.join(_REPO, "benchmarks", "gpu", "check.sh"), str(out), "--smoke"],
        env=env,
        capture_output=True,
        text=True,
        timeout=SMOKE_TIMEOUT_S,
    )
    elapsed = time.monotonic() - start
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((out / "logs").glob("*.log"))
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{logs}"

    report = json.loads((out / "check.json").read_text())
    assert report["smoke"] is True
    assert list(report["sections"]) == list(SECTIONS)
    for name, section in report["sections"].items():
        assert section["status"] == "pass", (name, section)
        assert section["smoke"] is True, name
    # A smoke run's numbers come from the CPU: no target is judged.
    assert report["targets"] and all(t["met"] is None for t in report["targets"])
    assert len(report["sections"]["speed"]["traces"]) == 3
    assert report["sections"]["stress"]["identical_to_launch_blocking"] is True

    md = (out / "check.md").read_text()
    assert "Smoke run" in md
    for name in SECTIONS:
        assert f"| {name} | pass |" in md, name
    print(f"smoke run: {elapsed:.1f} s")
