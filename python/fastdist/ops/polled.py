"""Backends whose work has no useful completion callback: NCCL (and test doubles of it).

ProcessGroupNCCL completes a work's future when the kernels are *enqueued*, not when they ran,
so fastdist cannot wait on a done-callback there. Instead it asks the work itself
(``work.is_completed()``, a query of its end event that never blocks the host):

- a blocking call polls its own work, sleeping with the GIL released between checks (starting at
  20 us, backing off to 1 ms), until it completes or the deadline passes;
- an async handle's ``wait()`` polls its own work the same way; handles nobody waits on are
  released by one reaper thread that reaps every finished work in one pass per tick (every
  1 ms, backing off to 10 ms while nothing finishes; one GIL acquisition for the batch, not one
  per op). A group's collectives run on one stream and finish in the order they were issued,
  so if its newest one finished, all did: one completion query for the whole batch, else a
  binary search for where the finished ones end. Point-to-point works (one stream per peer)
  are queried one by one;
- at the deadline the group's communicators are aborted with torch's own abort, on a thread of
  its own and with a deadline of its own, while the caller raises; an abort that hangs ends the
  process (see abort_group).
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from ..deadlines import engine, run_timeout_handler
from .work import COMPLETED, PENDING, exit_process

logger = logging.getLogger(__name__)

# How long torch's abort may take before fastdist gives up on it and ends the process.
ABORT_TIMEOUT_SECONDS = float(os.environ.get("FASTDIST_ABORT_TIMEOUT", "10"))

_POLL_MIN = 20e-6
_POLL_MAX = 1e-3
# The reaper only releases works and deadlines of handles nobody is waiting on (a handle's
# wait() polls its own work): it can take its time, and leaves the GIL to the training loop.
_REAP_MIN = 1e-3
_REAP_MAX = 10e-3


def poll(work: Any, token: Any, timeout: float = math.inf) -> int:
    """Polls ``work.is_completed()`` (then completes ``token``) until ``token`` is no longer
    pending (completed, expired, or completed by the reaper) or ``timeout`` seconds passed;
    returns the token's state."""
    end = time.monotonic() + timeout
    interval = _POLL_MIN
    while True:
        if work.is_completed():
            token.complete()  # no-op if it expired meanwhile
            return int(token.state)
        left = end - time.monotonic()
        if left <= 0:
            return int(token.state)
        state = token.wait(min(interval, left))
        if state != PENDING:
            return int(state)
        interval = min(interval * 2, _POLL_MAX)


def wait_polled(work: Any, token: Any) -> bool:
    """Blocks until ``work.is_completed()`` (True) or ``token`` expired (False)."""
    return poll(work, token) == COMPLETED or bool(work.is_completed())


class Reaper:
    """Completes the tokens of async works on polled backends, in batches, on one thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[tuple[int, bool], collections.deque[tuple[Any, Any]]] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.reaped = 0

    def watch(self, group_key: int, work: Any, token: Any, ordered: bool = True) -> None:
        """Watches ``work`` until it completes, then completes ``token``. ``ordered``: the work
        runs on its group's one stream, behind every collective issued before it on that group
        (NCCL collectives; not point-to-point ops, which run per peer)."""
        with self._lock:
            if self._stopped:  # the process is exiting
                return
            self._queues.setdefault((group_key, ordered), collections.deque()).append((work, token))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="fastdist-reaper", daemon=True)
                self._thread.start()
        if not self._wake.is_set():  # only an idle reaper needs waking (see _run)
            self._wake.set()

    def pending(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._queues.values())

    def reap_once(self) -> int:
        """One pass: completes the token of every finished work; returns how many."""
        done = 0
        with self._lock:
            for key in list(self._queues):
                q = self._queues[key]
                try:
                    done += _reap_ordered(q) if key[1] else _reap_each(q)
                except Exception as exc:  # noqa: BLE001 - a completion query that raised
                    # The backend failed these works: let their waiters see it (work.wait()
                    # raises the backend's error, made into a typed one) instead of a deadline.
                    logger.debug("fastdist: completion query failed: %r", exc)
                    while q:
                        token = q.popleft()[1]
                        if token.state == PENDING:
                            token.complete()
                            done += 1
                if not q:
                    del self._queues[key]
        self.reaped += done
        return done

    def stop(self, timeout: float = 1.0) -> None:
        """Ends the thread and drops the works it watched. Runs at exit (fastdist.shutdown), before
        the interpreter finalizes: a daemon thread still holding works then (and waking from
        its sleep into a finalizing interpreter) made the process abort in torch's C++."""
        with self._lock:
            self._stopped = True
            queues, self._queues = self._queues, {}
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        queues.clear()

    def _run(self) -> None:
        interval = _REAP_MIN
        while not self._stopped:
            # Clear, then look: a watch() that queued before the look is seen here, and one that
            # queued after it finds the event clear and sets it.
            self._wake.clear()
            if not self.pending():
                self._wake.wait()
                interval = _REAP_MIN
                continue
            interval = _REAP_MIN if self.reap_once() else min(interval * 2, _REAP_MAX)
            time.sleep(interval)


