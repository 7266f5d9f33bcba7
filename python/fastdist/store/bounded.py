"""Store work on the fault paths, bounded in time.

A TCPStore call to a store whose host dropped off the network (packets vanish, no reset) does not
return: the store's timeout bounds only waits for keys, and TCP retransmits for many minutes
(tests/diagnostics/test_netfaults.py measured an ``add`` still blocked after 200 s). The report, the ring and
the recovery agreement run their store work through :func:`bounded`: in a helper thread, waited
for until a deadline, after which the caller gets :class:`StoreUnanswered` (a diagnosed "the
store cannot be reached" error) instead of a hang. The helper stays blocked until TCP gives up or
the network comes back; the store client serializes its calls, so a later call waits behind it,
bounded in the same way.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# What store work gets beyond the protocol's own wait (a report's window, a recovery's deadline):
# a healthy store answers in well under a millisecond, a loaded one in tens.
GRACE_SECONDS = 2.0


_blocked = 0  # helpers given up on and still blocked in a store call
_blocked_lock = threading.Lock()


def drain(end: float) -> None:
    """At exit: waits until ``end`` (time.monotonic()) for the store calls given up on or handed
    to the closer thread. A helper that returns from its store call while the interpreter
    finalizes is killed inside C++, and the process aborts ("terminate called without an active
    exception"); the network may have come back (then the call returns within one TCP
    retransmission)."""
    while (_blocked > 0 or _in_calls > 0) and time.monotonic() < end:
        time.sleep(0.01)


_in_calls = 0  # store work queued or running on fastdist's closer thread (nobody waits on it)


def call_queued() -> None:
    """Store work was handed to a thread of fastdist's that nobody waits on (the closer): the
    exit waits for it (until call_done) as for a helper given up on."""
    global _in_calls
    with _blocked_lock:
        _in_calls += 1


def call_done() -> None:
    """The store work of a :func:`call_queued` has finished: the exit no longer waits for it."""
    global _in_calls
    with _blocked_lock:
        _in_calls -= 1


def stuck() -> bool:
    """Whether a store call this process gave up on is still blocked: then its connection is
    held behind it (a fresh one answers at once once the network is back)."""
    return _blocked > 0


class _Helpers:
    """The helper threads of :func:`bounded`: one is started when none is idle; once done, it
    waits HELPER_IDLE_SECONDS for more work unless MAX_IDLE_HELPERS wait already (then it ends,
    so that calls made at once leave no threads behind). A fault's report runs several bounded
    calls in a row on each rank, and on a loaded host the start of a thread (its handshake with
    the starting one, two hand-overs of the GIL) cost milliseconds of it; an idle helper is woken
    in one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0  # helpers waiting for a job and not yet promised one

    def run(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._idle > 0:
                self._idle -= 1  # that helper is promised this job (it stays to take it)
                self._jobs.put(job)
                return
        threading.Thread(target=self._serve, args=(job,), name="fastdist-store-call", daemon=True).start()

    def _serve(self, job: Callable[[], None]) -> None:
        while True:
            job()
            job = None  # type: ignore[assignment]  # (its references go now, not at the next job)
            with self._lock:
                if self._idle >= MAX_IDLE_HELPERS:
                    return
                self._idle += 1
            try:
                job = self._jobs.get(timeout=HELPER_IDLE_SECONDS)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:  # nobody promised this helper a job: it ends
                        self._idle -= 1
                        return
                job = self._jobs.get()  # a job was promised just as the wait ended: it comes


# How long an idle helper of bounded() waits for another call before it ends, and how many wait.
HELPER_IDLE_SECONDS = 30.0
MAX_IDLE_HELPERS = 1
_helpers = _Helpers()


def _forget_helpers() -> None:
    global _helpers
    _helpers = _Helpers()  # a forked child has none of its parent's threads


os.register_at_fork(after_in_child=_forget_helpers)


class StoreUnanswered(ConnectionError):
    """The job's store did not answer in time (its host is unreachable, or it is overloaded)."""


def bounded(fn: Callable[[threading.Event], T], seconds: float, what: str) -> T:
    """``fn(abandoned)``, or :class:`StoreUnanswered` if it has not returned within ``seconds``
    (an infinite bound runs ``fn`` in the caller's thread). ``abandoned`` is set when the caller
    gave up: work that would change shared state must look at it before each change, so that an
    abandoned helper, unblocked later, does not act for a caller that has moved on."""
    abandoned = threading.Event()
    if not math.isfinite(seconds):
        return fn(abandoned)
    box: dict[str, object] = {}
    done = threading.Event()

    def run() -> None:
        global _blocked
        try:
            box["value"] = fn(abandoned)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            box["error"] = exc
        finally:
            with _blocked_lock:
                done.set()
                if abandoned.is_set():
                    _blocked -= 1

    _helpers.run(run)
    if not done.wait(max(seconds, 0.0)):
        global _blocked
        with _blocked_lock:
            if not done.is_set():
                abandoned.set()
                _blocked += 1
        if abandoned.is_set():
            raise StoreUnanswered(
                f"no answer to {what} within {seconds:.1f} s: its host is unreachable (a network partition?) "
                "or overloaded"
            )
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]
