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

Every change a fault makes to a group is made here: what a peer's fault record does
(:func:`peer_fault`, applied by the ring's listener, fastdist.ops.listener), a peer's closed
connection (:func:`peer_closed`), a death ``fastdist run`` recorded (:func:`peer_died`), and an op
on another group ended so that its rank joins the job's recovery (:func:`tell`).
fastdist.diagnostics only reads and reports.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from .._native import _watched
from ..deadlines import current_time, run_timeout_handler
from ..diagnostics import dump, events, stacks, verdict
from ..errors import CollectiveTimeoutError, GroupAbortedError, remember
from ..groups import abort, pgstate, registry
from ..groups.opcall import OpCall
from ..store import board, job, ring, seal
from ..store.bounded import GRACE_SECONDS
from ..store.job import JOB
from .work import run_handler_unwaited

if TYPE_CHECKING:
    from ..groups.pgstate import GroupState

# What kind of fault an op met, as the C++ side says it.
Kind = _watched.FaultKind

# How long a peer's closed connection waits for fastdist run's record of a death (its agent polls
# every 0.1 s).
DEATH_WAIT = 0.5

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
        err = peer_closed(call, text)
        if isinstance(err, CollectiveTimeoutError):
            _run_handler(err, info["waiter"])
        return err
    reason = f"{op} #{seq} failed on rank {st.my_global_rank}: {text or 'backend error'}"
    st.mark_dead(reason)
    return st.aborted(op, reason)


def _remote(call: OpCall, info: dict[str, Any]) -> BaseException:
    """A peer reported a fault on the group (fastdist.ops.listener) while this rank's op
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
        return _aborted(pg, st, op, peer["dead"])  # the job recovers (fastdist.ops.listener)
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


# A peer's fault, a peer's closed connection, a death fastdist run recorded: what each does to the
# group (marked dead, its ops in flight failed, the ring forwarded, the report posted).


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
    cause, why = verdict.peer_closed_verdict(rep, started_wall)
    if rep is None and JOB.failure is not None:
        why = JOB.store_gone_reason()
    if cause is not None:
        assert rep is not None  # a cause comes from a report's timed-out ranks
        st.mark_dead(f"{op} #{seq} timed out on rank {min(rep.timed_out)}", replace=True)
        return verdict.timeout_error(call, rep, cause)
    reason = f"{why}; {op} #{seq} failed: {text}"
    st.mark_dead(reason, replace=True)
    if rep is not None and rep.silent and not rep.timed_out:
        # They closed their connections and did not answer the ring: gone. A recovery that may
        # shrink does not wait for them (see fastdist.recovery). A rank that answered from
        # outside the op is alive, whatever else failed.
        st.presume_gone(rep.silent)
    return st.aborted(op, reason)


def peer_died(death: dict[str, Any], default: Any) -> None:
    """``fastdist run``'s agent saw rank ``death["rank"]`` die (its record: how, when). On an
    NCCL-like group that holds it, the collectives in flight may never end on their own (a kernel
    spins until the deadline): they fail now with the record, and the communicators are aborted
    (fastdist.ops.watching); with none in flight the group is marked dead, so the next op is
    refused at once. gloo's groups learn it from their closed connections: left alone. A group
    whose generation began after the death (rebuilt since, or this process is the dead rank's
    replacement) is left alone too. ``default``: the default group, or None."""
    dead = death["rank"]
    said = f"rank {dead} is dead ({death['how']})"
    told: list[tuple[Any, Any]] = []  # groups without the dead rank
    for pg in registry.watched_groups():
        st = pgstate.state_of(pg)
        ranks = st.global_ranks or []
        if dead == st.my_global_rank or st.began > death["time"]:
            continue
        if dead not in ranks:
            told.append((pg, st))
            continue
        if not st.polled:
            continue
        reason = f"{said}: fastdist run's record"
        detail = json.dumps({"rank": ranks.index(dead), "op": "", "seq": 0, "state": "dead", "dead": said})
        failed = False
        for b in registry.backends_of(pg):
            failed = b.fail_remote(detail, reason) or failed
        if not failed:
            st.mark_dead(reason)
    # The job recovers: an op on a group without the dead rank would hold this rank out of it.
    if not told or default is None:
        return
    dst = pgstate.state_of(default)
    with dst.generation_lock:  # (a recovery that began since rebuilds these groups: not news)
        if dst.began <= death["time"]:
            for pg, st in told:
                tell(pg, st, f"{said}: fastdist run's record", "", 0)


def peer_fault(store: Any, st: GroupState, pg: Any, fault: dict[str, Any], raw: bytes) -> None:
    """Applies a peer's fault record (``fault``, parsed from ``raw``: fastdist.ops.listener) to ``pg``,
    of the fault's generation (the caller holds ``st.generation_lock``): forwards the ring, posts
    this rank's status to the board, and fails its ops in flight on the group or marks it dead;
    a fault on the default group ends the ops in flight on every other group too (:func:`tell`)."""
    record = raw.decode() if isinstance(raw, bytes) else str(raw)
    for child in st.ring_children(fault["root"], ring.dead_of(fault)):
        ring.deliver(store, child, record)
    backends = registry.backends_of(pg)
    inflight = sorted((op for b in backends for op in b.inflight_ops()), key=lambda o: o[1])
    seat = dataclasses.replace(st.seat(), store=store)
    if inflight:
        op, seq, thread, _start = inflight[0]
        status = seat.status(op, seq, "in_op", stack=stacks.stack_of(thread))
    else:
        status = seat.status("", 0, "elsewhere", stack=stacks.stack_of(stacks.issuer(backends)))
    if board.post_status(seat, status):
        # This rank's post completed the board: it publishes the summary, before it ends its
        # ops (ending one can run that op's own report, which waits for the summary, here).
        board.publish(seat)
    verb = {"timed_out": "timed out in", "interrupted": "was interrupted (KeyboardInterrupt) in"}.get(
        str(fault.get("state")), "failed in"
    )
    reason = (
        f"rank {fault['rank']} {verb} {fault['op']} #{fault['seq']}{verdict.gil_note(fault)} and aborted "
        f"group {st.name!r} while this rank was in no op on it"
    )
    if isinstance(fault.get("dead"), str):
        reason = f"{fault['dead']}; {reason}"
    for b in backends:
        b.fail_remote(seal.opened(record, "fault record") or "{}", reason)  # (the record itself)
    if not inflight:  # (an op in flight counts its fault where it fails: fastdist.ops.watching)
        st.mark_dead(reason)
        events.emit("abort", st.my_global_rank, st.name, st.generation, str(fault["op"]), reason=reason)
    if st.is_default:  # the whole job recovers: an op on another group would hold this rank
        what = f"rank {fault['rank']} {verb} {fault['op']} #{fault['seq']} and aborted group 'default'"
        for other in registry.watched_groups():
            if other is not pg:
                ost = pgstate.state_of(other)
                tell(other, ost, what, str(fault["op"]), int(fault["seq"]))


def tell(pg: Any, st: GroupState, what: str, op: str, seq: int) -> None:
    """The job must recover (``what`` happened on a group this rank holds with ``pg``, or to a
    rank outside ``pg``): an op in flight on ``pg`` would keep this rank out of the recovery until
    its own deadline (the live ranks' recovery may give up on it first), so it ends now, saying
    why. A group with no op in flight is left as it is (the next op on the default group fails)."""
    backends = registry.backends_of(pg)
    if not any(b.inflight_ops() for b in backends):
        return
    said = f"{what}; this rank's op on group {st.name!r} was ended so that it joins the job's recovery"
    detail = json.dumps({"rank": -1, "op": op, "seq": seq, "state": "told", "dead": said})
    for b in backends:
        b.fail_remote(detail, said)
