"""The README's and docs/'s Python examples do not rot: each block compiles, and every
``fastdist.*`` name it uses exists (a renamed function or a moved module fails here). They are not
run: most need a job of several processes; the jobs they describe are run by the tests each page
names (tests/test_frameworks.py, tests/test_replace.py, ...)."""

from __future__ import annotations

import importlib
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^[ \t]*```python\n(.*?)^[ \t]*```", re.DOTALL | re.MULTILINE)
_NAME = re.compile(r"\bfastdist(?:\.[A-Za-z_]\w*)+")


def _blocks() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        for i, m in enumerate(_BLOCK.finditer(page.read_text())):
            out.append((f"{page.relative_to(ROOT)}#{i + 1}", textwrap.dedent(m.group(1))))
    return out


def _resolve(name: str) -> None:
    parts = name.split(".")
    obj = importlib.import_module("fastdist")
    for k, part in enumerate(parts[1:], 2):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            obj = importlib.import_module(".".join(parts[:k]))  # a submodule (ImportError if none)


@pytest.mark.timeout(60)
def test_every_python_example_in_the_docs_compiles_and_names_what_exists() -> None:
    blocks = _blocks()
    assert len(blocks) >= 20, [where for where, _ in blocks]  # the pattern still finds them
    missing = []
    for where, src in blocks:
        compile(src, where, "exec")  # SyntaxError names the page and the block
        for name in sorted(set(_NAME.findall(src))):
            try:
                _resolve(name)
            except ImportError:
                missing.append(f"{where}: {name}")
    assert not missing, missing
