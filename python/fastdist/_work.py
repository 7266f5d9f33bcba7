"""Waiting on torch work with a deadline.

A torch ``Work`` (or ``torch.futures.Future``) is tied to an engine token: the future's
done-callback completes the token, so a waiter blocked in C++ (GIL released) wakes the moment
the work ends, without polling, or when the engine expires the token at the deadline.

Work abandoned at its deadline is still in flight, and its done-callback is Python code that
torch will run on a backend thread when the work finally ends. If that happened during
interpreter finalization the process would abort, so an exit hook gives abandoned work a bounded
time to end first (for gloo it ends by itself shortly after the deadline, see ``backend_grace``).
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from typing import Any

from . import _core
from ._timeouts import current_time, engine

COMPLETED = _core.COMPLETED

# How long interpreter exit waits, in all, for abandoned work to end.
EXIT_DRAIN_SECONDS = 2.0

_abandoned: list[_core.Token] = []
_abandoned_lock = threading.Lock()
_drain_registered = False


def future_of(work: Any) -> Any:
    """The ``torch.futures.Future`` behind ``work`` (a ``Work`` or already a ``Future``)."""
    get_future = getattr(work, "get_future", None)
    return get_future() if get_future is not None else work


def wait_until(work: Any, deadline: float) -> bool:
    """Blocks until ``work`` ends (True) or ``deadline`` passes (False). The work's result or
    error is not inspected here."""
    token = engine().add(deadline)
    finished = False
    try:
        future_of(work).add_done_callback(token)
        finished = token.wait() == COMPLETED
        return finished
    finally:
        if not finished:
            # Timed out or interrupted: the heap entry must not outlive the call, and the work,
            # still in flight, is remembered for the exit hook.
            token.cancel()
            _abandon(token)


def _abandon(token: _core.Token) -> None:
    global _drain_registered
    with _abandoned_lock:
        _abandoned[:] = [t for t in _abandoned if not t.work_done]
        _abandoned.append(token)
        if not _drain_registered:
            atexit.register(_drain_abandoned)
            _drain_registered = True


def _drain_abandoned() -> None:
    end = current_time() + EXIT_DRAIN_SECONDS
    with _abandoned_lock:
        pending = list(_abandoned)
        _abandoned.clear()
    while pending:
        token = pending.pop()
        token.wait_work_done(max(0.0, end - current_time()))
        # Right after calling the callback, torch's backend thread drops its reference to it,
        # which needs the GIL; if finalization has begun by then, that thread is killed inside
        # C++ and the process aborts. The token is the callback: wait until torch let go of it
        # (references left: this variable and getrefcount's argument).
        while sys.getrefcount(token) > 2 and current_time() < end:
            time.sleep(0.001)
