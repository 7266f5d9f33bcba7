"""What happened, for a monitoring system: every fault, recovery, shrink and replacement is counted
in this process (fastdist.metrics serves the counts), and with ``FASTDIST_EVENTS=PATH`` also
written to PATH as one JSON line (``{rank}`` in PATH is replaced by the rank; ranks may share
one file: each line is one ``write`` to a file opened for appending).

A record: ``time`` (Unix seconds), ``event`` (one of :data:`EVENTS`), ``rank``, ``group``,
``generation``, ``op``, and the event's own fields (``missing_ranks``, ``seconds``, ...).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from ..errors import CollectiveTimeoutError, GroupAbortedError

if TYPE_CHECKING:
    from ..groups.pgstate import GroupState

logger = logging.getLogger(__name__)

EVENTS = ("timeout", "abort", "interrupt", "recovery", "shrink", "replacement", "grow")
ENV = "FASTDIST_EVENTS"

_lock = threading.Lock()
# (event, group, op) -> how many, since the process started.
counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
# Seconds: "detection" (an op's start to its error, for timeouts) and "recovery" (recover()'s call
# to its return), each a list of observations for the histograms.
durations: dict[str, list[float]] = {"detection": [], "recovery": []}
# The latest generation and world size per group, and the last report's straggler hint.
gauges: dict[str, dict[str, Any]] = {}
# group -> the op history of its generations that recovery replaced, until the metrics read it
# (a rebuilt group numbers its ops afresh, in a fresh history ring).
retired: dict[str, list[list[dict[str, Any]]]] = {}
_RETIRED_KEPT = 8  # generations a group keeps for a scraper that has not come


def retire(group: str, history: list[dict[str, Any]]) -> None:
    """Keeps the op history of ``group``'s generation that recovery is about to replace."""
    with _lock:
        kept = retired.setdefault(group, [])
        kept.append(history)
        del kept[:-_RETIRED_KEPT]


def take_retired() -> dict[str, list[list[dict[str, Any]]]]:
    """The histories retired since the last call, oldest first per group."""
    global retired
    with _lock:
        out, retired = retired, {}
    return out


def emit(event: str, rank: int, group: str, generation: int, op: str = "", **fields: Any) -> None:
    """Counts ``event`` and, with FASTDIST_EVENTS set, writes its record. Never raises: an event
    that cannot be written is logged, and the fault it describes goes on as it would."""
    with _lock:
        counts[(event, group, op)] += 1
        for name, observed in durations.items():
            if isinstance(fields.get(name), (int, float)):
                observed.append(float(fields[name]))
        gauges.setdefault(group, {})["generation"] = generation
        if "world_size" in fields:
            gauges[group]["world_size"] = fields["world_size"]
        if fields.get("straggler"):
            gauges[group]["straggler"] = fields["straggler"]
    path = os.environ.get(ENV)
    if not path:
        return
    record = {
        "time": time.time(),
        "event": event,
        "rank": rank,
        "group": group,
        "generation": generation,
        "op": op,
    }
    record.update(fields)
    line = json.dumps(record, default=str) + "\n"
    try:
        fd = os.open(path.replace("{rank}", str(rank)), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        logger.warning("fastdist: could not write an event to %s: %r", path, exc)


def fault(st: GroupState, err: BaseException, interrupted: bool = False) -> None:
    """The event of a fault on the group of ``st`` that ended an op with ``err``."""
    if isinstance(err, CollectiveTimeoutError):
        emit(
            "timeout",
            st.my_global_rank,
            st.name,
            st.generation,
            err.op,
            seq=err.seq,
            missing_ranks=err.missing_ranks,
            timeout=err.timeout,
            detection=err.elapsed,
            world_size=st.size,
            straggler=err.straggler,
        )
    elif isinstance(err, GroupAbortedError):
        event = "interrupt" if interrupted else "abort"
        emit(event, st.my_global_rank, st.name, st.generation, err.op, reason=err.reason)


def read(path: str) -> list[dict[str, Any]]:
    """The records of an events file, in order (lines that are not fastdist's are skipped)."""
    out: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("event") in EVENTS:
                out.append(rec)
    return out
