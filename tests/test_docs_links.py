"""Links between the project's Markdown files resolve: every relative link names a
file that exists and, with ``#anchor``, a heading of that file (GitHub's anchors).
Also: skipped tests' reasons name the command that enables them."""

from __future__ import annotations

import re
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
_FILES = [*sorted(_ROOT.glob("*.md")), *sorted((_ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_relative_links_resolve() -> None:
    broken = []
    for path in _FILES:
        text = _FENCE.sub("", path.read_text())
        for match in _LINK.finditer(text):
            target = match["target"]
            if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            where = f"{path.relative_to(_ROOT)} -> {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where} (no such heading)")
    assert not broken, broken


def test_skip_reasons_name_what_enables_them() -> None:
    from skip_hints import hint

    assert '.[ft]"' in hint("could not import 'torchft': No module named 'torchft'")
    assert '.[torchao]"' in hint("No module named 'torchao'")
    assert "CUDA" in hint("needs a CUDA device")
    assert hint("something else") == "something else"
