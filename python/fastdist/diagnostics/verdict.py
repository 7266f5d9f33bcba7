"""What a failed op on a group means: the typed error a caller gets.

Read by fastdist.ops.fault, which builds the error once per fault (called from C++). The report
itself, who arrived and who did not, is fastdist.store.board.
"""

from __future__ import annotations

import math
import time
from typing import Any

from ..deadlines import current_time
from ..errors import CollectiveTimeoutError
from ..groups.opcall import OpCall
from ..store import board, job
from ..store.bounded import GRACE_SECONDS
from ..store.job import JOB

# How long it waits for fastdist run's record of a death (its agent polls every 0.1 s).
DEATH_WAIT = 0.5

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


def peer_closed(call: OpCall, text: str) -> BaseException:
    """A peer closed the group under ``call``: it timed out first (then this is a timeout too,
    unless this rank only arrived after that: a straggler), or it died. Marks the group dead."""
    st, op, seq, start, deadline = call.st, call.op, call.seq, call.start, call.deadline
    st.mark_dead(f"a peer closed its connection during {op} #{seq}")
    started_wall = time.time() - (current_time() - start)
    # Under fastdist run the agent records a death within its monitor interval: a dead rank is
    # named at once, with how it ended, instead of waited for by the report.
    try:
        bound = deadline - current_time() + GRACE_SECONDS if math.isfinite(deadline) else math.inf
        dead = job.deaths_since(started_wall, st.global_ranks or [], DEATH_WAIT, bound)
    except Exception as exc:  # noqa: BLE001 - the store lives in an agent, frozen or gone with its node
        # The report would wait behind the unanswered call (a store client serializes its calls):
        # the error says the store is gone, now, as the report's own failure would.
        JOB.note_store_failure(exc)
        reason = f"{JOB.store_gone_reason()}; {op} #{seq} failed: {text}"
        st.mark_dead(reason, replace=True)
        return st.aborted(op, reason)
    if dead:
        who = "; ".join(f"rank {r} is dead ({how})" for r, how in sorted(dead.items()))
        # The ranks not connected to the dead one would wait for their deadline: ring them.
        board.announce(st.seat(frozenset(dead)), op, seq, "aborted", dead=who)
        reason = f"{who}; {op} #{seq} failed: {text}"
        st.mark_dead(reason, replace=True)
        st.presume_gone(list(dead))
        return st.aborted(op, reason)
    # The report rings every live rank at once (they answer within its window), and a peer that
    # timed out posted before it closed the group: no need to wait for this op's deadline too
    # (a dead rank's peers did, 3.3 s for a 3 s step, before the ring existed).
    rep = board.report(st.seat(), op, seq, "aborted", deadline - start if math.isfinite(deadline) else 1.0)
    cause, why = peer_closed_verdict(rep, started_wall)
    if rep is None and JOB.failure is not None:
        why = JOB.store_gone_reason()
    if cause is not None:
        assert rep is not None  # a cause comes from a report's timed-out ranks
        st.mark_dead(f"{op} #{seq} timed out on rank {min(rep.timed_out)}", replace=True)
        return timeout_error(call, rep, cause)
    reason = f"{why}; {op} #{seq} failed: {text}"
    st.mark_dead(reason, replace=True)
    if rep is not None and rep.silent and not rep.timed_out:
        # They closed their connections and did not answer the ring: gone. A recovery that may
        # shrink does not wait for them (see fastdist.recovery). A rank that answered from
        # outside the op is alive, whatever else failed.
        st.presume_gone(rep.silent)
    return st.aborted(op, reason)


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
