"""Waiting on torch work with a deadline.

A torch ``Work`` (or ``torch.futures.Future``) is tied to an engine token: the future's
done-callback is the token's notifier (a small C++ object), so a waiter blocked in C++ (GIL
released) wakes the moment the work ends, without polling, or when the engine expires the token
at the deadline. gloo's point-to-point work has no future; it is waited on with torch's own
GIL-free bounded wait. (NCCL's futures complete at enqueue time: see _polled.)

Work abandoned at its deadline is still in flight, and its done-callback is Python code that
torch will run on a backend thread when the work finally ends. If that happened during
interpreter finalization the process would abort, so an exit hook gives abandoned work a bounded
time to end first (for gloo it ends by itself shortly after the deadline, see ``backend_grace``).
fastdist's handle for ``async_op=True`` is ``collectives.Work``.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, Optional

from . import _core
from ._timeouts import current_time, engine

logger = logging.getLogger(__name__)

COMPLETED = _core.COMPLETED
EXPIRED = _core.EXPIRED
PENDING = _core.PENDING

# How long interpreter exit waits, in all, for abandoned work to end.
EXIT_DRAIN_SECONDS = 2.0
# How long interpreter exit lets backend threads finish releasing ops that just completed.
EXIT_SETTLE_SECONDS = 0.05

_abandoned: list[Callable[[], Any]] = []  # weak references to abandoned done-callbacks
_abandoned_lock = threading.Lock()
_exit_hook_registered = False


def future_of(work: Any) -> Optional[Any]:
    """The ``torch.futures.Future`` behind ``work`` (a ``Work`` or already a ``Future``), or
    ``None`` for work that has none (gloo send/recv)."""
    get_future = getattr(work, "get_future", None)
    if get_future is None:
        return work
    try:
        return get_future()
    except RuntimeError:  # "Work::getFuture not implemented"
        return None


def watch(work: Any, deadline: float, on_expire: Optional[Callable[[], None]] = None) -> tuple[_core.Token, Optional[_core.Notifier]]:
    """A token for ``work``: completed by the work's done-callback, expired at ``deadline``.
    Also returns that callback (None when the work has no future: then nothing completes the
    token, and the caller must)."""
    if not _exit_hook_registered:
        _register_exit_hook()
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
    # Every blocking collective runs this: it is watch() inlined, with as few calls as possible.
    if not _exit_hook_registered:
        _register_exit_hook()
    token = (_engine or _first_engine()).add(deadline)
    try:
        fut = work.get_future()
    except AttributeError:
        fut = work  # already a Future
    except RuntimeError:  # "Work::getFuture not implemented" (gloo send/recv)
        return _wait_posted(work, token, deadline)
    callback = token.notifier()
    fut.add_done_callback(callback)
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
        finished = _wait_without_future(work, deadline)
        return finished, token, False
    finally:
        if finished:
            token.complete()
        else:
            token.cancel()
            abandon(token, None)


_engine: Optional[_core.Engine] = None


def _first_engine() -> _core.Engine:
    global _engine
    _engine = engine()
    return _engine


def _wait_without_future(work: Any, deadline: float) -> bool:
    """torch's own wait, bounded and GIL-free; a timeout there leaves the op posted."""
    left = deadline - current_time()
    if left <= 0:
        return bool(work.is_completed())
    try:
        work.wait(datetime.timedelta(seconds=min(left, 1e9)))
        return True
    except RuntimeError as exc:
        if current_time() >= deadline and ("Timed out" in str(exc) or "timed out" in str(exc)):
            return False
        raise


def abandon(token: _core.Token, callback_ref: Optional[Callable[[], Any]]) -> None:
    """Remembers work left in flight at its deadline: the exit hook waits (bounded) until torch
    has run and dropped its done-callback, whose weak reference is ``callback_ref``."""
    if callback_ref is None:
        token.notifier()(None)  # no callback will ever come: count the work as let go
        return
    with _abandoned_lock:
        _abandoned[:] = [ref for ref in _abandoned if ref() is not None]
        _abandoned.append(callback_ref)


def _register_exit_hook() -> None:
    global _exit_hook_registered
    with _abandoned_lock:
        if not _exit_hook_registered:
            atexit.register(_at_exit)
            _exit_hook_registered = True


def _at_exit() -> None:
    # A backend thread that needs the GIL once finalization has begun is killed inside C++, and
    # the process aborts ("terminate called without an active exception"). Two such moments:
    # - right after calling a done-callback, torch drops it: for work abandoned at a deadline that
    #   can be any time later, so wait (bounded, GIL free) until torch let go of each callback;
    # - right after completing an op, gloo's worker destroys it, dropping the last reference to
    #   tensors whose Python objects may need the GIL: a waiter that wakes on completion and
    #   exits at once can beat it, so give the worker threads a moment to settle.
    time.sleep(EXIT_SETTLE_SECONDS)
    end = current_time() + EXIT_DRAIN_SECONDS
    with _abandoned_lock:
        pending = list(_abandoned)
        _abandoned.clear()
    for ref in pending:
        while ref() is not None and current_time() < end:
            time.sleep(0.001)


def exit_process(code: object) -> None:
    """Ends the process from any thread with ``sys.exit``'s meaning of ``code``. ``sys.exit``
    in a thread other than the main one would end only that thread."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status)
