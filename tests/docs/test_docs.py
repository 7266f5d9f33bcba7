"""The README's and docs/'s Python examples do not rot: each block compiles, and every
``fastdist.*`` name it uses exists (a renamed function or a moved module fails here). The README's
first example, the bounded barrier, runs as written on two processes; the others are not run as
they are: most are parts of a job of several processes, and the jobs they describe are run by the
tests each page names (tests/frameworks/test_frameworks.py, tests/recovery/test_replace.py, ...)."""

from __future__ import annotations

import importlib
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


@pytest.mark.timeout(90)
def test_the_readmes_first_example_runs_as_it_is_on_two_ranks() -> None:
    """The README's bounded barrier, the block as written (env:// as torchrun sets it), on two
    real processes: it returns on both."""
    import os
    import subprocess
    import sys

    from mp import free_port, kill_sessions

    readme = [src for where, src in _blocks() if where.startswith("README.md")]
    block = next(src for src in readme if "fastdist.barrier(timeout=10)" in src)
    port = str(free_port())
    procs = []
    try:
        for rank in range(2):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
            code = block + "\nprint('returned', fastdist.get_rank(), flush=True)\n"
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", code],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        outs = [p.communicate(timeout=60)[0].decode(errors="replace") for p in procs]
    finally:
        kill_sessions(procs)
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"returned {rank}" in out, out
