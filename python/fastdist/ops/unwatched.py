"""Groups fastdist does not watch: ones made by plain ``torch.distributed`` (before or without
``fastdist.init_process_group``), raw backends built by hand, and Python backends (the NCCL test
double). Only fastdist's own functions are bounded on them.

How such a group's work is waited on is fixed when fastdist first sees the group
(``GroupState.polled``): NCCL-like backends, whose futures complete at enqueue, are polled for
completion (fastdist.ops.polled) and aborted at the deadline; others are waited on through their
future's done-callback, or, for work with no future (gloo send/recv), with torch's own bounded
wait (fastdist.ops.work). On a watched group the C++ backend does all of this (fastdist.ops.watching).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
import weakref
from typing import Any, Callable, NoReturn

from ..deadlines import TimeoutLike, current_time, effective_deadline, engine
from ..diagnostics import events, verdict
from ..errors import CollectiveTimeoutError, GroupAbortedError
from ..groups import checks, pgstate
from ..groups.opcall import OpCall
from . import fault, polled
from .work import (
    COMPLETED,
    EXPIRED,
    PENDING,
    Work,
    abandon,
    backend_options,
    fail,
    run_handler_unwaited,
    wait_posted,
    wait_until,
    watch,
)

_monotonic = time.monotonic


def run(
    op: str,
    pg: Any,
    st: pgstate.GroupState,
    start: float,
    deadline: float,
    issue: Callable[..., Any],
    args: tuple[Any, ...],
    kind: type | None,
    signature: Callable[..., str],
    async_op: bool,
    fields: tuple[tuple[str, Any], ...],
) -> Any:
    """Issues one op on an unwatched group and waits for it until ``deadline`` (or returns an
    :class:`UnwatchedWork` for ``async_op``)."""
    if st.dead_reason is not None:
        pgstate.check_alive(st, op)
    seq = st.begin(op)
    call = OpCall(op, pg, st, seq, start, deadline)
    if checks.active and not checks.verify(st, op, seq, f"{op}({signature(*args)})", deadline):
        fail(_timed_out(call, cause="while comparing signatures (FASTDIST_CHECK)"))
    now = _monotonic()
    if now >= deadline:
        # This rank skips the collective its peers will make, so the group is out of step.
        fail(_timed_out(call, cause="the deadline had passed before the call"))
    work = issue(pg, None if kind is None else backend_options(kind, deadline, now, fields), *args)
    if async_op:
        return UnwatchedWork(call, work)
    if st.polled:
        return _wait_polled(call, work)
    try:
        finished, token, has_future = wait_until(work, deadline)
    except BaseException:
        # Interrupted (Ctrl-C): the op is still in flight and this rank no longer in step.
        pgstate.mark_dead(pg, f"{call.name} was interrupted on rank {st.my_global_rank}")
        raise
    if finished:
        return _finished(call, work) if has_future else work
    fail(_timed_out(call, token=token))


def _finished(call: OpCall, work: Any) -> Any:
    """``work``, which ended: raises its backend error, made into fastdist's, if it failed."""
    try:
        work.wait()
    except RuntimeError as exc:
        fail(_backend_failed(call, exc), exc)
    return work


def _with_last_seen(call: OpCall) -> OpCall:
    return dataclasses.replace(call, last_seen=call.st.prev_op_of(call.seq))


def _timed_out(call: OpCall, token: Any = None, cause: str | None = None) -> CollectiveTimeoutError:
    """The error for a collective whose deadline passed (fastdist.ops.fault), counted."""
    return _counted(fault.timed_out(_with_last_seen(call), cause, abandoned=token), call.st)


def _counted(err: CollectiveTimeoutError, st: pgstate.GroupState) -> CollectiveTimeoutError:
    """``err``, its event counted (fastdist.diagnostics.events)."""
    events.fault(st, err)
    return err


def _backend_failed(call: OpCall, exc: RuntimeError) -> BaseException:
    """The error to raise for a backend failure, or ``exc`` itself if it is not about the group."""
    text = verdict.first_line(exc)
    said = verdict.classify(text)
    if said == verdict.TIMEOUT:
        # The backend's timeout beat the engine (possible on a loaded machine): same outcome.
        return _timed_out(call, cause=text)
    if said == verdict.PEER_CLOSED:
        return verdict.peer_closed(_with_last_seen(call), text)
    return exc


def _wait_polled(call: OpCall, work: Any) -> Any:
    """The blocking wait on an NCCL-like backend: returns once the work completed on the device
    (its completion query, not a host-wide synchronize), or aborts the group at the deadline."""
    token = engine().add(call.deadline)
    try:
        finished = polled.wait_polled(work, token)
    except BaseException:
        pgstate.mark_dead(call.pg, f"{call.name} was interrupted on rank {call.st.my_global_rank}")
        raise
    finally:
        token.cancel()
    if finished:
        return _finished(call, work)
    fail(_timed_out(call, cause="communicators aborted"))  # aborted in fastdist.ops.fault


# Handles whose deadline passed wait here until its expiry ran (rare: one condition for all,
# rather than an Event per handle, which costs more than the rest of a handle).
_report_cond = threading.Condition()

# Point-to-point ops: on NCCL each peer has a stream of its own, so they finish in any order.
_P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})


