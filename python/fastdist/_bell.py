"""Fault propagation: when one rank's op on a group fails, every other live rank of the group
learns it at once, says where it is, and ends its own op on the group.

Each process runs one listener thread (started by ``fastdist.init_process_group``) blocked on its
own store connection in a pop from its inbox, a store queue (``inbox/RANK``): an idle rank makes
no wake-ups and no store traffic. The first rank to report a fault on a group (the one
whose compare-and-set on the group's ``fault`` key wins, see fastdist.diagnostics) rings its
group: the ring goes down a binary tree of the group's ranks, rooted at the ringer, each rank
forwarding it to its two children, so every rank does O(1) store operations and the last one
hears it after about log2(N) hops. A rung rank posts its status (the op it is in on that group,
and the Python stack of the thread that issued it, or of its main thread when it is in none) to
the group's board, then fails its ops in flight on the group (their waiters raise at once; on
NCCL the communicators are aborted) or, with none in flight, marks the group dead.

The waits on the store that close at a deadline (the report's board, the recovery agreement) go
through :func:`wait_key`: the closing itself is store work, so it runs on one closer thread per
process (idle until a deadline), never on the engine's executor, through which every deadline of
the process fires.

What is and is not possible: a rank stopped (SIGSTOP), dead, or holding the GIL in a long C call
cannot answer; the report says it did not answer. On gloo an op in flight cannot be aborted:
fastdist ends the op for its caller at once, while gloo's worker finishes it at its own per-call
timeout, shortly after.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from . import _bounded, _keys
from ._timeouts import current_time, engine
from .etcd import queues_of

if TYPE_CHECKING:
    from ._groups import GroupState

logger = logging.getLogger(__name__)

_FOREVER = datetime.timedelta(days=3650)
_RING_FIELDS: dict[str, type | tuple[type, ...]] = {"kind": str}
_FAULT_FIELDS: dict[str, type | tuple[type, ...]] = {
    "kind": str,
    "group": str,
    "gen": int,
    "root": int,
    "rank": int,
    "op": str,
    "seq": int,
}
_MAX_FRAMES = 6
_POLL_SECONDS = 0.005
_SKIP = (os.sep + "torch" + os.sep, os.sep + "fastdist" + os.sep, "<frozen ", os.sep + "threading.py")

_lock = threading.Lock()
_listener: _Listener | None = None


# A second connection to the job's store for the reports' blocking waits (a wait holds its
# client), made by the listener when it starts (torch's TCPStore.clone() takes about 0.25 s, too
# long to pay at a fault), and used by one report at a time.
_waiter: Any = None
_waiter_lock = threading.Lock()


@contextlib.contextmanager
def waiter() -> Iterator[Any]:
    """The reports' wait connection, or None (not made yet, a store that cannot make one, or in
    use by another report): then the caller polls."""
    conn = _waiter
    if conn is None or not _waiter_lock.acquire(blocking=False):
        yield None
        return
    try:
        yield conn
    finally:
        _waiter_lock.release()


def _inbox(global_rank: int) -> str:
    return _keys.key("inbox", global_rank)


def _deliver(store: Any, global_rank: int, record: str) -> None:
    queues_of(store).queue_push(_inbox(global_rank), record)


def _children(st: GroupState, root: int, dead: frozenset[int] = frozenset()) -> list[int]:
    """This rank's children in the ring tree rooted at group rank ``root``, as global ranks; a
    child in ``dead`` (global ranks known dead) is skipped for its own children, so that its
    subtree is still rung."""
    out: list[int] = []
    todo = [(st.rank - root) % st.size]
    while todo:
        pos = todo.pop()
        for c in (2 * pos + 1, 2 * pos + 2):
            if c >= st.size:
                continue
            child = st.global_rank((root + c) % st.size)
            if child in dead:
                todo.append(c)
            else:
                out.append(child)
    return out


def _dead_of(record: dict[str, Any]) -> frozenset[int]:
    ranks = record.get("dead_ranks")
    return frozenset(r for r in ranks if isinstance(r, int)) if isinstance(ranks, list) else frozenset()


def ring(st: GroupState, status: dict[str, Any]) -> None:
    """Rings the group of ``st``: this rank reported its fault first (``status``: its record)."""
    if st.store is None:
        return
    record = json.dumps(
        {
            "kind": "fault",
            "group": st.name,
            "gen": st.generation,
            "root": st.rank,
            "rank": st.my_global_rank,
            "op": status["op"],
            "seq": status["seq"],
            "state": status["state"],
            "t": status["t"],
            **({"dead": status["dead"], "dead_ranks": status["dead_ranks"]} if status.get("dead") else {}),
        }
    )
    try:
        for child in _children(st, st.rank, _dead_of(status)):
            _deliver(st.store, child, record)
    except RuntimeError as exc:  # a store without queues (FileStore): the others find out at their deadline
        logger.debug("fastdist: could not ring the group: %r", exc)


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
        _bounded.call_queued()
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
                _bounded.bounded(_ignoring_abandon(job.work), _bounded.GRACE_SECONDS, job.what)
        except Exception as exc:  # noqa: BLE001 - the waiters' own bounded waits end anyway
            logger.debug("fastdist: %s failed: %r", job.what, exc)
        finally:
            _bounded.call_done()


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
    when = deadline if close_at is None else close_at
    token = at_deadline(when, closer, f"closing {key}") if closer else None
    # A closer at the deadline sets the key by then: the margin only covers one that failed.
    # Without, the wait ends at the deadline (torch logs a line then).
    end = deadline + (CLOSER_MARGIN_SECONDS if closer is not None and close_at is None else 0.0)
    try:
        with waiter() as conn:
            if conn is not None:
                try:
                    conn.wait([key], datetime.timedelta(seconds=max(0.001, end - current_time())))
                except dist.DistStoreError:  # the wait's timeout (the store itself failing raises others)
                    return False
                return True
        while not store.check([key]):
            if current_time() >= end:
                return False
            time.sleep(_POLL_SECONDS)
        return True
    finally:
        if token is not None:
            token.cancel()


def start(store: Any, global_rank: int) -> None:
    """Starts this process's listener, which makes its own connections to ``store`` (idempotent)."""
    global _listener
    with _lock:
        if _listener is not None and _listener.is_alive():
            return
        _listener = _Listener(store, global_rank)
        _listener.start()