def _finished_prefix(q: collections.deque[tuple[Any, Any]]) -> int:
    """How many works at the head of ``q`` finished, for works that finish in queue order: one
    completion query when all did (the common case in a training loop), else a binary search."""
    if q[-1][0].is_completed():
        return len(q)
    if not q[0][0].is_completed():
        return 0
    lo, hi = 0, len(q) - 1  # q[lo] finished, q[hi] did not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if q[mid][0].is_completed():
            lo = mid
        else:
            hi = mid
    return lo + 1


def _reap_ordered(q: collections.deque[tuple[Any, Any]]) -> int:
    done = 0
    n = _finished_prefix(q)
    for _ in range(n):
        token = q.popleft()[1]
        if token.state == PENDING:  # not expired or cancelled meanwhile
            token.complete()
            done += 1
    while q and q[0][1].state != PENDING:  # expired or cancelled: nothing to wait for any more
        q.popleft()
    return done


def _reap_each(q: collections.deque[tuple[Any, Any]]) -> int:
    done = 0
    for _ in range(len(q)):
        work, token = q.popleft()
        if token.state != PENDING:
            continue
        if work.is_completed():
            token.complete()
            done += 1
        else:
            q.append((work, token))
    return done


reaper = Reaper()


def abort_group(pg: Any, is_default: bool, error: BaseException) -> None:
    """Starts aborting ``pg``'s communicators (for the default group: every group's, together,
    as torch requires for NCCL) with torch's own abort, on a thread of its own, and returns at
    once: the caller raises at its deadline, not when the abort returns. (``ncclCommAbort``
    frees device memory, which waits for whatever the GPU is still running: behind a stalled
    compute kernel the abort takes as long as that kernel.) :func:`recover` and the exit of the
    process wait for it (see :func:`wait_aborts`).

    The abort has a deadline of its own, ``FASTDIST_ABORT_TIMEOUT`` seconds (default 10): an
    abort that hangs (ncclCommAbort can) ends the process with code 1 after the timeout handler
    ran with ``error``; the handler may exit otherwise, or raise to keep going at its own risk."""
    pending = _PendingAbort()
    eng = engine()

    def on_hang() -> None:  # on the engine's executor thread, unless the abort returned first
        if pending.done.is_set():
            return
        logger.critical(
            "fastdist: aborting the communicators of a timed-out group did not return within %.3g s; "
            "ending the process (set a timeout handler that raises to decide otherwise)",
            ABORT_TIMEOUT_SECONDS,
        )
        try:
            run_timeout_handler(error)
        except SystemExit as e:
            exit_process(e.code)
        except BaseException:  # noqa: BLE001 - a handler that raised chose to keep going
            pending.settled.set()  # the handler chose to keep going
            return
        exit_process(1)

    guard = eng.add(eng.now() + ABORT_TIMEOUT_SECONDS, on_hang)

    def run() -> None:
        try:
            _abort(pg, is_default)
        except BaseException as exc:  # noqa: BLE001 - a backend thread: the failure is logged
            logger.warning("aborting the communicators of a timed-out group failed: %s", exc)
        finally:
            guard.cancel()
            with _aborts_lock:
                _aborts.discard(pending)
            pending.done.set()
            pending.settled.set()

    with _aborts_lock:
        _aborts.add(pending)
    threading.Thread(target=run, name="fastdist-abort", daemon=True).start()


class _PendingAbort:
    __slots__ = ("done", "settled")

    def __init__(self) -> None:
        self.done = threading.Event()  # torch's abort returned
        self.settled = threading.Event()  # returned, or its deadline passed and the handler chose to go on


_aborts_lock = threading.Lock()
_aborts: set[_PendingAbort] = set()

# Past an abort's own deadline, how long wait_aborts still waits for its guard to act (the
# engine's executor may be running someone's timeout handler).
_GUARD_GRACE_SECONDS = 5.0


def stop() -> None:
    """At exit, before the interpreter finalizes: a thread still inside torch's abort then would be
    killed as it takes the GIL back, and the process would abort; so would the reaper's, holding
    works. Each abort's own deadline bounds the wait."""
    reaper.stop()
    if not wait_aborts():
        logger.warning("fastdist: exiting while torch is still aborting communicators")


def wait_aborts() -> bool:
    """Waits until every abort started so far returned (True), or passed its own deadline
    without ending the process because the timeout handler chose to go on (False). A group must
    not be rebuilt, nor the process finalized, while torch is still aborting communicators."""
    end = time.monotonic() + ABORT_TIMEOUT_SECONDS + _GUARD_GRACE_SECONDS
    with _aborts_lock:
        pending = list(_aborts)
    for p in pending:
        p.settled.wait(max(0.0, end - time.monotonic()))
    return all(p.done.is_set() for p in pending)


def _abort(pg: Any, is_default: bool) -> None:
    if not is_default:
        pg.abort()
        return
    groups = sorted(
        dist.distributed_c10d._world.pg_names,
        key=lambda g: dist.distributed_c10d._world.pg_names[g],
        reverse=True,
    )
    try:
        backend = pg._get_backend(torch.device("cuda"))
    except (RuntimeError, AttributeError):
        backend = None
    grouped = backend is not None and hasattr(backend, "_group_start")
    if grouped:
        backend._group_start()
    try:
        for g in groups:
            g.abort()
    finally:
        if grouped:
            backend._group_end()
