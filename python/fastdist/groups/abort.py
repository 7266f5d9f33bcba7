"""Aborting an NCCL-like group's communicators at a deadline, bounded.

ProcessGroupNCCL completes a work's future when the kernels are *enqueued*; the watched backend
(csrc/watched: its poller and its waiters) asks the work itself whether it ran, for every group
fastdist issues ops on (a group torch made through a private wrapper). What stays in Python is
the abort at the deadline: the group's communicators are aborted with torch's own abort, on a
thread of its own and with a deadline of its own, while the caller raises; an abort that hangs
ends the process (see :func:`abort_group`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from ..deadlines import engine, exit_process, run_timeout_handler
from ..settings import SETTINGS

logger = logging.getLogger(__name__)


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
            SETTINGS.abort_timeout,
        )
        try:
            run_timeout_handler(error)
        except SystemExit as e:
            exit_process(e.code)
        except BaseException:  # noqa: BLE001 - a handler that raised chose to keep going
            pending.settled.set()  # the handler chose to keep going
            return
        exit_process(1)

    guard = eng.add(eng.now() + SETTINGS.abort_timeout, on_hang)

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
    killed as it takes the GIL back, and the process would abort. Each abort's own deadline bounds
    the wait."""
    if not wait_aborts():
        logger.warning("fastdist: exiting while torch is still aborting communicators")


def wait_aborts() -> bool:
    """Waits until every abort started so far returned (True), or passed its own deadline
    without ending the process because the timeout handler chose to go on (False). A group must
    not be rebuilt, nor the process finalized, while torch is still aborting communicators."""
    end = time.monotonic() + SETTINGS.abort_timeout + _GUARD_GRACE_SECONDS
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
    # torch's NCCL backend groups the aborts of several communicators (ncclGroupStart/End: one
    # at a time they can deadlock, torch issue 119797); a watched group's is inside its wrapper.
    backend = getattr(backend, "inner", backend)
    grouped = backend is not None and hasattr(backend, "_group_start")
    if grouped:
        backend._group_start()
    try:
        for g in groups:
            g.abort()
    finally:
        if grouped:
            backend._group_end()