def stop(timeout: float = 1.0) -> None:
    """Ends the listener: rings its own inbox (waking only itself) and joins it, bounded."""
    global _listener
    with _lock:
        listener, _listener = _listener, None
    if listener is None or not listener.is_alive():
        return
    try:
        # Bounded: behind a store call stuck on a partition, the push would wait for minutes.
        _bounded.bounded(
            lambda _a: _deliver(listener.store, listener.rank, json.dumps({"kind": "exit"})),
            timeout,
            "the bell",
        )
    except Exception as exc:  # noqa: BLE001 - the store is gone: so is the listener's wait
        logger.debug("fastdist: could not wake the listener: %r", exc)
    listener.join(timeout)


class _Listener(threading.Thread):
    def __init__(self, store: Any, rank: int) -> None:
        super().__init__(name="fastdist-bell", daemon=True)
        self.store = store  # for short operations (posting, forwarding)
        self.rank = rank

    def run(self) -> None:
        global _waiter
        try:
            conn = queues_of(self.store).clone()  # this thread's own, for its blocking pops
            # The listener posts and forwards on a connection of its own too: the job's store
            # client serves one operation at a time, and the rank's own code can hold it for
            # minutes (a rank in a group's creation, where gloo's connect waits in a store get, or
            # in a store.wait), when its status and the ring through it are wanted. Between pops
            # the pop connection is free (the queues under the job's prefixes: a TCPStore); an
            # EtcdStore's queues live under no prefix, and the posts need it: a clone of the job's
            # store then.
            poster = conn if queues_of(self.store) is self.store else self.store.clone()
            short = self.store.timeout if poster is conn else _FOREVER
            conn.set_timeout(_FOREVER)
            _waiter = self.store.clone()
        except Exception as exc:  # noqa: BLE001 - a store that cannot clone (a Python store but ours)
            logger.debug("fastdist: no second connection to the store; faults are not propagated: %r", exc)
            return
        while True:
            try:
                raw = conn.queue_pop(_inbox(self.rank))
            except Exception as exc:  # noqa: BLE001 - the store went away (job end, host died)
                logger.debug("fastdist: the fault listener stops: %r", exc)
                return
            rec = _keys.parse_record(raw, _RING_FIELDS)
            if rec is None:
                continue
            if rec["kind"] == "exit":
                return
            fault = _keys.parse_record(raw, _FAULT_FIELDS)
            if fault is None:
                continue
            try:
                if poster is conn:
                    conn.set_timeout(short)  # short operations: the job's store timeout
                _handle(poster, fault, raw)
            except Exception as exc:  # noqa: BLE001 - a listener must outlive one bad fault
                logger.warning("fastdist: handling a peer's fault failed: %r", exc)
            finally:
                if poster is conn:
                    conn.set_timeout(_FOREVER)


