"""Timeout-bounded collectives.

Each wrapper takes the same arguments as its ``torch.distributed`` namesake plus ``timeout=``,
and either returns what torch returns or raises :class:`CollectiveTimeoutError` by the deadline.
The deadline is enforced twice: by fastdist's engine, which wakes the caller at the deadline,
and by the backend's own per-call timeout (set a little later), which frees gloo's worker thread
so that the dead group never holds a thread or blocks process exit for long.

With ``async_op=True`` a wrapper returns a :class:`Work` handle; its deadline was fixed when the
op was issued, and it is watched even if nobody waits on it.
"""

from __future__ import annotations

import copy
import datetime
import math
import threading
import time
import weakref
from typing import Any, Callable, NoReturn, Optional

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

from . import _checks, _core, _groups, _polled, _watched, diagnostics
from ._timeouts import DeadlineScope, TimeoutLike, current_time, effective_deadline, engine, run_timeout_handler
from ._work import COMPLETED, EXPIRED, PENDING, abandon, exit_process, wait_until, watch
from .errors import CollectiveTimeoutError, GroupAbortedError

__all__ = [
    "Work", "all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all", "all_to_all_single",
    "barrier", "batch_isend_irecv", "broadcast", "gather", "irecv", "isend", "recv", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "scatter", "send", "wait",
]

_world = dist.distributed_c10d._world
_monotonic = _core.monotonic

_BACKEND_TIMEOUT_MARKERS = diagnostics.BACKEND_TIMEOUT_MARKERS
_PEER_CLOSED_MARKERS = diagnostics.PEER_CLOSED_MARKERS


def backend_grace(budget: float) -> float:
    """How long after fastdist's deadline the backend's own timeout fires.

    fastdist's engine must see the deadline first, on every rank, so that each waiting rank
    raises CollectiveTimeoutError rather than the connection error a peer's backend timeout
    would cause; the grace absorbs the skew between ranks' deadlines. It is also the longest a
    dead group's worker thread stays busy after the deadline (and so the longest process exit
    can wait on it), hence the cap.
    """
    return min(1.0, max(0.1, 0.1 * budget))


# Options objects are copied by the backend when an op is issued, so one object per distinct
# (kind, backend timeout, fields) can be shared by every call. Timeouts are rounded up to 10 ms so
# that calls with the same timeout= share one; the cache is bounded.
_OPTIONS_STEP_MS = 10
# About 31 years: a longer per-call timeout overflows in the backend (gloo's milliseconds).
_BACKEND_TIMEOUT_MAX = 1e9
_options_cache: dict[tuple[Any, ...], Any] = {}


def _options(kind: type, deadline: float, now: float, fields: tuple[tuple[str, Any], ...] = ()) -> Any:
    """A ``kind`` (e.g. ``AllgatherOptions``) with ``fields`` set, whose timeout makes the backend
    give up ``backend_grace`` after ``deadline``; for no deadline, the group's own default."""
    if deadline == math.inf or deadline - now > _BACKEND_TIMEOUT_MAX:
        ms = -1  # beyond what the backend can represent: no backend timeout; the engine keeps the deadline
    else:
        budget = deadline - now
        grace = 0.1 * budget  # backend_grace(), inlined: this runs on every call
        grace = 0.1 if grace < 0.1 else (1.0 if grace > 1.0 else grace)
        ms = math.ceil((budget + grace) * (1000 / _OPTIONS_STEP_MS)) * _OPTIONS_STEP_MS
    key: Any = (kind, ms, fields)
    try:
        opts = _options_cache.get(key)
    except TypeError:  # an unhashable field (e.g. a premul-sum ReduceOp): no caching
        key, opts = None, None
    if opts is None:
        opts = kind()
        if ms >= 0:
            opts.timeout = datetime.timedelta(milliseconds=ms)
        for name, value in fields:
            setattr(opts, name, value)
        if key is not None and len(_options_cache) < 1024:
            _options_cache[key] = opts
    return opts


# ---------------------------------------------------------------------------------------------
# Errors


def _timeout_error(st: Any, op: str, seq: int, start: float, deadline: float, rep: Optional[diagnostics.Report], cause: Optional[str] = None) -> CollectiveTimeoutError:
    return CollectiveTimeoutError(
        op=op, seq=seq, rank=st.my_global_rank, world_size=st.size, group=st.name, timeout=deadline - start,
        elapsed=current_time() - start, missing_ranks=None if rep is None else rep.missing,
        desynced=None if rep is None else rep.desynced, last_seen=st.prev_op_of(seq), cause=cause,
    )


def _report_error(st: Any, op: str, seq: int, start: float, deadline: float, state: str, cause: Optional[str] = None) -> CollectiveTimeoutError:
    """The timeout error with the who-is-missing report (see diagnostics)."""
    return _timeout_error(st, op, seq, start, deadline, diagnostics.report(st, op, seq, state, deadline - start), cause)


