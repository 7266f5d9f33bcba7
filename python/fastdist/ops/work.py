"""Waiting on torch work with a deadline.

A torch ``Work`` (or ``torch.futures.Future``) is tied to an engine token: the future's
done-callback is the token's notifier (a small C++ object), so a waiter blocked in C++ (GIL
released) wakes the moment the work ends, without polling, or when the engine expires the token
at the deadline. gloo's point-to-point work has no future; it is waited on with torch's own
GIL-free bounded wait. (NCCL's futures complete at enqueue time: the watched backend polls its works.)

Work abandoned at its deadline is still in flight, and its done-callback is Python code that
torch will run on a backend thread when the work finally ends. If that happened during
interpreter finalization the process would abort, so an exit hook gives abandoned work a bounded
time to end first (for gloo it ends by itself shortly after the deadline, see ``backend_options``).
fastdist's handle for ``async_op=True`` is :class:`Work` (below); the per-call options that give
the backend its own timeout are built by :func:`backend_options`.
"""

from __future__ import annotations

import abc
import datetime
import logging
import math
import threading
import time
import weakref
from typing import Any, Callable, NoReturn

from .._native import _core, _watched
from ..deadlines import current_time, engine, exit_process, run_timeout_handler
from ..diagnostics import verdict
from ..errors import CollectiveTimeoutError

logger = logging.getLogger(__name__)

COMPLETED = _core.COMPLETED
EXPIRED = _core.EXPIRED
PENDING = _core.PENDING

_abandoned: list[Callable[[], Any]] = []  # weak references to abandoned done-callbacks
_abandoned_lock = threading.Lock()


def future_of(work: Any) -> Any | None:
    """The ``torch.futures.Future`` behind ``work`` (a ``Work`` or already a ``Future``), or
    ``None`` for work that has none (gloo send/recv)."""
    get_future = getattr(work, "get_future", None)
    if get_future is None:
        return work
    try:
        return get_future()
    except RuntimeError:  # "Work::getFuture not implemented"
        return None


def watch(
    work: Any, deadline: float, on_expire: Callable[[], None] | None = None
) -> tuple[_core.Token, _core.Notifier | None]:
    """A token for ``work``: completed by the work's done-callback, expired at ``deadline``.
    Also returns that callback (None when the work has no future: then nothing completes the
    token, and the caller must)."""
    token = engine().add(deadline, on_expire)
    fut = future_of(work)
    if fut is None:
        return token, None
    callback = token.notifier()
    fut.add_done_callback(callback)
    return token, callback


def wait_until(work: Any, deadline: float) -> tuple[bool, _core.Token, bool]:
    """Blocks until ``work`` ends (True) or ``deadline`` passes (False); also returns the token
    and whether the work has a future. For work with a future the result is not inspected; for
    work without one (gloo send/recv) torch's wait already raised any error, and calling its
    ``wait()`` again would wait for a second completion that never comes."""
    token, callback = watch(work, deadline)
    if callback is None:
        return _wait_posted(work, token, deadline)
    try:
        if token.wait() == COMPLETED:
            return True, token, True
    except BaseException:
        token.cancel()
        abandon(token, weakref.ref(callback))
        raise
    # Timed out: the work is still in flight; the exit hook must know about its callback.
    abandon(token, weakref.ref(callback))
    return False, token, True


def _wait_posted(work: Any, token: _core.Token, deadline: float) -> tuple[bool, _core.Token, bool]:
    finished = False
    try:
        finished = wait_posted(work, deadline)
        return finished, token, False
    finally:
        if finished:
            token.complete()
        else:
            token.cancel()
            abandon(token, None)


def wait_posted(work: Any, limit: float) -> bool:
    """torch's own bounded, GIL-free wait on work that has no future (gloo send/recv): True once
    it ended, False when ``limit`` came first (the op stays posted). A backend failure raises."""
    left = limit - current_time()
    if left > 0:
        try:
            work.wait(datetime.timedelta(seconds=min(left, 1e9)))
            return True
        except RuntimeError as exc:
            if verdict.classify(exc) != verdict.TIMEOUT:
                raise
            return False
    return bool(work.is_completed())


def abandon(token: _core.Token, callback_ref: Callable[[], Any] | None) -> None:
    """Remembers work left in flight at its deadline: the exit hook waits (bounded) until torch
    has run and dropped its done-callback, whose weak reference is ``callback_ref``."""
    if callback_ref is None:
        token.notifier()(None)  # no callback will ever come: count the work as let go
        return
    with _abandoned_lock:
        _abandoned[:] = [ref for ref in _abandoned if ref() is not None]
        _abandoned.append(callback_ref)


