"""Fault dumps and the merged view: ``FASTDIST_DUMP_DIR`` and ``python -m fastdist report DIR``.

With ``FASTDIST_DUMP_DIR`` set, each rank writes one JSON file there when an op on one of its
groups times out or is ended by a peer's fault: the group, the error, the group's op history
(:func:`fastdist.history`), where this rank's threads were, and the stacks the report gathered
from the others. ``python -m fastdist report DIR`` reads every rank's file and prints, per group
and generation, each rank's last ops and stack, and the first op where the ranks diverged; given
``FASTDIST_EVENTS`` files (or finding ``*.jsonl`` in DIR), the events of every rank as one
timeline. Each dump is also written in torch's flight recorder format (``torchfr-GROUP-genN/rank{R}``), so
torch's own analyzer reads the same fault: ``torchfrtrace DIR/torchfr-default-gen0
--allow-incomplete-ranks`` (the ranks that never faulted write no dump).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
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
    except Exception as exc:  # noqa: BLE001 - see the docstring
        print(f"fastdist: could not write the fault dump to {root}: {exc!r}", file=sys.stderr)
        return None
    try:
        write_flight_recorder(Path(root), st, pg, record["history"])
    except Exception as exc:  # noqa: BLE001 - see the docstring
        print(f"fastdist: could not write the flight recorder dump to {root}: {exc!r}", file=sys.stderr)
    return str(path)


# torch's flight recorder names (torch.distributed.flight_recorder.components.types.COLLECTIVES)
# for the ops fastdist's history records under the names of torch's Python API.
_FR_NAMES = {
    "all_gather_into_tensor": "_all_gather_base",
    "reduce_scatter_tensor": "_reduce_scatter_base",
    "all_reduce_coalesced": "allreduce_coalesced",
    "all_gather_coalesced": "ALLGATHER_coalesced",
}
FR_VERSION = "2.10"  # the dump format of torch's FlightRecorder.hpp that torchfrtrace reads


def _fr_output_sizes(name: str, shape: list[int], size: int) -> list[list[int]]:
    numel = 1
    for d in shape:
        numel *= int(d)
    if name == "_all_gather_base":
        return [[numel * size]]
    if name == "all_gather":
        return [list(shape)] * size
    if name == "_reduce_scatter_base":
        return [[numel // max(size, 1)]]
    return [list(shape)] if shape else []


def flight_recorder_entries(name: str, backend: str, size: int, history: list[dict[str, Any]]) -> list[Any]:
    """``history`` (fastdist.history()) as torch's flight recorder entries: one per collective,
    in order, completed or (in flight at the fault) started. Sends and receives are left out: the
    history does not keep their peer."""
    out: list[dict[str, Any]] = []
    for o in history:
        op = _FR_NAMES.get(str(o["op"]), str(o["op"]))
        if op in ("send", "recv", "coalesced"):
            continue
        shape = [int(d) for d in o["shape"]] if o.get("shape") is not None else None
        ins = [shape] if shape is not None else []
        outs = _fr_output_sizes(op, shape or [], size) if shape is not None else []
        dtype = str(o.get("dtype") or "").removeprefix("torch.")
        done = o.get("outcome") == "ok"
        start = int(float(o["start"]) * 1e9) if o.get("start") is not None else 0
        end = int(float(o["end"]) * 1e9) if o.get("end") is not None else None
        out.append(
            {
                "record_id": len(out),
                "pg_id": 0,
                "process_group": (name, name),
                "collective_seq_id": int(o["seq"]),
                "p2p_seq_id": 0,
                "op_id": int(o["seq"]),
                "profiling_name": f"{backend}:{op}",
                "time_created_ns": start,
                "input_sizes": ins,
                "output_sizes": outs,
                "input_dtypes": [dtype] * len(ins),
                "output_dtypes": [dtype] * len(outs),
                "state": "completed" if done else "started",
                "time_discovered_started_ns": start,
                "time_discovered_completed_ns": end if done else None,
                "retired": done,
                "timeout_ms": 0,
                "is_p2p": False,
                "frames": [],
            }
        )
    return out


def write_flight_recorder(root: Path, st: Any, pg: Any, history: list[dict[str, Any]]) -> None:
    """The same fault in torch's flight recorder format, which its analyzer reads
    (``torchfrtrace DIR --allow-incomplete-ranks``): ``DIR`` is
    ``FASTDIST_DUMP_DIR/torchfr-GROUP-genN``, one pickle per rank, ``rank{R}``."""
    try:
        backend = registry.backends_of(pg)[0].inner.name() if registry.backends_of(pg) else "gloo"
    except Exception:  # noqa: BLE001 - a name is all this needs
        backend = "gloo"
    ranks = list(getattr(st, "global_ranks", None) or range(st.size))
    dump = {
        "version": FR_VERSION,
        "pg_config": {st.name: {"name": st.name, "desc": st.name, "ranks": str(ranks)}},
        "pg_status": {},
        "entries": flight_recorder_entries(st.name, backend, st.size, history),
    }
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in st.name)
    where = root / f"torchfr-{safe}-gen{st.generation}"
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"rank{st.my_global_rank}"
    tmp = where / f".tmp{os.getpid()}"
    tmp.write_bytes(pickle.dumps(dump))
    tmp.replace(path)


def _dump_problem(rec: Any) -> str | None:
    """What keeps ``rec`` from being read as a dump (None: nothing), so that rendering trusts it."""
    if not isinstance(rec, dict):
        return "not a JSON object"
    for name, kind in (("group", str), ("generation", int), ("rank", int), ("error", str), ("history", list)):
        if not isinstance(rec.get(name), kind) or isinstance(rec.get(name), bool):
            return f"{name} is missing or not a{'n' if kind is int else ''} {kind.__name__}"
    for op in rec["history"]:
        if (
            not isinstance(op, dict)
            or not isinstance(op.get("seq"), int)
            or not isinstance(op.get("op"), str)
        ):
            return "history holds an entry that is not an op (seq, op)"
    threads = rec.get("threads", {})
    if not isinstance(threads, dict) or not all(
        isinstance(t, dict) and all(isinstance(f, str) for f in t.get("stack") or [])
        for t in threads.values()
    ):
        return "threads is not a map of thread names and stacks"
    return None


def _read_text(path: Path) -> str | None:
    """The file's text, or None after one line on stderr saying why it cannot be read."""
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        why = "not text (damaged?)" if isinstance(exc, UnicodeDecodeError) else exc.strerror or str(exc)
        print(f"skipping {path}: {why}", file=sys.stderr)
        return None


