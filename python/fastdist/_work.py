"""Waiting on torch work with a deadline, and fastdist's handle for ``async_op=True``.

A torch ``Work`` (or ``torch.futures.Future``) is tied to an engine token: the future's
done-callback is the token itself, so a waiter blocked in C++ (GIL released) wakes the moment
the work ends, without polling, or when the engine expires the token at the deadline. gloo's
point-to-point work has no future; it is waited on with torch's own GIL-free bounded wait.

Work abandoned at its deadline is still in flight, and its done-callback is Python code that
torch will run on a backend thread when the work finally ends. If that happened during
interpreter finalization the process would abort, so an exit hook gives abandoned work a bounded
time to end first (for gloo it ends by itself shortly after the deadline, see ``backend_grace``).
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

_abandoned: list[Callable[[], Any]] = []  # weak references to abandoned done-callbacks
_abandoned_lock = threading.Lock()
_drain_registered = False


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
    token = engine().add(deadline, on_expire)
    fut = future_of(work)
    if fut is None:
        return token, None
    callback = token.notifier()
    fut.add_done_callback(callback)
    return token, callback


def wait_until(work: Any, deadline: float) -> tuple[bool, _core.Token]:
    """Blocks until ``work`` ends (True) or ``deadline`` passes (False); also returns the token.
    The work's result is not inspected."""
    token, callback = watch(work, deadline)
    finished = False
    try:
        if callback is not None:
            finished = token.wait() == COMPLETED
        else:
            finished = _wait_without_future(work, deadline)
            if finished:
                token.complete()
        return finished, token
    finally:
        if not finished:
            # Timed out or interrupted: the heap entry must not outlive the call.
            token.cancel()
            abandon(token, None if callback is None else weakref.ref(callback))


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
    global _drain_registered
    with _abandoned_lock:
        _abandoned[:] = [ref for ref in _abandoned if ref() is not None]
        _abandoned.append(callback_ref)
        if not _drain_registered:
            atexit.register(_drain_abandoned)
            _drain_registered = True


def _drain_abandoned() -> None:
    # Right after calling a done-callback, torch's backend thread drops it, which needs the GIL;
    # if finalization had begun by then, that thread would be killed inside C++ and the process
    # would abort. So wait, with the GIL free, until torch has let go of every abandoned callback.
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