def _handle(store: Any, fault: dict[str, Any], raw: bytes) -> None:
    from . import _groups, _watch, diagnostics

    for pg in _watch.watched_groups():
        st = _groups.state_of(pg)
        if st.name != fault["group"] or st.generation != fault["gen"]:
            continue
        record = raw.decode() if isinstance(raw, bytes) else str(raw)
        for child in _children(st, fault["root"], _dead_of(fault)):
            _deliver(store, child, record)
        backends = _watch.backends_of(pg)
        inflight = sorted((op for b in backends for op in b.inflight_ops()), key=lambda o: o[1])
        if inflight:
            op, seq, thread, _start = inflight[0]
            status = {
                "rank": st.rank,
                "op": op,
                "seq": seq,
                "state": "in_op",
                "t": time.time(),
                "stack": stack_of(thread),
                "waits": diagnostics.waits(st),
            }
        else:
            status = {
                "rank": st.rank,
                "op": "",
                "seq": 0,
                "state": "elsewhere",
                "t": time.time(),
                "stack": stack_of(_issuer(backends)),
                "waits": diagnostics.waits(st),
            }
        if diagnostics.post_status(st, status, store):
            # This rank's post completed the board: it publishes the summary, before it ends its
            # ops (ending one can run that op's own report, which waits for the summary, here).
            diagnostics.publish(st, store)
        verb = {"timed_out": "timed out in", "interrupted": "was interrupted (KeyboardInterrupt) in"}.get(
            str(fault.get("state")), "failed in"
        )
        reason = (
            f"rank {fault['rank']} {verb} {fault['op']} #{fault['seq']} and aborted group {st.name!r} "
            "while this rank was in no op on it"
        )
        if isinstance(fault.get("dead"), str):
            reason = f"{fault['dead']}; {reason}"
        for b in backends:
            b.fail_remote(record, reason)
        if not inflight:
            _groups.mark_dead(pg, reason)


def _issuer(backends: list[Any]) -> int:
    """The thread that issued the group's latest op, if it still runs (a subgroup's ops often come
    from a thread of their own), else the main thread: where this rank is, as far as the group
    is concerned."""
    history = [h for b in backends for h in b.history()]
    if history:
        thread = int(max(history, key=lambda h: int(h["seq"]))["thread"])
        if thread in sys._current_frames():
            return thread
    return threading.main_thread().ident or 0


def stack_of(thread_ident: int) -> list[str]:
    """The innermost frames of a thread, innermost first, as ``file:line in function``: the
    caller's own code first (torch's and fastdist's frames are left out unless nothing else is)."""
    frame = sys._current_frames().get(thread_ident)
    frames: list[str] = []
    everything: list[str] = []
    while frame is not None and len(frames) < _MAX_FRAMES:
        code = frame.f_code
        text = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        everything.append(text)
        if not any(part in code.co_filename for part in _SKIP):
            frames.append(text)
        frame = frame.f_back
    return frames or everything[:_MAX_FRAMES]
