"""What a failed op on a group means: the typed error a caller gets, read from what happened (a
backend's error text, the board's report, a fault record). Pure: it changes no state.

Read by fastdist.ops.fault, which builds the error once per fault (called from C++) and makes
every change a fault makes. The report itself, who arrived and who did not, is
fastdist.store.board.
"""

from __future__ import annotations

import math
from typing import Any

from ..deadlines import current_time
from ..errors import CollectiveTimeoutError
from ..groups.opcall import OpCall
from ..store import board

# What gloo says when its own per-call timeout fires, and when a peer closed the group. gloo raises
# a plain RuntimeError for both (not one of torch's DistError classes), so only its text tells.
_BACKEND_TIMEOUT_MARKERS = ("Timed out", "timed out", "Timeout")
_PEER_CLOSED_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "pair closure",
    "Broken pipe",
)

TIMEOUT = "timeout"
PEER_CLOSED = "peer_closed"


def classify(exc: BaseException | str) -> str | None:
    """:data:`TIMEOUT` when a backend error (or its text) is the backend's own per-call timeout,
    :data:`PEER_CLOSED` when a peer closed the group's connections, else None."""
    text = exc if isinstance(exc, str) else str(exc)
    if any(m in text for m in _BACKEND_TIMEOUT_MARKERS):
        return TIMEOUT
    if any(m in text for m in _PEER_CLOSED_MARKERS):
        return PEER_CLOSED
    return None


def first_line(exc: BaseException | str) -> str:
    """The first line of ``exc``'s text; for an exception without text, its class's name."""
    text = (exc if isinstance(exc, str) else str(exc)).strip()
    return text.splitlines()[0] if text else (type(exc).__name__ if not isinstance(exc, str) else "")


def timeout_error(call: OpCall, rep: board.Report | None, cause: str | None) -> CollectiveTimeoutError:
    """The :class:`CollectiveTimeoutError` for ``call``, with the report ``rep`` if there is one."""
    st = call.st
    return CollectiveTimeoutError(
        op=call.op,
        seq=call.seq,
        rank=st.my_global_rank,
        world_size=st.size,
        group=st.name,
        timeout=call.deadline - call.start if math.isfinite(call.deadline) else math.inf,
        elapsed=current_time() - call.start,
        missing_ranks=None if rep is None else rep.missing,
        desynced=None if rep is None else rep.desynced,
        last_seen=call.last_seen,
        cause=cause,
        stacks=None if rep is None else rep.stacks,
        straggler=None if rep is None else rep.straggler,
    )


def peer_closed_verdict(rep: board.Report | None, started_wall: float) -> tuple[str | None, str]:
    """What a report says about a group a peer closed under this rank's op (started at
    ``started_wall``, a time.time()): ``(cause, "")`` when a peer timed out while this rank was in
    the op (then this is a timeout too), else ``(None, why)``: this rank arrived after a peer had
    timed out and aborted (a straggler), or peers exited or were killed."""
    if (
        rep is not None
        and rep.timed_out
        and rep.first_timeout_wall is not None
        and rep.first_timeout_wall > started_wall
    ):
        return f"rank {min(rep.timed_out)} timed out first and closed the group", ""
    if rep is not None and rep.timed_out:
        return None, f"rank {min(rep.timed_out)} had timed out and aborted the group before this rank arrived"
    if rep is not None and rep.missing:
        silent, elsewhere = rep.silent, [r for r in rep.missing if r in rep.stacks]
        why = []
        if silent:
            many = len(silent) > 1
            why.append(
                f"rank{'s' if many else ''} {', '.join(map(str, silent))} exited or "
                f"{'were' if many else 'was'} killed"
            )
        if elsewhere:
            many = len(elsewhere) > 1
            why.append(
                f"rank{'s' if many else ''} {', '.join(map(str, elsewhere))} answered from "
                f"outside the op (alive)"
            )
        return None, "; ".join(why)
    return None, "a peer exited or was killed"


def gil_note(record: dict[str, Any]) -> str:
    """For a fault record that C++ made because the ringer's Python could not run at its deadline
    (``"gil": true``; see ``NativeReport`` in csrc/watched/watched.h): says so, else ``""``."""
    if record.get("gil") is not True:
        return ""
    return (
        " (its Python could not run within 0.2 s of its deadline: a thread there held the GIL, or its "
        "host was starved; fastdist reported it from C++)"
    )