def _timed_out(pg: Any, st: Any, op: str, seq: int, start: float, deadline: float, token: Any = None, cause: Optional[str] = None) -> CollectiveTimeoutError:
    """Marks the group dead and builds the report for a collective whose deadline passed."""
    _groups.mark_dead(pg, f"{op} #{seq} timed out on rank {st.my_global_rank}", abandoned=token)
    return _report_error(st, op, seq, start, deadline, "timed_out", cause)


def _backend_failed(pg: Any, st: Any, op: str, seq: int, start: float, deadline: float, exc: RuntimeError) -> BaseException:
    """The error to raise for a backend failure, or ``exc`` itself if it is not about the group."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if any(m in text for m in _BACKEND_TIMEOUT_MARKERS):
        # The backend's timeout beat the engine (possible on a loaded machine): same outcome.
        return _timed_out(pg, st, op, seq, start, deadline, cause=text)
    if not any(m in text for m in _PEER_CLOSED_MARKERS):
        return exc
    # A peer closed the group: it timed out first (then this is a timeout too, unless this rank
    # only arrived after that: a straggler), or it died.
    _groups.mark_dead(pg, f"a peer closed its connection during {op} #{seq}")
    # Ranks still inside the op report when their deadline passes: wait for them until ours.
    until = time.monotonic() + (deadline - current_time())
    rep = diagnostics.report(st, op, seq, "aborted", deadline - start, until=until)
    cause, why = diagnostics.peer_closed_verdict(rep, time.time() - (current_time() - start))
    if cause is not None:
        return _timeout_error(st, op, seq, start, deadline, rep, cause)
    reason = f"{why}; {op} #{seq} failed: {text}"
    st.dead_reason = reason
    return GroupAbortedError(op=op, group=st.name, rank=st.my_global_rank, reason=reason)


# ---------------------------------------------------------------------------------------------
# Issuing and waiting


def _run(
    op: str,
    group: Any,
    start: float,
    deadline: float,
    issue: Callable[[Any, Any], Any],
    kind: Optional[type],
    signature: Callable[[], str],
    async_op: bool = False,
    fields: tuple[tuple[str, Any], ...] = (),
) -> Any:
    """Issues one op through ``issue(pg, options)`` and waits for it until ``deadline`` (or
    returns a :class:`Work` for ``async_op``). Returns what ``issue``'s work produced, or None
    for a process that is not in the group."""
    # This is every collective's hot path: the common case (default group, alive, no checks,
    # gloo) is written out with as few Python calls as possible. Each microsecond here costs
    # several in a collective's latency when ranks share cores.
    pg = _world.default_pg if group is None else _groups.resolve(group)
    if pg is None:
        if group is None:
            _groups.resolve(None)  # raises: the default group is not initialized
        return None
    st = _groups._states.get(id(pg))
    if st is None or st.ref() is not pg:
        st = _groups.state_of(pg)
    if st.watched is not None:
        return _run_watched(op, pg, st, start, deadline, issue, kind, signature, async_op, fields)
    if st.dead_reason is not None:
        _groups.check_alive(st, op)
    seq = st.begin(op)
    if _checks._enabled and not _checks.verify(st, op, seq, f"{op}({signature()})", deadline):
        _fail(_timed_out(pg, st, op, seq, start, deadline, cause="while comparing signatures (FASTDIST_CHECK)"))
    now = _monotonic()
    if now >= deadline:
        # This rank skips the collective its peers will make, so the group is out of step.
        _fail(_timed_out(pg, st, op, seq, start, deadline, cause="the deadline had passed before the call"))
    work = issue(pg, None if kind is None else _options(kind, deadline, now, fields))
    if async_op:
        return Work(op, pg, st, seq, work, start, deadline)
    if st.polled:
        return _wait_polled(op, pg, st, seq, work, start, deadline)
    try:
        finished, token, has_future = wait_until(work, deadline)
    except BaseException:
        # Interrupted (Ctrl-C): the op is still in flight and this rank no longer in step.
        _groups.mark_dead(pg, f"{op} #{seq} was interrupted on rank {st.my_global_rank}")
        raise
    if finished:
        if has_future:
            try:
                work.wait()
            except RuntimeError as exc:
                _fail(_backend_failed(pg, st, op, seq, start, deadline, exc), exc)
        return work
    _fail(_timed_out(pg, st, op, seq, start, deadline, token=token))


def _run_watched(
    op: str,
    pg: Any,
    st: Any,
    start: float,
    deadline: float,
    issue: Callable[[Any, Any], Any],
    kind: Optional[type],
    signature: Callable[[], str],
    async_op: bool,
    fields: tuple[tuple[str, Any], ...],
) -> Any:
    """A watched group's op: the deadline, torch's op on the group, then the wait. The watched
    backend numbers the op, enforces the deadline, gives gloo its per-call timeout, and raises
    the typed error (with the report) from the wait; see fastdist._watch."""
    if _checks._enabled:
        # Checked calls are numbered apart from the backend's ops: a call refused for a mismatch
        # issues no op, on every rank.
        st.seq += 1
        if not _checks.verify(st, op, st.seq, f"{op}({signature()})", deadline):
            deadline = min(deadline, _monotonic())  # the backend reports the timeout, with the report
    me = _get_ident()
    owner = st.owner
    if owner is not None and owner != me and not async_op:
        _concurrent_use(st, op, owner, me)
    _watched.set_next_deadline(deadline)
    try:
        work = issue(pg, None if kind is None else _options(kind, math.inf, 0.0, fields))
    finally:
        _watched.clear_next_deadline()  # an issue that failed before reaching the backend
    if async_op:
        return WatchedHandle(op, work, deadline)
    st.owner = me
    try:
        work.wait()
    except BaseException:
        # The error's traceback holds this frame: it must not hold the op too (see _fail).
        work = None
        raise
    finally:
        st.owner = None
    return work


_get_ident = threading.get_ident


def _concurrent_use(st: Any, op: str, owner: int, me: int) -> NoReturn:
    # Two threads in blocking calls on one group at once interleave their ops differently on
    # each rank: gloo then pairs the wrong ops and the results are silently wrong (or the process
    # aborts). Collectives torch issues on its own threads (autograd, DDP, FSDP2) do not come here.
    names = {t.ident: t.name for t in threading.enumerate()}
    raise RuntimeError(
        f"{op} on group {st.name!r}: thread {names.get(me, me)!r} called it while thread {names.get(owner, owner)!r} "
        "is still in a blocking fastdist call on the same group; ops on one group must come from one thread at a "
        "time, in the same order on every rank (use one group per thread)"
    )


class WatchedHandle:
    """fastdist's handle for an op issued with ``async_op=True`` on a watched group: the op's
    deadline was fixed at issue, and the op is watched whether or not anyone waits. ``wait()``
    returns True once the op is done, or raises :class:`CollectiveTimeoutError` (or
    :class:`GroupAbortedError`) at that deadline; ``wait(timeout)`` waits at most ``timeout`` more
    seconds and raises a plain :class:`TimeoutError` if that ends first (the op is still watched)."""

    _fastdist_handle = True  # fastdist.wait() calls wait(timeout) on it
    __slots__ = ("op", "_work", "_deadline")

    def __init__(self, op: str, work: Any, deadline: float) -> None:
        self.op = op
        self._work = work
        self._deadline = deadline

    @property
    def deadline(self) -> float:
        """The op's absolute deadline on :func:`fastdist.current_time`'s clock."""
        return self._deadline

    def wait(self, timeout: TimeoutLike = None) -> bool:
        if timeout is None:
            return bool(self._work.wait())
        now = current_time()
        limit = min(self._deadline, effective_deadline(timeout, now))
        if limit >= self._deadline:
            return bool(self._work.wait())
        try:
            return bool(self._work.wait(datetime.timedelta(seconds=max(0.001, limit - now))))
        except RuntimeError as exc:
            if "timed out" not in str(exc):
                raise
        raise TimeoutError(
            f"wait() on {self.op} gave up after {limit - now:.3g} s; the op is still in flight "
            f"and its deadline is in {max(0.0, self._deadline - current_time()):.3g} s"
        )

    def is_completed(self) -> bool:
        """True once the op finished, successfully or not (its deadline passing included)."""
        return bool(self._work.is_completed())

    def exception(self) -> Optional[BaseException]:
        """The error the op ended with (a timeout included), or None; None while in flight."""
        if not self._work.is_completed():
            return None
        try:
            self._work.wait()
        except BaseException as exc:  # noqa: BLE001 - the op's own error, returned
            return exc
        return None

    def get_future(self) -> Any:
        return self._work.get_future()

    def _source_rank(self) -> int:
        return int(self._work._source_rank())

    def __repr__(self) -> str:
        state = "completed" if self._work.is_completed() else "pending"
        return f"<fastdist.WatchedHandle {self.op} {state}, deadline in {self._deadline - current_time():.3f} s>"


def _wait_polled(op: str, pg: Any, st: Any, seq: int, work: Any, start: float, deadline: float) -> Any:
    """The blocking wait on an NCCL-like backend: returns once the work completed on the device
    (its completion query, not a host-wide synchronize), or aborts the group at the deadline."""
    token = engine().add(deadline)
    try:
        finished = _polled.wait_polled(work, token)
    except BaseException:
        _groups.mark_dead(pg, f"{op} #{seq} was interrupted on rank {st.my_global_rank}")
        raise
    finally:
        token.cancel()
    if finished:
        try:
            work.wait()
        except RuntimeError as exc:
            _fail(_backend_failed(pg, st, op, seq, start, deadline, exc), exc)
        return work
    _fail(_expire_polled(pg, st, op, seq, start, deadline))


def _expire_polled(pg: Any, st: Any, op: str, seq: int, start: float, deadline: float) -> CollectiveTimeoutError:
    """At the deadline on an NCCL-like group: mark it dead, start aborting its communicators
    (in the background, bounded), and assemble the report meanwhile."""
    _groups.mark_dead(pg, f"{op} #{seq} timed out on rank {st.my_global_rank}")
    _polled.abort_group(pg, st.is_default, _timeout_error(st, op, seq, start, deadline, None, "aborting the communicators hung"))
    return _report_error(st, op, seq, start, deadline, "timed_out", "communicators aborted")


def _fail(err: BaseException, cause: Optional[BaseException] = None) -> NoReturn:
    """Runs the timeout handler for a timeout, then raises ``err``.

    No frame on the way up may keep the error in a local variable: the error's traceback refers
    to those frames, and the cycle would keep the failed call's locals (the dead group among
    them, with its threads and sockets) alive until the cyclic garbage collector happens to run.
    """
    try:
        if isinstance(err, CollectiveTimeoutError):
            run_timeout_handler(err)
        if err is cause:
            raise err
        raise err from cause
    finally:
        del err, cause


# Handles whose deadline passed wait here until its expiry ran (rare: one condition for all,
# rather than an Event per handle, which costs more than the rest of a handle).
_report_cond = threading.Condition()

# Point-to-point ops: on NCCL each peer has a stream of its own, so they finish in any order.
_P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})


class Work:
    """fastdist's handle for an op issued with ``async_op=True``.

    Its deadline was fixed when the op was issued. ``wait()`` returns True once the op is done,
    or raises :class:`CollectiveTimeoutError` at that deadline; ``wait(timeout)`` waits at most
    ``timeout`` more seconds and raises a plain :class:`TimeoutError` if that ends first (the op
    is then still in flight and still watched). A handle nobody waits on still times out: the
    group is marked dead and the timeout handler runs, on fastdist's own thread (a ``sys.exit``
    there ends the process with that code).
    """

    _fastdist_handle = True  # fastdist.wait() calls wait(timeout) on it

    def __init__(self, op: str, pg: Any, st: Any, seq: int, work: Any, start: float, deadline: float) -> None:
        self.op = op
        self._pg = pg
        self._st = st
        self._seq = seq
        self._work = work
        self._start = start
        self._deadline = deadline
        self._error: Optional[BaseException] = None
        self._reported = False  # the expiry ran (see _report_cond)
        self._polled = st.polled
        if st.polled:
            # The future says nothing about the device: the reaper polls the work instead.
            self._token = engine().add(deadline, self._on_expire)
            self._has_future, self._callback_ref = True, None
            _polled.reaper.watch(id(pg), work, self._token, ordered=op not in _P2P_OPS)
            return
        self._token, callback = watch(work, deadline, self._on_expire)
        self._has_future = callback is not None
        self._callback_ref = None if callback is None else weakref.ref(callback)
        del callback  # only torch may hold it (see _work.abandon)

    @property
    def deadline(self) -> float:
        """The op's absolute deadline on :func:`fastdist.current_time`'s clock."""
        return self._deadline

    def _on_expire(self) -> None:
        # Runs on the engine's executor thread at the deadline.
        if (self._polled or not self._has_future) and self._work.is_completed():
            self._set_reported()  # finished; only nobody was told (no future, or not polled yet)
            return
        try:
            if self._polled:
                self._error = _expire_polled(self._pg, self._st, self.op, self._seq, self._start, self._deadline)
            else:
                self._error = _timed_out(self._pg, self._st, self.op, self._seq, self._start, self._deadline, token=self._token)
                abandon(self._token, self._callback_ref)
        finally:
            self._set_reported()
        try:
            run_timeout_handler(self._error)
        except SystemExit as e:
            exit_process(e.code)
        except BaseException:
            pass  # the error is raised from wait(); the handler's own failure has nowhere to go

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
        return state == COMPLETED or bool(self._work.is_completed())

    def exception(self) -> Optional[BaseException]:
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
            self._error = _backend_failed(self._pg, self._st, self.op, self._seq, self._start, self._deadline, exc)
        return self._error

    def wait(self, timeout: TimeoutLike = None) -> bool:
        now = current_time()
        limit = self._deadline if timeout is None else min(self._deadline, effective_deadline(timeout, now))
        if self._polled:
            state = _polled.poll(self._work, self._token, max(0.0, limit - now))
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
        raise TimeoutError(
            f"wait() on {self.op} #{self._seq} gave up after {limit - now:.3g} s; the op is still in flight "
            f"and its deadline is in {max(0.0, self._deadline - current_time()):.3g} s"
        )

    @staticmethod
    def _raise(err: BaseException, cause: Optional[BaseException] = None) -> NoReturn:
        # A copy: the handle keeps the original, and a raised exception must not be reachable
        # from the frames in its own traceback (see _fail).
        raise copy.copy(err) from cause

    def _wait_p2p(self, limit: float) -> int:
        left = limit - current_time()
        try:
            if left > 0:
                self._work.wait(datetime.timedelta(seconds=min(left, 1e9)))
                self._token.complete()
        except RuntimeError as exc:
            if not any(m in str(exc) for m in _BACKEND_TIMEOUT_MARKERS):
                self._raise(self._failure(exc), exc)
        if self._work.is_completed() and self._token.state == PENDING:
            self._token.complete()
        state = self._token.state
        if state == PENDING and current_time() >= self._deadline:
            return self._token.wait()  # the expiry is due: let it run
        return state

    def __repr__(self) -> str:
        left = self._deadline - current_time()
        state = {COMPLETED: "completed", EXPIRED: "timed out", PENDING: "pending"}.get(self._token.state, "cancelled")
        return f"<fastdist.Work {self.op} #{self._seq} {state}, deadline in {left:.3f} s>"


def wait(work: Any, timeout: TimeoutLike = None) -> Any:
    """Bounds any torch ``Work`` or ``torch.futures.Future`` (or a fastdist :class:`Work`) by a
    deadline: returns the future's value (``True`` for a ``Work``), or raises
    :class:`CollectiveTimeoutError` with ``op="wait"``. The group of a raw torch ``Work`` is
    unknown, so it is not marked dead."""
    start = current_time()
    deadline = effective_deadline(timeout, start)
    if getattr(work, "_fastdist_handle", False):  # a fastdist Work or fastdist.rpc.RpcFuture
        return work.wait(DeadlineScope(deadline))
    if type(work) is torch.futures.Future and work.done():
        return work.wait()  # nothing to wait for: no deadline to set
    if not (hasattr(work, "wait") and (hasattr(work, "get_future") or hasattr(work, "add_done_callback"))):
        raise TypeError(f"work must be a torch Work or torch.futures.Future, got {type(work).__name__}")
    finished, _token, has_future = wait_until(work, deadline)
    if finished:
        return work.wait() if has_future else True  # a Future: its value (or its error, raised)
    _fail(CollectiveTimeoutError(
        op="wait", seq=None, rank=dist.get_rank() if dist.is_initialized() else -1,
        world_size=dist.get_world_size() if dist.is_initialized() else -1, group="?", timeout=deadline - start,
        elapsed=current_time() - start, missing_ranks=None, desynced=None, last_seen=None, cause=None,
    ))


# ---------------------------------------------------------------------------------------------
# Argument checks


def _check_bool(value: object, name: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}: {value!r}")


def _check_tensor(value: object, name: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_contiguous():
        _not_contiguous(name, value)


def _not_contiguous(name: str, value: torch.Tensor) -> NoReturn:
    # gloo reads and writes the tensor's storage as if it were contiguous: the result would be
    # silently wrong (torch does not check either).
    raise ValueError(f"{name} must be contiguous (gloo would silently use the wrong elements); got a tensor with "
                     f"shape {list(value.shape)} and strides {list(value.stride())}: pass {name}.contiguous()")


def _check_tensor_list(value: object, name: str) -> None:
    if not isinstance(value, list) or not all(isinstance(t, torch.Tensor) for t in value):
        raise TypeError(f"{name} must be a list of torch.Tensor, got {type(value).__name__}")
    for t in value:
        if not t.is_contiguous():
            _not_contiguous(name, t)


def _check_rank(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int rank, got {value!r}")


def _sig(*tensors: Any) -> str:
    parts = []
    for t in tensors:
        if isinstance(t, list):
            parts.append("[" + ", ".join(_sig(x) for x in t) + "]")
        elif isinstance(t, torch.Tensor):
            parts.append(f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}")
        else:
            parts.append(repr(t))
    return ", ".join(parts)


def _group_rank(pg: Any, global_rank: int, name: str) -> int:
    if not isinstance(pg, dist.ProcessGroup) or pg is dist.distributed_c10d._get_default_group():
        if global_rank >= pg.size():
            raise ValueError(f"{name}={global_rank} is not a rank of the group (size {pg.size()})")
        return global_rank
    try:
        return dist.get_group_rank(pg, global_rank)
    except (ValueError, RuntimeError):
        raise ValueError(f"{name}={global_rank} is not a rank of the group") from None


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


# ---------------------------------------------------------------------------------------------
# The collectives


def barrier(group: Any = None, *, timeout: TimeoutLike = None, raise_on_timeout: bool = True) -> bool:
    """Waits until every rank of ``group`` (default: the default group) called ``barrier``.

    Returns True once all arrived. At the deadline raises :class:`CollectiveTimeoutError` on
    every rank that waited, or returns False when ``raise_on_timeout=False``::

        if not fastdist.barrier(timeout=10, raise_on_timeout=False):
            ...  # someone is missing; the group is now aborted

    ``timeout``: seconds, a ``timedelta``, ``math.inf``, a :class:`RendezvousTimeout` or an open
    scope; ``None`` means :func:`get_default_timeout`. After a timeout the group is aborted and
    every later fastdist call on it raises :class:`GroupAbortedError` at once.
    """
    start = _monotonic()
    deadline = effective_deadline(timeout, start)
    if raise_on_timeout is not True and raise_on_timeout is not False:
        _check_bool(raise_on_timeout, "raise_on_timeout")
    try:
        _run("barrier", group, start, deadline, _issue_barrier, BarrierOptions, str)
    except CollectiveTimeoutError:
        if raise_on_timeout:
            raise
        return False
    return True


def _issue_barrier(pg: Any, opts: Any) -> Any:
    return pg.barrier(opts)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False, *, timeout: TimeoutLike = None) -> Optional[Work]:
    """``torch.distributed.all_gather`` with a deadline: fills ``tensor_list`` (one tensor per
    rank, in rank order) with every rank's ``tensor``, or raises
    :class:`CollectiveTimeoutError` at the deadline.

    After a timeout the tensors in ``tensor_list`` may still be written by the backend until
    its own timeout fires, :func:`backend_grace` later; do not reuse them before that.
    """
    start = _monotonic()
    deadline = effective_deadline(timeout, start)
    if not isinstance(tensor_list, list):
        _check_tensor_list(tensor_list, "tensor_list")
    if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
        _check_tensor(tensor, "tensor")
    if async_op is not False:
        _check_bool(async_op, "async_op")
    dtype = tensor.dtype
    for t in tensor_list:  # one pass: types (for the exact message), dtypes, layout
        if not isinstance(t, torch.Tensor):
            _check_tensor_list(tensor_list, "tensor_list")
        if not t.is_contiguous():
            _not_contiguous("tensor_list", t)
        if t.dtype != dtype:
            raise ValueError(f"tensor_list must hold tensors of tensor's dtype ({dtype}), got {t.dtype}")
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
        tensor_list = [torch.view_as_real(t) for t in tensor_list]

    def issue(pg: Any, opts: Any) -> Any:
        if len(tensor_list) != pg.size():
            raise ValueError(f"tensor_list must hold one tensor per rank of the group ({pg.size()}), got {len(tensor_list)}")
        return pg.allgather([tensor_list], [tensor], opts)

    work = _run("all_gather", group, start, deadline, issue, AllgatherOptions, lambda: _sig(tensor, tensor_list), async_op)
    return work if async_op else None


def _result(work: Any, async_op: bool) -> Optional[Work]:
    return work if async_op else None


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, *, timeout: TimeoutLike = None) -> Optional[Work]:
    """``torch.distributed.all_reduce`` with a deadline."""
    start = _monotonic()
    deadline = effective_deadline(timeout, start)
    if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
        _check_tensor(tensor, "tensor")
    if async_op is not False:
        _check_bool(async_op, "async_op")
    t = _real(tensor)

    def issue(pg: Any, opts: Any) -> Any:
        return pg.allreduce([t], opts)

    work = _run("all_reduce", group, start, deadline, issue, AllreduceOptions, lambda: f"{_sig(tensor)}, {op}", async_op, (("reduceOp", op),))
    return work if async_op else None


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, *, timeout: TimeoutLike = None) -> Optional[Work]:
    """``torch.distributed.reduce`` with a deadline (``dst`` is a global rank)."""
    start = current_time()
    deadline = effective_deadline(timeout, start)
    _check_tensor(tensor, "tensor")
    _check_rank(dst, "dst")
    _check_bool(async_op, "async_op")
    t = _real(tensor)

    def issue(pg: Any, opts: Any) -> Any:
        opts = _options(ReduceOptions, deadline, current_time(), (("reduceOp", op), ("rootRank", _group_rank(pg, dst, "dst")), ("rootTensor", 0)))
        return pg.reduce([t], opts)

    return _result(_run("reduce", group, start, deadline, issue, None, lambda: f"{_sig(tensor)}, dst={dst}, {op}", async_op), async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False, *, timeout: TimeoutLike = None) -> Optional[Work]:
    """``torch.distributed.broadcast`` with a deadline (``src`` is a global rank)."""
    start = current_time()
    deadline = effective_deadline(timeout, start)
    _check_tensor(tensor, "tensor")
    _check_rank(src, "src")
    _check_bool(async_op, "async_op")
    t = _real(tensor)

    def issue(pg: Any, opts: Any) -> Any:
        opts = _options(BroadcastOptions, deadline, current_time(), (("rootRank", _group_rank(pg, src, "src")), ("rootTensor", 0)))
        return pg.broadcast([t], opts)

    return _result(_run("broadcast", group, start, deadline, issue, None, lambda: f"{_sig(tensor)}, src={src}", async_op), async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None, async_op: bool = False, *, timeout: TimeoutLike = None) -> Optional[Work]:
    """``torch.distributed.all_gather_into_tensor`` with a deadline."""
    start = current_time()
    deadline = effective_deadline(timeout, start)
    _check_tensor(output_tensor, "output_tensor")
    _check_tensor(input_tensor, "input_tensor")
    _check_bool(async_op, "async_op")
    out, inp = _real(output_tensor), _real(input_tensor)

    def issue(pg: Any, opts: Any) -> Any:
        return pg._allgather_base(out, inp, opts)

    return _result(_run("all_gather_into_tensor", group, start, deadline, issue, AllgatherOptions, lambda: _sig(output_tensor, input_tensor), async_op), async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, *, timeout: TimeoutLike = None) -> Optional[Work]:
    """``torch.distributed.reduce_scatter`` with a deadline."""
    start = current_time()
    deadline = effective_deadline(timeout, start)
    _check_tensor(output, "output")
    _check_tensor_list(input_list, "input_list")
    _check_bool(async_op, "async_op")

    def issue(pg: Any, opts: Any) -> Any:
        return pg.reduce_scatter([output], [input_list], opts)

    return _result(_run("reduce_scatter", group, start, deadline, issue, ReduceScatterOptions, lambda: f"{_sig(output, input_list)}, {op}", async_op, (("reduceOp", op),)), async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, *, timeout: TimeoutLike = None) -> Optional[Work]:
    """``torch.distributed.reduce_scatter_tensor`` with a deadline."""
    start = current_time()
    deadline = effective_deadline(timeout, start)
    _check_tensor(output, "output")
    _check_tensor(input, "input")
    _check_bool(async_op, "async_op")

    def issue(pg: Any, opts: Any) -> Any:
        return pg._reduce_scatter_base(output, input, opts)

    return _result(_run("reduce_scatter_tensor", group, start, deadline, issue, ReduceScatterOptions, lambda: f"{_sig(output, input)}, {op}", async_op, (("reduceOp", op),)), async_op)


def gather(tensor: torch.Tensor, gather_list: Optional[list[torch.Tensor]] = None, dst: int = 0, group: Any = None, async_op: bool = False, *, timeout: TimeoutLike = None) -> Optional[Work]:
    """``torch.distributed.gather`` with a deadline (``dst`` is a global rank; ``gather_list``
    only on ``dst``)."""
    return _rooted("gather", GatherOptions, tensor, gather_list, dst, ("dst", "gather_list"), group, async_op, timeout,
                   lambda pg, t, lst, opts: pg.gather(lst, [t], opts))


def scatter(tensor: torch.Tensor, scatter_list: Optional[list[torch.Tensor]] = None, src: int = 0, group: Any = None, async_op: bool = False, *, timeout: TimeoutLike = None) -> Optional[Work]:
    """``torch.distributed.scatter`` with a deadline (``src`` is a global rank;
    ``scatter_list`` only on ``src``)."""
    return _rooted("scatter", ScatterOptions, tensor, scatter_list, src, ("src", "scatter_list"), group, async_op, timeout,
                   lambda pg, t, lst, opts: pg.scatter([t], lst, opts))


def _rooted(
    op: str,
    kind: type,
    tensor: torch.Tensor,
    tensors: Optional[list[torch.Tensor]],
    root: int,
    names: tuple[str, str],
    group: Any,
    async_op: bool,
    timeout: TimeoutLike,
    call: Callable[[Any, torch.Tensor, list[list[torch.Tensor]], Any], Any],
) -> Optional[Work]:
    """gather and scatter: one tensor per rank in a list that only the root rank gives."""
    start = current_time()
    deadline = effective_deadline(timeout, start)
    root_name, list_name = names
    _check_tensor(tensor, "tensor")
    _check_rank(root, root_name)
    if tensors is not None:
        _check_tensor_list(tensors, list_name)
    _check_bool(async_op, "async_op")

    def issue(pg: Any, _opts: Any) -> Any:
        root_rank = _group_rank(pg, root, root_name)
        opts = _options(kind, deadline, current_time(), (("rootRank", root_rank),))
        if pg.rank() != root_rank:
            return call(pg, tensor, [], opts)
        if tensors is None or len(tensors) != pg.size():
            raise ValueError(f"{list_name} must hold one tensor per rank of the group ({pg.size()}) on {root_name}")
        return call(pg, tensor, [tensors], opts)

    return _result(_run(op, group, start, deadline, issue, None, lambda: f"{_sig(tensor)}, {root_name}={root}", async_op), async_op)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor], group: Any = None, async_op: bool = False, *, timeout: TimeoutLike = None) -> Optional[Work]:
    """``torch.distributed.all_to_all`` with a deadline."""
    start = current_time()
    deadline = effective_deadline(timeout, start)
    _check_tensor_list(output_tensor_list, "output_tensor_list")
    _check_tensor_list(input_tensor_list, "input_tensor_list")
    _check_bool(async_op, "async_op")

    def issue(pg: Any, opts: Any) -> Any:
        return pg.alltoall(output_tensor_list, input_tensor_list, opts)

    return _result(_run("all_to_all", group, start, deadline, issue, AllToAllOptions, lambda: _sig(output_tensor_list, input_tensor_list), async_op), async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Optional[list[int]] = None, input_split_sizes: Optional[list[int]] = None, group: Any = None, async_op: bool = False, *, timeout: TimeoutLike = None) -> Optional[Work]:
    """``torch.distributed.all_to_all_single`` with a deadline."""
    start = current_time()
    deadline = effective_deadline(timeout, start)
    _check_tensor(output, "output")
    _check_tensor(input, "input")
    _check_bool(async_op, "async_op")
    out_splits = list(output_split_sizes or [])
    in_splits = list(input_split_sizes or [])

    def issue(pg: Any, opts: Any) -> Any:
        return pg.alltoall_base(_real(output), _real(input), out_splits, in_splits, opts)

    return _result(_run("all_to_all_single", group, start, deadline, issue, AllToAllOptions, lambda: f"{_sig(output, input)}, {out_splits}, {in_splits}", async_op), async_op)


# ---------------------------------------------------------------------------------------------
# Point to point. gloo's send/recv take no per-call timeout and have no future: they are waited
# on with torch's own bounded wait, and a timed-out one leaves the group dead.


def _p2p(op: str, tensor: torch.Tensor, peer: Optional[int], group: Any, tag: int, timeout: TimeoutLike, async_op: bool) -> Any:
    start = current_time()
    deadline = effective_deadline(timeout, start)
    _check_tensor(tensor, "tensor")
    name = "dst" if op in ("send", "isend") else "src"
    if peer is not None or name == "dst":
        _check_rank(peer, name)
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise TypeError(f"tag must be an int, got {type(tag).__name__}: {tag!r}")
    t = _real(tensor)
    sender: list[Any] = []

    def issue(pg: Any, _opts: Any) -> Any:
        if op in ("send", "isend"):
            assert peer is not None  # checked above
            return pg.send([t], _group_rank(pg, peer, name), tag)
        if peer is None:
            w = pg.recv_anysource([t], tag)
            sender.append(w)
            return w
        return pg.recv([t], _group_rank(pg, peer, name), tag)

    work = _run(op, group, start, deadline, issue, None, lambda: f"{_sig(tensor)}, {name}={peer}, tag={tag}", async_op)
    if async_op or work is None:
        return work
    if op == "recv":
        if sender:
            pg = _groups.resolve(group)
            src_group_rank = sender[0]._source_rank()
            st = _groups.state_of(pg)
            return st.global_rank(src_group_rank)
        return peer
    return None


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, *, timeout: TimeoutLike = None) -> None:
    """``torch.distributed.send`` with a deadline."""
    _p2p("send", tensor, dst, group, tag, timeout, False)


def recv(tensor: torch.Tensor, src: Optional[int] = None, group: Any = None, tag: int = 0, *, timeout: TimeoutLike = None) -> int:
    """``torch.distributed.recv`` with a deadline; returns the sender's rank."""
    return int(_p2p("recv", tensor, src, group, tag, timeout, False))


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, *, timeout: TimeoutLike = None) -> Work:
    """``torch.distributed.isend`` with a deadline; returns a :class:`Work`."""
    return _p2p("isend", tensor, dst, group, tag, timeout, True)  # type: ignore[no-any-return]


