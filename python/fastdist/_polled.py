"""Backends whose work has no useful completion callback: NCCL (and test doubles of it).

ProcessGroupNCCL completes a work's future when the kernels are *enqueued*, not when they ran,
so fastdist cannot wait on a done-callback there. Instead it asks the work itself
(``work.is_completed()``, a query of its end event that never blocks the host):

- a blocking call polls its own work, sleeping with the GIL released between checks (starting at
  20 us, backing off to 1 ms), until it completes or the deadline passes;
- async handles are watched by one reaper thread that checks every pending work in one pass per
  tick (one GIL acquisition for the batch, not one per op) and stops at the first unfinished
  work of each group, since a group's work completes in order;
- at the deadline the group's communicators are aborted with torch's own abort, off the timer
  thread and with a deadline of its own; an abort that hangs ends the process (see abort_group).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from ._timeouts import run_timeout_handler
from ._work import exit_process

logger = logging.getLogger(__name__)

# Backend names (as dist.get_backend() gives them) whose works fastdist polls.
POLLED_BACKENDS = {"nccl"}

# How long torch's abort may take before fastdist gives up on it and ends the process.
ABORT_TIMEOUT_SECONDS = float(os.environ.get("FASTDIST_ABORT_TIMEOUT", "10"))

_POLL_MIN = 20e-6
_POLL_MAX = 1e-3


def backend_of(pg: Any) -> str:
    try:
        return str(dist.get_backend(pg)).lower()
    except (RuntimeError, ValueError, AttributeError):
        name = getattr(pg, "name", None)
        return str(name() if callable(name) else name or "").lower()


def is_polled(backend: str) -> bool:
    return backend in POLLED_BACKENDS


def wait_polled(work: Any, token: Any) -> bool:
    """Blocks until ``work.is_completed()`` (True) or ``token`` expired (False)."""
    interval = _POLL_MIN
    while True:
        if work.is_completed():
            token.complete()
            return True
        if token.wait(interval) != 0:  # no longer pending: expired (or completed by the reaper)
            return bool(work.is_completed())
        interval = min(interval * 2, _POLL_MAX)


class Reaper:
    """Completes the tokens of async works on polled backends, in batches, on one thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[int, collections.deque[tuple[Any, Any]]] = {}
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.reaped = 0

    def watch(self, group_key: int, work: Any, token: Any) -> None:
        with self._lock:
            self._queues.setdefault(group_key, collections.deque()).append((work, token))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="fastdist-reaper", daemon=True)
                self._thread.start()
        self._wake.set()

    def pending(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._queues.values())

    def reap_once(self) -> int:
        """One pass: completes every finished work at the head of each group's queue."""
        done = 0
        with self._lock:
            for key in list(self._queues):
                q = self._queues[key]
                while q:
                    work, token = q[0]
                    if token.state != 0:  # expired or cancelled: nothing to wait for any more
                        q.popleft()
                        continue
                    if not work.is_completed():
                        break
                    q.popleft()
                    token.complete()
                    done += 1
                if not q:
                    del self._queues[key]
        self.reaped += done
        return done

    def _run(self) -> None:
        interval = _POLL_MIN
        while True:
            if not self.pending():
                self._wake.clear()
                self._wake.wait()
                interval = _POLL_MIN
            interval = _POLL_MIN if self.reap_once() else min(interval * 2, _POLL_MAX)
            time.sleep(interval)


reaper = Reaper()


def abort_group(pg: Any, is_default: bool, error: BaseException) -> None:
    """Aborts ``pg``'s communicators (for the default group: every group's, together, as torch
    requires for NCCL) with torch's own abort, bounded by ABORT_TIMEOUT_SECONDS. An abort that
    hangs (ncclCommAbort can) ends the process with code 1 after the timeout handler ran with
    ``error``: the handler may exit otherwise, or raise to keep going at its own risk."""
    done = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            _abort(pg, is_default)
        except BaseException as exc:  # reported below
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="fastdist-abort", daemon=True).start()
    if done.wait(ABORT_TIMEOUT_SECONDS):
        if failure:
            logger.warning("aborting the communicators of a timed-out group failed: %s", failure[0])
        return
    logger.critical(
        "fastdist: aborting the communicators of a timed-out group did not return within %.3g s; "
        "ending the process (set a timeout handler that raises to decide otherwise)", ABORT_TIMEOUT_SECONDS,
    )
    try:
        run_timeout_handler(error)
    except SystemExit as e:
        exit_process(e.code)
    except BaseException:
        return
    exit_process(1)


def _abort(pg: Any, is_default: bool) -> None:
    if not is_default:
        pg.abort()
        return
    groups = sorted(dist.distributed_c10d._world.pg_names, key=lambda g: dist.distributed_c10d._world.pg_names[g], reverse=True)
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