def drain_abandoned(end: float) -> None:
    """At exit: waits (GIL free) until ``end`` (time.monotonic()) for torch to let go of the
    done-callback of every op abandoned at its deadline (fastdist.shutdown)."""
    with _abandoned_lock:
        pending = list(_abandoned)
        _abandoned.clear()
    for ref in pending:
        while ref() is not None and time.monotonic() < end:
            time.sleep(0.001)


def run_handler_unwaited(err: BaseException) -> None:
    """Runs the timeout handler for the timeout of an op nobody waits on, on fastdist's own
    thread: a ``sys.exit()`` in it ends the process with its code, and anything else it raises
    goes to ``sys.unraisablehook`` (the op's error stays the timeout). In a waiting thread the
    handler runs there instead, and what it raises propagates."""
    try:
        run_timeout_handler(err)
    except SystemExit as exc:
        exit_process(exc.code)
    except BaseException as exc:  # noqa: BLE001 - reported, as an exception in __del__ is
        _watched.write_unraisable(exc, run_timeout_handler)


class Work(abc.ABC):
    """fastdist's handle for an op issued with ``async_op=True``.

    Its deadline was fixed when the op was issued. ``wait()`` returns True once the op is done,
    or raises :class:`CollectiveTimeoutError` (or :class:`GroupAbortedError`) at that deadline;
    ``wait(timeout)`` waits at most ``timeout`` more seconds and raises a plain
    :class:`TimeoutError` if that ends first (the op is then still in flight and still watched).
    A handle nobody waits on still times out: the group is marked dead and the timeout handler
    runs, on fastdist's own thread (a ``sys.exit`` there ends the process with that code).
    """

    _fastdist_handle = True  # fastdist.wait() calls wait(timeout) on it
    __slots__ = ()
    op: str

    @property
    @abc.abstractmethod
    def deadline(self) -> float:
        """The op's absolute deadline on :func:`fastdist.current_time`'s clock."""

    @abc.abstractmethod
    def wait(self, timeout: Any = None) -> bool:
        """True once the op is done; raises its error (a timeout included)."""

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """True once the op finished, successfully or not (its deadline passing included)."""

    @abc.abstractmethod
    def exception(self) -> BaseException | None:
        """The error the op ended with (a timeout included), or None; None while in flight."""

    def _gave_up(self, seq: int | None, waited: float) -> TimeoutError:
        number = "" if seq is None else f" #{seq}"
        return TimeoutError(
            f"wait() on {self.op}{number} gave up after {waited:.3g} s; the op is still in flight "
            f"and its deadline is in {max(0.0, self.deadline - current_time()):.3g} s"
        )


# Options objects are copied by the backend when an op is issued, so one object per distinct
# (kind, backend timeout, fields) can be shared by every call. Timeouts are rounded up to 10 ms so
# that calls with the same timeout= share one; the cache is bounded.
_OPTIONS_STEP_MS = 10
# About 31 years: a longer per-call timeout overflows in the backend (gloo's milliseconds).
_BACKEND_TIMEOUT_MAX = 1e9
# By (kind, backend timeout in ms or NO_TIMEOUT, fields): a watched group's ops (its backend gives
# gloo its timeout itself) look theirs up here directly, with NO_TIMEOUT.
options_cache: dict[tuple[Any, ...], Any] = {}
NO_TIMEOUT = -1


def backend_options(kind: type, deadline: float, now: float, fields: tuple[tuple[str, Any], ...] = ()) -> Any:
    """A ``kind`` (e.g. ``AllgatherOptions``) with ``fields`` set, whose per-call timeout makes
    the backend give up a little after ``deadline`` (``gloo_budget`` in csrc/watched/: the one
    rule, which the watched backend applies itself); for no deadline (``math.inf``), the group's
    own default."""
    if deadline == math.inf or deadline - now > _BACKEND_TIMEOUT_MAX:
        ms = NO_TIMEOUT  # none, or beyond what the backend can represent: the engine keeps the deadline
    else:
        ms = math.ceil(_watched.gloo_budget(deadline - now) * (1000 / _OPTIONS_STEP_MS)) * _OPTIONS_STEP_MS
    key: Any = (kind, ms, fields)
    try:
        opts = options_cache.get(key)
    except TypeError:  # an unhashable field (e.g. a premul-sum ReduceOp): no caching
        key, opts = None, None
    if opts is None:
        opts = kind()
        if ms >= 0:
            opts.timeout = datetime.timedelta(milliseconds=ms)
        for name, value in fields:
            setattr(opts, name, value)
        if key is not None and len(options_cache) < 1024:
            options_cache[key] = opts
    return opts


def fail(err: BaseException, cause: BaseException | None = None) -> NoReturn:
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
