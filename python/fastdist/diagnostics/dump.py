"""Fault dumps and the merged view: ``FASTDIST_DUMP_DIR`` and ``python -m fastdist report DIR``.

With ``FASTDIST_DUMP_DIR`` set, each rank writes one JSON file there when an op on one of its
groups times out or is ended by a peer's fault: the group, the error, the group's op history
(:func:`fastdist.history`), where this rank's threads were, and the stacks the report gathered
from the others. ``python -m fastdist report DIR`` reads every rank's file and prints, per group
and generation, each rank's last ops and stack, and the first op where the ranks diverged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..groups import registry
from . import stacks

_LAST_OPS = 5


def write(st: Any, pg: Any, err: BaseException) -> str | None:
    """Writes this rank's dump for a fault on ``pg`` if ``FASTDIST_DUMP_DIR`` is set; returns the
    path (None when not set or the write failed: a dump must never turn into another error)."""
    root = os.environ.get("FASTDIST_DUMP_DIR")
    if not root:
        return None
    try:
        threads = {
            str(t.ident): {"name": t.name, "stack": stacks.stack_of(t.ident or 0)}
            for t in threading.enumerate()
        }
        record = {
            "rank": st.my_global_rank,
            "world_size": st.size,
            "group": st.name,
            "generation": st.generation,
            "time": time.time(),
            "pid": os.getpid(),
            "error": str(err),
            "missing_ranks": getattr(err, "missing_ranks", None),
            "stacks": {str(k): v for k, v in (getattr(err, "stacks", None) or {}).items()},
            "history": registry.history(pg),
            "threads": threads,
        }
        Path(root).mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in st.name)
        path = Path(root) / f"fastdist-{safe}-gen{st.generation}-rank{st.my_global_rank}.json"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=1, default=str))
        tmp.replace(path)
        return str(path)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        print(f"fastdist: could not write the fault dump to {root}: {exc!r}", file=sys.stderr)
        return None


def load(directory: str) -> dict[tuple[str, int], dict[int, dict[str, Any]]]:
    """Every dump in ``directory``: (group, generation) -> rank -> record."""
    out: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    for path in sorted(Path(directory).glob("fastdist-*.json")):
        try:
            rec = json.loads(path.read_text())
            key = (str(rec["group"]), int(rec["generation"]))
            out.setdefault(key, {})[int(rec["rank"])] = rec
        except (ValueError, KeyError, TypeError) as exc:
            print(f"skipping {path}: not a fastdist dump ({exc})", file=sys.stderr)
    return out


def divergence(ranks: dict[int, dict[str, Any]]) -> str:
    """Where the ranks' histories part: the first op some rank issued differently, or did not
    reach, or did not finish while the others did."""
    ops: dict[int, dict[int, dict[str, Any]]] = {
        r: {int(o["seq"]): o for o in rec["history"]} for r, rec in ranks.items()
    }
    reached = {r: max(h) if h else 0 for r, h in ops.items()}
    top = max(reached.values(), default=0)
    for seq in range(max(1, top - 63), top + 1):
        have = {r: h[seq] for r, h in ops.items() if seq in h}
        names = {o["op"] for o in have.values()}
        if len(names) > 1:
            parts = ", ".join(f"rank {r}: {o['op']}" for r, o in sorted(have.items()))
            return f"op #{seq}: the ranks issued different ops ({parts})"
        behind = sorted(r for r in ops if reached[r] < seq)
        if behind:
            name = next(iter(names)) if names else "?"
            who = ", ".join(f"rank {r} (last issued #{reached[r]})" for r in behind)
            return f"op #{seq} ({name}): not issued by {who}"
        pending = sorted(r for r, o in have.items() if o.get("outcome") != "ok")
        if pending and len(pending) < len(have):
            done = sorted(set(have) - set(pending))
            return (
                f"op #{seq} ({next(iter(names))}): finished on ranks {', '.join(map(str, done))}, not on "
                f"{', '.join(map(str, pending))}"
            )
    if any(o.get("outcome") != "ok" for h in ops.values() for o in h.values()):
        return f"every rank issued the same ops up to #{top}; it finished nowhere (a rank without a dump?)"
    return "no divergence in the recorded ops"


def render(dumps: dict[tuple[str, int], dict[int, dict[str, Any]]]) -> str:
    lines: list[str] = []
    for (group, gen), ranks in sorted(dumps.items()):
        lines.append(
            f"group {group!r}, generation {gen}: dumps from ranks {', '.join(map(str, sorted(ranks)))}"
        )
        sizes = {rec.get("world_size") for rec in ranks.values()}
        missing = (
            sorted(set(range(max(s for s in sizes if isinstance(s, int)))) - set(ranks)) if sizes else []
        )
        if missing:
            lines.append(
                f"  no dump from ranks {', '.join(map(str, missing))} (never faulted, or could not write)"
            )
        for r, rec in sorted(ranks.items()):
            first, *where = rec["error"].splitlines() or [""]
            lines.append(f"  rank {r}: {first}")
            lines.extend(f"    {w.strip()}" for w in where)  # where the others were, from its report
            for o in rec["history"][-_LAST_OPS:]:
                shape = f" {o['dtype']}{o['shape']}" if o.get("dtype") else ""
                lines.append(f"    #{o['seq']} {o['op']}{shape} {o['outcome']}")
            main = next((t for t in rec.get("threads", {}).values() if t.get("name") == "MainThread"), None)
            if main and main.get("stack"):
                lines.append(f"    main thread: {' <- '.join(main['stack'])}")
        lines.append(f"  first divergence: {divergence(ranks)}")
    return "\n".join(lines) if lines else "no fastdist dumps found"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="the FASTDIST_DUMP_DIR the ranks wrote to")


def run(args: argparse.Namespace) -> int:
    if not Path(args.directory).is_dir():
        print(f"fastdist report: {args.directory} is not a directory", file=sys.stderr)
        return 2
    dumps = load(args.directory)
    print(render(dumps))
    return 0 if dumps else 1