def load(directory: str) -> dict[tuple[str, int], dict[int, dict[str, Any]]]:
    """Every dump in ``directory``: (group, generation) -> rank -> record. A damaged file (cut
    short, not JSON, fields of the wrong kind) is skipped with one line on stderr."""
    out: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    for path in sorted(Path(directory).glob("fastdist-*.json")):
        text = _read_text(path)
        if text is None:
            continue
        try:
            rec = json.loads(text)
        except ValueError as exc:
            print(f"skipping {path}: not a fastdist dump (not JSON: {exc})", file=sys.stderr)
            continue
        problem = _dump_problem(rec)
        if problem is not None:
            print(f"skipping {path}: not a fastdist dump ({problem})", file=sys.stderr)
            continue
        out.setdefault((rec["group"], rec["generation"]), {})[rec["rank"]] = rec
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
    """The merged view of :func:`load`'s dumps, as text: per group and generation, each rank's
    error, last ops and main thread's stack, the ranks without a dump, and the first divergence."""
    lines: list[str] = []
    for (group, gen), ranks in sorted(dumps.items()):
        lines.append(
            f"group {group!r}, generation {gen}: dumps from ranks {', '.join(map(str, sorted(ranks)))}"
        )
        sizes = [rec["world_size"] for rec in ranks.values() if isinstance(rec.get("world_size"), int)]
        missing = sorted(set(range(max(sizes))) - set(ranks)) if sizes else []
        if missing:
            lines.append(
                f"  no dump from ranks {', '.join(map(str, missing))} (never faulted, or could not write)"
            )
        for r, rec in sorted(ranks.items()):
            first, *where = rec["error"].splitlines() or [""]
            lines.append(f"  rank {r}: {first}")
            lines.extend(f"    {w.strip()}" for w in where)  # where the others were, from its report
            for o in rec["history"][-_LAST_OPS:]:
                shape = f" {o['dtype']}{o.get('shape')}" if o.get("dtype") else ""
                lines.append(f"    #{o['seq']} {o['op']}{shape} {o.get('outcome')}")
            main = next((t for t in rec.get("threads", {}).values() if t.get("name") == "MainThread"), None)
            if main and main.get("stack"):
                lines.append(f"    main thread: {' <- '.join(main['stack'])}")
        lines.append(f"  first divergence: {divergence(ranks)}")
    return "\n".join(lines) if lines else "no fastdist dumps found"


