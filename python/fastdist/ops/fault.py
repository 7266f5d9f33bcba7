"""Where a fault becomes an error.

The watched backend (csrc/watched: a watched group's, or the private one fastdist's own ops on a
group torch made go through) calls :func:`build` once per fault, with the GIL, for the exception
every waiter of the group raises. What follows a deadline is one sequence (:func:`timed_out`): the group is
marked dead (an NCCL-like group's communicators start aborting, bounded, in the background), the
who-is-missing report is gathered (fastdist.store.board, which reads the records; its
verdicts: fastdist.diagnostics.verdict), ranks that never answered are named to ``fastdist run``,
and the :class:`CollectiveTimeoutError` is built from the report. A peer's fault (:func:`_remote`)
or a backend's error ends as the same timeout or as a :class:`GroupAbortedError` naming whose fault
it was; the timeout handler runs in the waiting thread, or on fastdist's own for an op nobody
waits on.
"""

from __future__ import annotations

import copy
import json
import math
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from .._native import _watched
from ..deadlines import current_time, run_timeout_handler
from ..diagnostics import dump, events, verdict
from ..errors import CollectiveTimeoutError, GroupAbortedError, remember
from ..groups import abort, pgstate, registry
from ..groups.opcall import OpCall
from ..store import board, job
from ..store.job import JOB
from .work import run_handler_unwaited

if TYPE_CHECKING:
    from ..groups.pgstate import GroupState

# What kind of fault an op met, as the C++ side says it.
Kind = _watched.FaultKind

# Whether Ctrl-C ended an op of this process (the exit then does not wait for it to end in gloo).
_interrupted = False


def build(ctl_id: int, info: dict[str, Any]) -> BaseException:
    """The exception for the fault ``info`` (op, seq, kind, detail, start, deadline, ...) of the
    watched backend ``ctl_id``: called from C++, with the GIL, once per fault."""
    # Whatever this raises (a waiter's timeout handler's sys.exit() among others) is the error.
    err = _build_error(ctl_id, info)
    if info["kind"] in (Kind.TIMEOUT, Kind.REMOTE, Kind.BACKEND) and os.environ.get("FASTDIST_DUMP_DIR"):
        pg = registry.group_of(ctl_id)
        if pg is not None:
            dump.write(pgstate.state_of(pg), pg, err)
    if info["kind"] != Kind.REFUSED:
        # A copy: the error itself gets a traceback when raised, and with it the frames of the
        # failed call; kept here, those would live on.
        remember(copy.copy(err))
        _count(ctl_id, info["kind"], err)
    return err


def _count(ctl_id: int, kind: Any, err: BaseException) -> None:
    """The fault's event (fastdist.diagnostics.events): counted, and written when asked."""
    pg = registry.group_of(ctl_id)
    if pg is not None:
        events.fault(pgstate.state_of(pg), err, interrupted=kind == Kind.INTERRUPTED)


