"""Watched groups: every op on a group made by (or after) ``fastdist.init_process_group`` has a
deadline, whoever issues it.

torch builds each process group as usual; when it registers the group's backend (gloo or NCCL)
in the ProcessGroup, fastdist registers a ``fastdist._watched.WatchedBackend`` wrapping it instead
(``ProcessGroup._register_backend`` is the one place every group passes through: the default
group, ``new_group``, ``split_group``, DeviceMesh). The ProcessGroup stays torch's own, with its
name and backend type, so DDP, FSDP2 and DeviceMesh take their usual paths; recovery swaps the
wrapped backend in place, so the objects holding the group train on.

The C++ side numbers and watches every op; when one expires or fails, it asks :func:`_build` here,
once per fault, for the exception every waiter of the group raises: the who-is-missing report
(fastdist.diagnostics.board) made into a :class:`CollectiveTimeoutError` or :class:`GroupAbortedError`.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from torch._C._distributed_c10d import ProcessGroup

from .._native import _core, _watched
from ..deadlines import current_time, get_default_timeout, run_timeout_handler
from ..diagnostics import board, dump, events, ring, verdict
from ..errors import CollectiveTimeoutError, GroupAbortedError, remember
from ..groups import checks, pgstate, registry
from ..groups.opcall import OpCall
from . import expiry, polled
from .work import run_handler_unwaited

if TYPE_CHECKING:
    from ..groups.pgstate import GroupState

logger = logging.getLogger(__name__)

WatchedBackend = _watched.WatchedBackend
# What kind of fault an op met, as the C++ side says it.
Kind = _watched.FaultKind

_lock = threading.Lock()
_active = False
# The group timeout the user gave fastdist.init_process_group (seconds), or None.
_user_timeout: float | None = None
# Whether Ctrl-C ended an op of this process (the exit then does not wait for it to end in gloo).
_interrupted = False

_orig_register_backend = ProcessGroup._register_backend


def _register_backend(pg: Any, device: Any, backend_type: Any, backend: Any) -> Any:
    if _active and not isinstance(backend, WatchedBackend) and _watches(backend_type, backend):
        backend = _wrap(pg, device, backend_type, backend)
        if backend_type == ProcessGroup.BackendType.GLOO:
            # torch's C++ casts the backend registered as GLOO to ProcessGroupGloo (DDP's logger
            # reads its thread count): a wrapper registered so would be read as one. Registered as
            # CUSTOM, torch takes its generic path; torch.distributed.get_backend(pg) still says
            # "gloo" (it reads its own records), and the object collectives pick the CPU as before.
            if pg._get_backend_name() == "gloo":
                pg._set_default_backend(ProcessGroup.BackendType.CUSTOM)
            backend_type = ProcessGroup.BackendType.CUSTOM
    return _orig_register_backend(pg, device, backend_type, backend)


def _watches(backend_type: Any, backend: Any) -> bool:
    """gloo and NCCL backends are watched, and a custom one of a polled kind (NCCL's CPU double:
    pgstate.POLLED_BACKENDS names them)."""
    return backend_type in _WATCHED_TYPES or backend.name() in pgstate.POLLED_BACKENDS


_WATCHED_TYPES = {ProcessGroup.BackendType.GLOO}
if hasattr(ProcessGroup.BackendType, "NCCL"):
    _WATCHED_TYPES.add(ProcessGroup.BackendType.NCCL)

_wrapped: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()


def _wrap(pg: Any, device: Any, backend_type: Any, backend: Any) -> Any:
    # A backend registered for several devices ("gloo" for cpu and cuda) gets one wrapper.
    per_pg = _wrapped.setdefault(pg, {})
    existing = per_pg.get(id(backend))
    if existing is not None:
        return existing
    timeout = get_default_timeout()
    if _user_timeout is not None:
        options = getattr(backend, "options", None)
        group_timeout = getattr(options, "timeout", None) or getattr(options, "_timeout", None)
        timeout = group_timeout.total_seconds() if group_timeout is not None else _user_timeout
    # NCCL completes a work's future at enqueue: its works are polled (work.is_completed(), the
    # end event's query), and so are those of its CPU double (fastdist._watched.NcclDouble, which
    # follows ProcessGroupNCCL's contract: tests/fake_nccl.py). FASTDIST_TEST_POLLED=1 watches
    # gloo groups the same way.
    is_polled = backend_type != ProcessGroup.BackendType.GLOO or os.environ.get("FASTDIST_TEST_POLLED") == "1"
    wrapper = WatchedBackend(backend, "", float(timeout), is_polled)
    per_pg[id(backend)] = wrapper
    registry.add(wrapper.ctl_id, pg, device)
    _arm_later(pg)
    return wrapper


# Groups whose state is made (and with it the report C++ makes when Python cannot run, see
# fastdist.groups.native_report.arm) once torch has finished making them: torch registers a
# group's backend before it records the group's ranks, and the state needs those.
_unarmed: list[weakref.ref[Any]] = []
_armer: threading.Thread | None = None
_ARM_POLL = 0.02
_ARM_GIVE_UP = 5.0


def _arm_later(pg: Any) -> None:
    global _armer
    with _lock:
        _unarmed.append(weakref.ref(pg))
        if _armer is None or not _armer.is_alive():
            _armer = threading.Thread(target=_arm_pending, name="fastdist-arm", daemon=True)
            _armer.start()


def _arm_pending() -> None:
    since: dict[int, float] = {}
    while True:
        time.sleep(_ARM_POLL)
        with _lock:
            pending = list(_unarmed)
        if not pending:
            with _lock:
                if not _unarmed:
                    return
            continue
        done = []
        for ref in pending:
            pg = ref()
            if pg is None:
                done.append(ref)
            elif pg in pgstate.known_groups():
                pgstate.state_of(pg)  # its making arms it (groups.native_report)
                done.append(ref)
            elif time.monotonic() - since.setdefault(id(ref), time.monotonic()) > _ARM_GIVE_UP:
                done.append(ref)  # a backend made outside a torch group: nothing to arm
        with _lock:
            for ref in done:
                _unarmed.remove(ref)


def activate(user_timeout: float | None) -> None:
    """Watches every group made from now on (called by fastdist.init_process_group)."""
    global _active, _user_timeout
    with _lock:
        _user_timeout = user_timeout
        if _active:
            return
        _watched.set_engine(_core._engine_capsule())
        _watched.set_fault_builder(_build)
        _watched.set_check_hook(_check)
        _watched.set_main_thread(threading.main_thread().ident or 0)
        _watched.install_sigint_hook()
        ProcessGroup._register_backend = _register_backend  # type: ignore[method-assign,assignment]
        _active = True


# ---------------------------------------------------------------------------------------------
# Building the error for a fault (called from C++, with the GIL, once per fault)


def _build(ctl_id: int, info: dict[str, Any]) -> BaseException:
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


def _check(ctl_id: int, op: str, signature: str, deadline: float) -> bool:
    """The cross-rank check of an op torch issues on a watched group (FASTDIST_CHECK=1), called
    from C++ before the op is issued: False when the deadline passed first; raises
    CollectiveMismatchError on a mismatch (on every rank: none of them issues the op)."""
    pg = registry.group_of(ctl_id)
    if pg is None:
        return True
    st = pgstate.state_of(pg)
    st.checks_seq += 1  # numbered apart from the backend's ops, as fastdist's own checked calls are
    return checks.verify(st, op, st.checks_seq, f"{op}({signature})", deadline)


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
        return GroupAbortedError(op=op, group=st.name, rank=st.my_global_rank, reason=reason)
    start = float(info["start"])
    deadline = float(info["deadline"])
    call = OpCall(op, pg, st, seq, start, deadline, info["prev"] or None)
    if kind == Kind.INTERRUPTED:
        global _interrupted
        _interrupted = True
        reason = f"an op was interrupted (Ctrl-C) on rank {st.my_global_rank}"
        pgstate.mark_dead(pg, reason)
        # The peers in the op would otherwise wait for it until their deadline, and then blame a
        # timeout: ring them (bounded, so that the KeyboardInterrupt is not held up).
        board.announce(st, op, seq, "interrupted")
        # Ctrl-C: every op in flight on the group ends, wherever torch waits for it (DDP's backward
        # included), and the group is dead. The KeyboardInterrupt itself is Python's: its handler
        # runs as soon as the main thread is back in Python, a moment later (raising one here too
        # would give two).
        return GroupAbortedError(op=op, group=st.name, rank=st.my_global_rank, reason=reason)
    if kind == Kind.REMOTE:
        return _remote_fault(call, info)
    text = verdict.first_line(info["detail"] or "")
    said = verdict.classify(text)
    if kind == Kind.TIMEOUT or said == verdict.TIMEOUT:
        cause = None if (not text or deadline <= start) else text  # an expired deadline says so itself
        late = _gil_held(info, deadline) if info.get("native") else None
        err: BaseException = expiry.timed_out(call, cause, late=late)
        _run_handler(err, info["waiter"])
        return err
    if said == verdict.PEER_CLOSED:
        err = verdict.peer_closed(call, text)
        if isinstance(err, CollectiveTimeoutError):
            _run_handler(err, info["waiter"])
        return err
    reason = f"{op} #{seq} failed on rank {st.my_global_rank}: {text or 'backend error'}"
    pgstate.mark_dead(pg, reason)
    return GroupAbortedError(op=op, group=st.name, rank=st.my_global_rank, reason=reason)


def _remote_fault(call: OpCall, info: dict[str, Any]) -> BaseException:
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
    if peer.get("state") == "dead" and isinstance(peer.get("dead"), str):
        return _aborted(pg, st, op, f"{peer['dead']}: fastdist run's record")  # (the launcher's notice)
    if isinstance(peer.get("dead"), str):
        return _aborted(pg, st, op, f"{peer['dead']} (seen by {who} in {what})")
    if peer.get("state") == "aborted":
        # The ringer's op failed under it (a peer closed the group): not a timeout of its own. It
        # rang before it knew who closed it; the report it collects says (a dead rank never posts).
        rep = board.report(
            st, op, seq, "aborted", deadline - start if math.isfinite(deadline) else 1.0, rung=True
        )
        cause, why = board.peer_closed_verdict(rep, began)
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
        err = expiry.timed_out(call, f"{who} timed out first{ring.gil_note(peer)}", rung_by=who)
        _run_handler(err, info["waiter"])
        return err
    verb = "timed out in" if peer.get("state") == "timed_out" else "failed in"
    return _aborted(
        pg,
        st,
        op,
        f"{who} {verb} {what}{ring.gil_note(peer)} and aborted group {st.name!r} "
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
        GroupAbortedError(
            op=op, group=st.name, rank=st.my_global_rank, reason=reason + "; aborting the communicators hung"
        ),
    )
    return GroupAbortedError(op=op, group=st.name, rank=st.my_global_rank, reason=reason)


def _die(pg: Any, st: GroupState, reason: str, if_abort_hangs: BaseException) -> None:
    """Marks the group dead and, on NCCL, starts aborting its communicators (in the background,
    bounded: ``if_abort_hangs`` goes to the timeout handler when the abort does not return)."""
    pgstate.mark_dead(pg, reason)
    if st.polled:
        polled.abort_group(pg, st.is_default, if_abort_hangs)


def _run_handler(err: BaseException, waiter: bool) -> None:
    if waiter:
        run_timeout_handler(err)  # whatever it raises propagates in the waiting thread
    else:
        run_handler_unwaited(err)


def active() -> bool:
    """Whether groups are watched (fastdist.init_process_group ran)."""
    return _active


def interrupted() -> bool:
    """Whether Ctrl-C ended an op of this process."""
    return _interrupted


def drain_inflight(end: float) -> None:
    """At exit: waits until ``end`` (time.monotonic()) for the watched ops abandoned at their
    deadline to end in the backend, which calls back into fastdist then (gloo: at its own
    timeout, shortly after the deadline); that must happen while Python still runs."""
    while _watched.abandoned_inflight() > 0 and time.monotonic() < end:
        time.sleep(0.002)


def keep_dead_backends() -> None:
    """At exit: a dead group's backend may still be inside an op (after Ctrl-C, one that waits for
    a peer until gloo's own timeout): its destructor would join that thread, and exit would wait.
    They are kept, never destroyed."""
    _watched.keep_dead_backends()
