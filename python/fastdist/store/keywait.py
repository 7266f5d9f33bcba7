"""Waiting for a store key until a deadline, and closing it at one.

The waits on the store that close at a deadline (the report's board, the recovery agreement) go
through :func:`wait_key`: the closing itself is store work, so it runs on one closer thread per
process (idle until a deadline), never on the engine's executor, through which every deadline of
the process fires.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from ..deadlines import current_time, engine
from .bounded import GRACE_SECONDS, bounded, call_done, call_queued

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.005
_lock = threading.Lock()


# A second connection to the job's store for the reports' blocking waits (a wait holds its
# client), made by the listener when it starts (torch's TCPStore.clone() takes about 0.25 s, too
# long to pay at a fault), and used by one report at a time.
_waiter: Any = None
_waiter_of: Any = None  # the store it is a second connection to (its keys, under its prefixes)
_waiter_lock = threading.Lock()


@contextlib.contextmanager
def waiter(store: Any = None) -> Iterator[Any]:
    """The reports' wait connection, or None (not made yet, a store that cannot make one, in
    use by another report, or one to another store than ``store``): then the caller polls."""
    conn = _waiter
    if (
        conn is None
        or (store is not None and store is not _waiter_of)
        or not _waiter_lock.acquire(blocking=False)
    ):
        yield None
        return
    try:
        yield conn
    finally:
        _waiter_lock.release()


def set_waiter(conn: Any, of: Any) -> None:
    """Gives the reports the wait connection ``conn`` to ``of`` (made by the fault listener when
    it starts)."""
    global _waiter, _waiter_of
    _waiter, _waiter_of = conn, of


def at_deadline(deadline: float, work: Callable[[], object], what: str) -> Any:
    """Runs ``work`` (store work) at ``deadline`` (:func:`fastdist.current_time`'s clock) on
    fastdist's closer thread, unless the returned handle is cancelled first. Never on the
    engine's executor: a store call can block for minutes (a partition), and every deadline of
    the process fires through that executor."""
    return _Closing(deadline, work, what)


class _Closing:
    """One closer's work: queued by an engine action at its deadline, skipped when cancelled
    before the closer thread reaches it."""

    def __init__(self, deadline: float, work: Callable[[], object], what: str) -> None:
        self.work = work
        self.what = what
        self.cancelled = False
        self.token = engine().add(deadline, self._queue)

    def _queue(self) -> None:
        call_queued()
        _closer_queue().put(self)

    def cancel(self) -> None:
        self.cancelled = True
        self.token.cancel()


_closings: queue.SimpleQueue[_Closing] | None = None


def _closer_queue() -> queue.SimpleQueue[_Closing]:
    """The closer thread's queue; the thread (one per process, idle until a deadline) starts
    with the first use."""
    global _closings
    with _lock:
        if _closings is None:
            _closings = queue.SimpleQueue()
            threading.Thread(
                target=_run_closers, args=(_closings,), name="fastdist-closer", daemon=True
            ).start()
        return _closings


def _run_closers(todo: queue.SimpleQueue[_Closing]) -> None:
    while True:
        job = todo.get()
        try:
            if not job.cancelled:
                # Bounded: a store call stuck on a partition must not hold every later closing
                # of the process (a recovery on a new connection, say) behind it.
                bounded(_ignoring_abandon(job.work), GRACE_SECONDS, job.what)
        except Exception as exc:  # noqa: BLE001 - the waiters' own bounded waits end anyway
            logger.debug("fastdist: %s failed: %r", job.what, exc)
        finally:
            call_done()


def _ignoring_abandon(work: Callable[[], object]) -> Callable[[threading.Event], object]:
    return lambda _abandoned: work()


# How long past the deadline a waiter whose closer runs at the deadline waits for the key: the
# closer's store work takes milliseconds; past this it failed (the store is failing).
CLOSER_MARGIN_SECONDS = 5.0


def wait_key(
    store: Any,
    key: str,
    deadline: float,
    closer: Callable[[], object] | None = None,
    close_at: float | None = None,
) -> bool:
    """Blocks until ``key`` is set in ``store`` or ``deadline`` (:func:`fastdist.current_time`'s
    clock) passes; True when it is set. Without polling, on the wait connection, when it is free
    (else polling every 5 ms). ``closer``, when given, runs at ``close_at`` (default: the
    deadline) unless the key came first: it sets the key if nobody has, so that every rank
    waiting on it wakes by the first such deadline."""
    return _wait(store, key, deadline, closer, close_at, read=False) is not None


def get_key(
    store: Any,
    key: str,
    deadline: float,
    closer: Callable[[], object] | None = None,
    close_at: float | None = None,
) -> bytes | None:
    """:func:`wait_key`, and the key's value, read on the wait connection; None when ``deadline``
    passed first. (Not one blocking ``get``: with a thousand ranks blocked in it the store woke
    them over seconds, bench/test_report_scale.py: 1.8 s against 0.3 s for a wait and a get.)"""
    return _wait(store, key, deadline, closer, close_at, read=True)


def _wait(
    store: Any,
    key: str,
    deadline: float,
    closer: Callable[[], object] | None,
    close_at: float | None,
    read: bool,
) -> bytes | None:
    when = deadline if close_at is None else close_at
    token = at_deadline(when, closer, f"closing {key}") if closer else None
    # A closer at the deadline sets the key by then: the margin only covers one that failed.
    # Without, the wait ends at the deadline (torch logs a line then).
    end = deadline + (CLOSER_MARGIN_SECONDS if closer is not None and close_at is None else 0.0)
    try:
        with waiter(store) as conn:
            if conn is not None:
                left = datetime.timedelta(seconds=max(0.001, end - current_time()))
                try:
                    conn.wait([key], left)
                except dist.DistStoreError:  # the wait's timeout (the store itself failing raises others)
                    return None
                return bytes(conn.get(key)) if read else b""
        while not store.check([key]):
            if current_time() >= end:
                return None
            time.sleep(_POLL_SECONDS)
        return bytes(store.get(key)) if read else b""
    finally:
        if token is not None:
            token.cancel()