def _build_error(ctl_id: int, info: dict[str, Any]) -> BaseException:
    pg = registry.group_of(ctl_id)
    op, seq, kind = info["op"], int(info["seq"]), info["kind"]
    if pg is None:
        return GroupAbortedError(
            op=op, group="?", rank=-1, reason=info["detail"] or f"{op} #{seq} {kind.name.lower()}"
        )
    st = pgstate.state_of(pg)
    if kind == Kind.REFUSED:
        # The reason fastdist recorded (it names the peer whose fault rang this rank) before the
        # engine's own, which knows only that the op was ended by a peer's fault.
        reason = st.dead_reason or info["detail"] or "aborted"
        return st.aborted(op, reason)
    start = float(info["start"])
    deadline = float(info["deadline"])
    call = OpCall(op, pg, st, seq, start, deadline, info["prev"] or None)
    if kind == Kind.INTERRUPTED:
        global _interrupted
        _interrupted = True
        reason = f"an op was interrupted (Ctrl-C) on rank {st.my_global_rank}"
        st.mark_dead(reason)
        # The peers in the op would otherwise wait for it until their deadline, and then blame a
        # timeout: ring them (bounded, so that the KeyboardInterrupt is not held up).
        board.announce(st.seat(), op, seq, "interrupted")
        # Ctrl-C: every op in flight on the group ends, wherever torch waits for it (DDP's backward
        # included), and the group is dead. The KeyboardInterrupt itself is Python's: its handler
        # runs as soon as the main thread is back in Python, a moment later (raising one here too
        # would give two).
        return st.aborted(op, reason)
    if kind == Kind.REMOTE:
        return _remote(call, info)
    text = verdict.first_line(info["detail"] or "")
    said = verdict.classify(text)
    if kind == Kind.TIMEOUT or said == verdict.TIMEOUT:
        cause = None if (not text or deadline <= start) else text  # an expired deadline says so itself
        late = _gil_held(info, deadline) if info.get("native") else None
        err: BaseException = timed_out(call, cause, late=late)
        _run_handler(err, info["waiter"])
        return err
    if said == verdict.PEER_CLOSED:
        err = verdict.peer_closed(call, text)
        if isinstance(err, CollectiveTimeoutError):
            _run_handler(err, info["waiter"])
        return err
    reason = f"{op} #{seq} failed on rank {st.my_global_rank}: {text or 'backend error'}"
    st.mark_dead(reason)
    return st.aborted(op, reason)


def _remote(call: OpCall, info: dict[str, Any]) -> BaseException:
    """A peer reported a fault on the group (fastdist.diagnostics.listener) while this rank's op
    ``call`` was in flight. In the same op: the same timeout, with the same report (everyone
    raises together). In another: the group is dead under this op; say whose fault it was."""
    pg, st, op, seq, start, deadline = call.pg, call.st, call.op, call.seq, call.start, call.deadline
    try:
        peer = json.loads(info["detail"])
    except ValueError:
        peer = {}
    who = f"rank {peer.get('rank', '?')}"
    what = f"{peer.get('op', '?')} #{peer.get('seq', '?')}"
    # This rank's op began after the peer's fault: a straggler (it was stopped, or slow), not a
    # rank stuck in the op with the others.
    began = time.time() - (current_time() - start)
    late = isinstance(peer.get("t"), (int, float)) and began > peer["t"]
    if peer.get("state") == "interrupted":
        return _aborted(pg, st, op, f"{who} was interrupted (KeyboardInterrupt) in {what}")
    if peer.get("state") == "told" and isinstance(peer.get("dead"), str):
        return _aborted(pg, st, op, peer["dead"])  # the job recovers (fastdist.diagnostics.listener)
    if peer.get("state") == "dead" and isinstance(peer.get("dead"), str):
        return _aborted(pg, st, op, f"{peer['dead']}: fastdist run's record")  # (the launcher's notice)
    if isinstance(peer.get("dead"), str):
        return _aborted(pg, st, op, f"{peer['dead']} (seen by {who} in {what})")
    if peer.get("state") == "aborted":
        # The ringer's op failed under it (a peer closed the group): not a timeout of its own. It
        # rang before it knew who closed it; the report it collects says (a dead rank never posts).
        budget = deadline - start if math.isfinite(deadline) else 1.0
        rep = board.report(st.seat(), op, seq, "aborted", budget, rung=True)
        cause, why = verdict.peer_closed_verdict(rep, began)
        if cause is None and rep is not None and rep.missing:
            return _aborted(pg, st, op, f"{why} (seen by {who} in {what})")
        return _aborted(
            pg,
            st,
            op,
            f"{who} saw the group closed under it by a peer in {what} (a rank exited or was killed)",
        )
    # The peer timed out when this rank's own deadline had passed too (equal deadlines, a peer a
    # hair faster): this rank's op timed out as well, and says so, with the same report, whichever
    # rank's timer fired first.
    own_also = peer.get("state") == "timed_out" and current_time() >= deadline - _SAME_MOMENT
    if (peer.get("op") == op and peer.get("seq") == seq and not late) or own_also:
        err = timed_out(call, f"{who} timed out first{verdict.gil_note(peer)}", rung_by=who)
        _run_handler(err, info["waiter"])
        return err
    verb = "timed out in" if peer.get("state") == "timed_out" else "failed in"
    return _aborted(
        pg,
        st,
        op,
        f"{who} {verb} {what}{verdict.gil_note(peer)} and aborted group {st.name!r} "
        f"while this rank was in {op} #{seq}",
    )


