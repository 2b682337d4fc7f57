"""The examples, importable from the repository root: ``from examples.gpt import GPT``.

Each script imports its siblings by their bare names (``from gpt import GPT``), as
it does when run as ``python examples/<script>.py`` (which puts this folder on
``sys.path``); imported as a package, this folder goes on ``sys.path`` too, last,
so those imports resolve the same way.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.append(_HERE)