class UnwatchedWork(Work):
    """The :class:`fastdist.Work` of an op on an unwatched group: an engine token expires it at
    the deadline (marking the group dead and building the report on the engine's executor)."""

    def __init__(self, call: OpCall, work: Any) -> None:
        op, pg, st, deadline = call.op, call.pg, call.st, call.deadline
        self.op = op
        self._call = call
        self._pg = pg
        self._st = st
        self._seq = call.seq
        self._work = work
        self._deadline = deadline
        self._error: BaseException | None = None
        self._reported = False  # the expiry ran (see _report_cond)
        self._polled = st.polled
        if st.polled:
            # The future says nothing about the device: the reaper polls the work instead.
            self._token = engine().add(deadline, self._on_expire)
            self._has_future, self._callback_ref = True, None
            polled.reaper.watch(id(pg), work, self._token, ordered=op not in _P2P_OPS)
            return
        self._token, callback = watch(work, deadline, self._on_expire)
        self._has_future = callback is not None
        self._callback_ref = None if callback is None else weakref.ref(callback)
        del callback  # only torch may hold it (see fastdist.ops.work.abandon)

    @property
    def deadline(self) -> float:
        """The op's absolute deadline on :func:`fastdist.current_time`'s clock."""
        return self._deadline

    def _on_expire(self) -> None:
        # Runs on the engine's executor thread at the deadline. Whatever fails in here, the handle
        # ends failed and the group dead: a waiter must never wait for a report that never comes.
        try:
            if (self._polled or not self._has_future) and self._work.is_completed():
                return  # finished; only nobody was told (no future, or not polled yet)
            if self._polled:  # its communicators are aborted (fastdist.ops.fault)
                self._error = _timed_out(self._call, cause="communicators aborted")
            else:
                self._error = _timed_out(self._call, token=self._token)
                abandon(self._token, self._callback_ref)
        except BaseException as exc:  # noqa: BLE001 - made into the handle's error
            reason = (
                f"{self.op} #{self._seq} timed out on rank {self._st.my_global_rank} "
                f"(its report failed: {exc!r})"
            )
            pgstate.mark_dead(self._pg, reason)
            self._error = GroupAbortedError(
                op=self.op, group=self._st.name, rank=self._st.my_global_rank, reason=reason
            )
        finally:
            self._set_reported()
        if isinstance(self._error, CollectiveTimeoutError):
            run_handler_unwaited(self._error)

    def _set_reported(self) -> None:
        with _report_cond:
            self._reported = True
            _report_cond.notify_all()

    def _wait_reported(self) -> None:
        with _report_cond:
            while not self._reported:
                _report_cond.wait()

    def is_completed(self) -> bool:
        """True once the op finished (successfully or not) or its deadline passed."""
        state = self._token.state
        if state == EXPIRED:
            return self._reported
        if state == COMPLETED:
            return True
        try:
            return bool(self._work.is_completed())
        except RuntimeError:
            return True  # the backend failed it: exception() and wait() say how

    def exception(self) -> BaseException | None:
        """The error the op ended with (a timeout included), or None."""
        if self._token.state == EXPIRED:
            self._wait_reported()
            return self._error
        if self._has_future and self._work.is_completed():
            try:
                self._work.wait()
            except RuntimeError as exc:
                return self._failure(exc)
        return None

    def _failure(self, exc: RuntimeError) -> BaseException:
        if self._error is None:
            self._error = _backend_failed(self._call, exc)
        return self._error

    def wait(self, timeout: TimeoutLike = None) -> bool:
        now = current_time()
        limit = self._deadline if timeout is None else min(self._deadline, effective_deadline(timeout, now))
        if self._polled:
            state = polled.poll(self._work, self._token, max(0.0, limit - now))
        elif self._has_future:
            state = self._token.wait(max(0.0, limit - now))
        else:
            state = self._wait_p2p(limit)
        if state == COMPLETED:
            try:
                if self._has_future:  # (gloo send/recv: _wait_p2p already waited; see wait_until)
                    self._work.wait()
            except RuntimeError as exc:
                self._raise(self._failure(exc), exc)
            return True
        if state == EXPIRED:
            self._wait_reported()
            if self._error is None:
                return True  # p2p work that had finished unnoticed
            self._raise(self._error)
        raise self._gave_up(self._seq, limit - now)

    @staticmethod
    def _raise(err: BaseException, cause: BaseException | None = None) -> NoReturn:
        # A copy: the handle keeps the original, and a raised exception must not be reachable
        # from the frames in its own traceback (see fastdist.ops.work.fail).
        raise copy.copy(err) from cause

    def _wait_p2p(self, limit: float) -> int:
        try:
            if wait_posted(self._work, limit) and self._token.state == PENDING:
                self._token.complete()
        except RuntimeError as exc:
            self._raise(self._failure(exc), exc)
        state = self._token.state
        if state == PENDING and current_time() >= self._deadline:
            return self._token.wait()  # the expiry is due: let it run
        return state

    def __repr__(self) -> str:
        left = self._deadline - current_time()
        state = {COMPLETED: "completed", EXPIRED: "timed out", PENDING: "pending"}.get(
            self._token.state, "cancelled"
        )
        return f"<fastdist.Work {self.op} #{self._seq} {state}, deadline in {left:.3f} s>"