def _gil_held(info: dict[str, Any], deadline: float) -> str:
    """Why a timeout is raised late: Python could not run when the deadline passed (C++ reported
    it then, see fastdist.groups.native_report.arm)."""
    issuer = threading._active.get(int(info.get("thread") or 0))  # type: ignore[attr-defined]
    who = f"thread {issuer.name!r}, which issued the op," if issuer is not None else "a thread"
    return (
        f"its deadline passed while the GIL was held and Python could not run here for "
        f"{max(0.0, current_time() - deadline):.1f} s after it ({who} or another thread was in a long "
        "call that does not release the GIL); fastdist told the other ranks from C++ at the deadline"
    )


# A peer's timeout that reaches this rank within this many seconds of its own deadline counts as
# this rank's own timeout too.
_SAME_MOMENT = 0.05


def _aborted(pg: Any, st: GroupState, op: str, reason: str) -> GroupAbortedError:
    """The group is dead under ``op`` for ``reason`` (a peer's fault): the error, after _die."""
    _die(
        pg,
        st,
        reason,
        st.aborted(op, reason + "; aborting the communicators hung"),
    )
    return st.aborted(op, reason)


def _die(
    pg: Any, st: GroupState, reason: str, if_abort_hangs: BaseException | None, abandoned: Any = None
) -> None:
    """Marks the group dead (``abandoned``: see :meth:`GroupState.mark_dead`) and, on NCCL,
    starts aborting its communicators (in the background, bounded: ``if_abort_hangs`` goes to
    the timeout handler when the abort does not return)."""
    st.mark_dead(reason, abandoned=abandoned)
    if st.polled and if_abort_hangs is not None:
        abort.abort_group(pg, st.is_default, if_abort_hangs)


def _run_handler(err: BaseException, waiter: bool) -> None:
    if waiter:
        run_timeout_handler(err)  # whatever it raises propagates in the waiting thread
    else:
        run_handler_unwaited(err)


def interrupted() -> bool:
    """Whether Ctrl-C ended an op of this process."""
    return _interrupted


def timed_out(
    call: OpCall,
    cause: str | None = None,
    *,
    abandoned: Any = None,
    late: str | None = None,
    rung_by: str | None = None,
) -> CollectiveTimeoutError:
    """The error for ``call``, whose deadline passed (``call.last_seen`` filled in). ``cause``:
    what the backend or the caller said; a store that stopped answering this rank's report
    replaces it. ``abandoned``: the token of the op still in flight (see
    :meth:`GroupState.mark_dead`). ``late``: why the error comes after the deadline (Python could
    not run then), put first. ``rung_by``: the peer (``"rank N"``) whose timeout of the same op
    rang this rank first: its report is read, not gathered again."""
    st = call.st
    who = rung_by or f"rank {st.my_global_rank}"
    hung = verdict.timeout_error(call, None, "aborting the communicators hung") if st.polled else None
    _die(call.pg, st, f"{call.name} timed out on {who}", hung, abandoned)
    seat = st.seat()
    budget = call.deadline - call.start if math.isfinite(call.deadline) else 1.0
    if rung_by is not None:
        rep = board.report(seat, call.op, call.seq, "aborted", budget, rung=True)
    else:
        rep = board.report(seat, call.op, call.seq, "timed_out", budget)
        if rep is None and JOB.failure is not None:
            cause = JOB.store_gone_reason()
    if late:
        cause = late + (f"; {cause}" if cause else "")
    if rep is not None and rung_by is None:
        silent = rep.silent  # never reached it, did not answer
        if silent:  # fastdist run's agent kills a rank that stays silent (a frozen process)
            began = time.time() - (current_time() - call.start)
            job.name_missing(silent, st.my_global_rank, f"{call.name} on group {st.name!r}", began)
    return verdict.timeout_error(call, rep, cause)
