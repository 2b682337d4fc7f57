"""The code a reader copies from README.md and docs/*.md runs.

Opt-in convention: a fenced ``python`` block runs here only if the line right
before its opening fence is an HTML comment (invisible on GitHub) of the form::

    <!-- doctest: ranks=2 setup=gpt then=train -->

* ``ranks``: the world size of the gloo job that runs the block on every rank
  (a :class:`dist_utils.DistPool`; default 2).
* ``setup``: the names the block uses without defining them (see ``_SETUPS``):
  ``gpt`` builds the tiny example GPT as ``model``; ``sharded`` also shards it
  bottom-up and creates ``optim``, and defines ``rank`` and ``train_step()``.
* ``then``: a check that runs after the block in its namespace (see ``_THENS``):
  ``train`` runs one training step of ``model`` with ``optim`` and asserts
  every parameter is a sharded DTensor and the loss is finite.

Each block runs in a fresh namespace, in a temporary working directory shared
by the ranks (files it writes go there). Blocks without the comment (shell
commands, GPU-only snippets, fragments) are not run, so adding a section with
its own snippets never breaks this test; mark a block once it is runnable.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from dist_utils import run_distributed

_ROOT = Path(__file__).resolve().parent.parent
_MARKED = re.compile(
    r"^<!-- doctest:(?P<opts>[^>]*)-->\n```python\n(?P<code>.*?)^```", re.MULTILINE | re.DOTALL
)

_SETUPS = {
    "none": "",
    "gpt": """
import torch
from gpt import GPT, GPTConfig, loss_fn, make_batch
torch.manual_seed(0)
cfg = GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=32)
model = GPT(cfg)
""",
}
_SETUPS["sharded"] = (
    _SETUPS["gpt"]
    + """
import torch.distributed as dist
from fsdp_compose import fully_shard
for block in model.blocks:
    fully_shard(block)
fully_shard(model)
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
rank = dist.get_rank()

def train_step():
    x, y = make_batch(cfg, 2, 0)
    loss_fn(model(x), y).backward()
    optim.step()
    optim.zero_grad()

train_step()
"""
)
_THENS = {
    "none": "",
    "train": """
from torch.distributed.tensor import DTensor
x, y = make_batch(cfg, 2, 0)
loss = loss_fn(model(x), y)
loss.backward()
optim.step()
optim.zero_grad()
assert all(isinstance(p, DTensor) for p in model.parameters()), "a parameter is not sharded"
assert bool(torch.isfinite(loss)), loss
""",
}


def _snippets() -> list[tuple[str, dict[str, str], str]]:
    found = []
    for path in [_ROOT / "README.md", *sorted((_ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for match in _MARKED.finditer(text):
            opts = dict(item.split("=", 1) for item in match["opts"].split())
            unknown = set(opts) - {"ranks", "setup", "then"}
            assert not unknown, f"{path.name}: unknown doctest option(s) {unknown}"
            line = text.count("\n", 0, match.start()) + 2  # the opening fence
            found.append((f"{path.name}:{line}", opts, match["code"]))
    return found


def _run_snippet(setup: str, code: str, then: str, workdir: str) -> None:
    previous = os.getcwd()
    os.chdir(workdir)
    try:
        namespace: dict = {"__name__": "__doctest__"}
        exec(compile(setup, "<setup>", "exec"), namespace)  # noqa: S102 - running it is the test
        exec(compile(code, "<snippet>", "exec"), namespace)  # noqa: S102 - running it is the test
        exec(compile(then, "<then>", "exec"), namespace)  # noqa: S102 - running it is the test
    finally:
        os.chdir(previous)


_FOUND = _snippets()


def test_readme_first_snippet_is_run() -> None:
    """The README's first snippet (the one everyone copies) is among those run."""
    text = (_ROOT / "README.md").read_text()
    before_first = text[: text.index("```python\n")].rstrip("\n").splitlines()
    assert before_first[-1].startswith("<!-- doctest:"), before_first[-1]


@pytest.mark.parametrize("where,opts,code", _FOUND, ids=[w for w, _, _ in _FOUND])
def test_doc_snippet_runs(where: str, opts: dict[str, str], code: str, tmp_path: Path) -> None:
    setup, then = _SETUPS[opts.get("setup", "none")], _THENS[opts.get("then", "none")]
    run_distributed(_run_snippet, int(opts.get("ranks", "2")), setup, code, then, str(tmp_path))
