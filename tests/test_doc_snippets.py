"""The code a reader copies from README.md and docs/*.md runs.

Opt-in convention: a fenced ``python`` block runs here only if the line right
before its opening fence is an HTML comment (invisible on GitHub) of the form::

    <!-- doctest: ranks=2 setup=gpt then=train -->

* ``name=NAME`` names a visible block (a setup the reader copies) and ``setup=@NAME``
  runs it before the block, as shown; ``setup=@a+@b+gpt`` chains visible blocks of the
  same file and hidden setups in order. A named block, or a chain with a visible one, runs as a
  script: its ``init_process_group`` is a no-op here.
* ``setup=a|b`` runs the block once with each setup; ``hf_llama`` and ``hf_gpt2``
  write a tiny randomly initialised Hugging Face model to ``pretrained_dir`` and
  define its ``config``.
* ``ranks``: the world size of the gloo job that runs the block on every rank
  (a :class:`dist_utils.DistPool`; default 2).
* ``setup``: the names the block uses without defining them (see ``_SETUPS``):
  ``gpt`` builds the tiny example GPT as ``model``; ``sharded`` also shards it
  bottom-up and creates ``optim``, and defines ``rank`` and ``train_step()``;
  ``script`` runs a whole torchrun script (its process-group setup is skipped).
* ``then``: a check that runs after the block in its namespace (see ``_THENS``):
  ``train`` runs one training step of ``model`` with ``optim`` and asserts
  every parameter is a sharded DTensor and the loss is finite.

Each block runs in a fresh namespace, in a temporary working directory shared
by the ranks (files it writes go there).

A ``python`` block that cannot run on its own (a GPU-only snippet, an excerpt of
a longer script) is marked as a fragment instead, naming the runnable file that
contains it::

    <!-- fragment: examples/pretrained_safetensors.py -->

Every ``python`` block in README.md and docs/*.md carries one of the two marks
(``test_every_python_block_is_run_or_points_to_a_runnable_file``).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from dist_utils import run_distributed

_ROOT = Path(__file__).resolve().parent.parent
_MARKED = re.compile(
    r"^<!-- doctest:(?P<opts>[^>]*)-->\n```python\n(?P<code>.*?)^```", re.MULTILINE | re.DOTALL
)

_PYTHON_BLOCK = re.compile(r"^(?P<before>.*)\n```python\n", re.MULTILINE)
_FRAGMENT = re.compile(r"^<!-- fragment: (?P<path>\S+) -->$")
_DOCS = [_ROOT / "README.md", *sorted((_ROOT / "docs").glob("*.md"))]

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
_HF = """
import os
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
import torch.distributed as dist
from transformers import AutoConfig
from train_hf import build_model
torch.manual_seed(0)
if dist.get_rank() == 0:  # a stand-in for a downloaded checkpoint directory
    build_model("{name}").save_pretrained("pretrained_dir")
dist.barrier()
config = AutoConfig.from_pretrained("pretrained_dir")
"""
_SETUPS["hf_llama"] = _HF.replace("{name}", "llama")
_SETUPS["hf_gpt2"] = _HF.replace("{name}", "gpt2")

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


def _snippets() -> list[tuple[str, dict[str, str], str, str]]:
    """(where, options, setup code, block code) of every block to run."""
    found = []
    for path in _DOCS:
        text = path.read_text()
        blocks = []
        named: dict[str, str] = {}
        for match in _MARKED.finditer(text):
            opts = dict(item.split("=", 1) for item in match["opts"].split())
            unknown = set(opts) - {"ranks", "setup", "then", "name"}
            assert not unknown, f"{path.name}: unknown doctest option(s) {unknown}"
            if "name" in opts:
                assert opts["name"] not in named, f"{path.name}: two blocks named {opts['name']}"
                named[opts["name"]] = match["code"]
            line = text.count("\n", 0, match.start()) + 2  # the opening fence
            blocks.append((line, opts, match["code"]))
        for line, opts, code in blocks:
            for setup in opts.get("setup", "none").split("|"):  # a|b: run once with each
                name = f"{path.name}:{line}" + (
                    f"[{setup}]" if "|" in opts.get("setup", "") else ""
                )
                parts = []
                for item in setup.split("+"):
                    if item.startswith("@"):
                        assert item[1:] in named, f"{name}: no block named {item[1:]}"
                        parts.append(named[item[1:]])
                    elif item != "script":
                        parts.append(_SETUPS[item])
                visible = setup == "script" or "@" in setup or "name" in opts
                found.append((name, {**opts, "script": str(visible)}, "".join(parts), code))
    return found


def _run_snippet(setup: str, code: str, then: str, workdir: str, script: bool = False) -> None:
    """``script``: the block is a whole torchrun script; its own
    ``init_process_group``/``destroy_process_group`` calls are no-ops here (the
    rank's process group is already up)."""
    import torch.distributed as dist

    if str(_ROOT) not in sys.path:  # the README's setup imports examples.gpt, as from a clone
        sys.path.append(str(_ROOT))
    previous = os.getcwd()
    saved = dist.init_process_group, dist.destroy_process_group
    if script:
        dist.init_process_group = dist.destroy_process_group = lambda *a, **k: None  # type: ignore[assignment]
    os.chdir(workdir)
    try:
        namespace: dict = {"__name__": "__doctest__"}
        exec(compile(setup, "<setup>", "exec"), namespace)  # noqa: S102 - running it is the test
        exec(compile(code, "<snippet>", "exec"), namespace)  # noqa: S102 - running it is the test
        exec(compile(then, "<then>", "exec"), namespace)  # noqa: S102 - running it is the test
    finally:
        os.chdir(previous)
        dist.init_process_group, dist.destroy_process_group = saved


_FOUND = _snippets()


def test_readme_first_snippet_is_run() -> None:
    """The README's first snippet (the one everyone copies) is among those run."""
    text = (_ROOT / "README.md").read_text()
    before_first = text[: text.index("```python\n")].rstrip("\n").splitlines()
    assert before_first[-1].startswith("<!-- doctest:"), before_first[-1]


def test_every_python_block_is_run_or_points_to_a_runnable_file() -> None:
    unmarked, missing = [], []
    for path in _DOCS:
        text = path.read_text()
        for match in _PYTHON_BLOCK.finditer(text):
            where = f"{path.name}:{text.count(chr(10), 0, match.start()) + 2}"
            before = match["before"]
            fragment = _FRAGMENT.match(before)
            if fragment:
                if not (_ROOT / fragment["path"]).is_file():
                    missing.append(f"{where} -> {fragment['path']}")
            elif not before.startswith("<!-- doctest:"):
                unmarked.append(where)
    assert not unmarked, f"python blocks neither run nor marked as fragments: {unmarked}"
    assert not missing, f"fragments pointing to files that do not exist: {missing}"


@pytest.mark.parametrize(
    "where,opts,setup,code", _FOUND, ids=[w for w, _, _, _ in _FOUND]
)
def test_doc_snippet_runs(
    where: str, opts: dict[str, str], setup: str, code: str, tmp_path: Path
) -> None:
    script = opts["script"] == "True"
    then = _THENS[opts.get("then", "none")]
    ranks = int(opts.get("ranks", "2"))
    run_distributed(_run_snippet, ranks, setup, code, then, str(tmp_path), script)