def _event_problem(rec: Any) -> str | None:
    """What keeps ``rec`` from being read as an event (None: nothing)."""
    if not isinstance(rec, dict) or not isinstance(rec.get("event"), str):
        return "no event"
    for name in ("time", "detection", "recovery"):
        value = rec.get(name)
        if (name == "time" or value is not None) and not (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        ):
            return f"{name} is not a number of seconds"
    try:
        time.localtime(rec["time"])
    except (OverflowError, OSError, ValueError):
        return "time is out of range"
    return None


def load_events(paths: list[Path]) -> list[dict[str, Any]]:
    """The records of ``FASTDIST_EVENTS`` files (one JSON object a line), oldest first. The lines
    that are not events (cut short by a crash, damaged) are skipped with one line per file."""
    out: list[dict[str, Any]] = []
    for path in paths:
        text = _read_text(path)
        if text is None:
            continue
        bad: list[int] = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
            if _event_problem(rec) is None:
                out.append(rec)
            else:
                bad.append(n)
        if bad:
            lines = f"line {bad[0]}" if len(bad) == 1 else f"{len(bad)} lines (the first: line {bad[0]})"
            print(f"skipping {lines} of {path}: not a fastdist event", file=sys.stderr)
    return sorted(out, key=lambda r: float(r["time"]))


def _event_line(rec: dict[str, Any]) -> str:
    when = (
        time.strftime("%H:%M:%S", time.localtime(float(rec["time"])))
        + f".{int(float(rec['time']) * 1000) % 1000:03d}"
    )
    head = f"{when} rank {rec.get('rank')} {rec.get('group')!s} gen {rec.get('generation')}: {rec['event']}"
    op = (
        f" in {rec['op']} #{rec['seq']}"
        if rec.get("op") and rec.get("seq") is not None
        else (f" in {rec['op']}" if rec.get("op") else "")
    )
    extra = []
    if rec.get("missing_ranks"):
        extra.append(f"missing ranks {rec['missing_ranks']}")
    if rec.get("detection") is not None:
        extra.append(f"detected after {float(rec['detection']):.3f} s")
    if rec.get("recovery") is not None:
        extra.append(f"recovered in {float(rec['recovery']):.3f} s")
    if rec.get("joiners"):
        extra.append(f"joiners {rec['joiners']}")
    if rec.get("left_out"):
        extra.append(f"left out {rec['left_out']}")
    if rec.get("replaced_rank") is not None:
        extra.append(f"replaced rank {rec['replaced_rank']}")
    if rec.get("reason"):
        extra.append(str(rec["reason"]).splitlines()[0][:160])
    return head + op + (": " + "; ".join(extra) if extra else "")


def render_events(records: list[dict[str, Any]]) -> str:
    """The events as one timeline: a line of counts, then one line per event ("" for no events)."""
    if not records:
        return ""
    counts: dict[str, int] = {}
    for rec in records:
        counts[str(rec["event"])] = counts.get(str(rec["event"]), 0) + 1
    ranks = sorted({int(r["rank"]) for r in records if isinstance(r.get("rank"), int)})
    lines = [
        f"events: {len(records)} from ranks {', '.join(map(str, ranks))} ("
        + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        + ")"
    ]
    lines += [f"  {_event_line(r)}" for r in records]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the arguments of ``fastdist report`` to ``parser``."""
    parser.add_argument(
        "paths",
        nargs="+",
        help="the FASTDIST_DUMP_DIR the ranks wrote to, and/or FASTDIST_EVENTS files (*.jsonl; those "
        "in a directory given are read too)",
    )


def run(args: argparse.Namespace) -> int:
    """Runs ``fastdist report``: prints the merged view of the dumps in the directories given, and
    the timeline of the events (the files given, and ``*.jsonl`` in those directories). Returns 1
    when there was nothing to report, 2 when a path is neither a directory nor a file, else 0."""
    dumps: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    event_files: list[Path] = []
    for given in args.paths:
        path = Path(given)
        if path.is_dir():
            for key, ranks in load(str(path)).items():
                dumps.setdefault(key, {}).update(ranks)
            event_files += sorted(path.glob("*.jsonl"))
        elif path.is_file():
            event_files.append(path)
        else:
            print(f"fastdist report: {given} is neither a directory nor a file", file=sys.stderr)
            return 2
    events = load_events(event_files)
    parts = ([render(dumps)] if dumps or not events else []) + ([render_events(events)] if events else [])
    print("\n".join(parts))
    return 0 if dumps or events else 1
