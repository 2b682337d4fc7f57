"""Test configuration: make ``examples/`` (the GPT model) and this folder importable,
also inside spawned rank processes (they inherit ``sys.path``)."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
for path in (_HERE, os.path.join(os.path.dirname(_HERE), "examples")):
    if path not in sys.path:
        sys.path.insert(0, path)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# skipped tests name what enables them (the install command) in pytest's summary
pytest_plugins = ["skip_hints"]