def irecv(tensor: torch.Tensor, src: Optional[int] = None, group: Any = None, tag: int = 0, *, timeout: TimeoutLike = None) -> Work:
    """``torch.distributed.irecv`` with a deadline; returns a :class:`Work`."""
    return _p2p("irecv", tensor, src, group, tag, timeout, True)  # type: ignore[no-any-return]


def batch_isend_irecv(p2p_op_list: list[Any], *, timeout: TimeoutLike = None) -> list[Work]:
    """``torch.distributed.batch_isend_irecv`` with one deadline for the whole batch: takes
    ``torch.distributed.P2POp`` objects (whose ``op`` is ``isend``/``irecv`` from torch or
    fastdist) and returns one :class:`Work` per op."""
    if not isinstance(p2p_op_list, list) or not all(isinstance(p, dist.P2POp) for p in p2p_op_list):
        raise TypeError("p2p_op_list must be a list of torch.distributed.P2POp")
    start = current_time()
    deadline = effective_deadline(timeout, start)
    scope = DeadlineScope(deadline)
    works = []
    for p in p2p_op_list:
        fn = getattr(p.op, "__name__", "")
        if fn not in ("isend", "irecv"):
            raise ValueError(f"P2POp.op must be isend or irecv, got {p.op!r}")
        peer = getattr(p, "group_peer", None) if getattr(p, "peer", None) is None else p.peer
        works.append(_p2p(fn, p.tensor, peer, p.group, p.tag, scope, True))
    return works

