"""Fault propagation: when one rank's op on a group fails, every other live rank of the group
learns it at once, says where it is, and ends its own op on the group.

Each process runs one listener thread (started by ``fastdist.init_process_group``) blocked on its
own store connection in a pop from its inbox (fastdist.store.ring): an idle rank makes no
wake-ups and no store traffic. A rung rank forwards the ring to its children, posts its status
(the op it is in on that group, and the Python stack of the thread that issued it, or of its
main thread when it is in none) to the group's board, then fails its ops in flight on the group
(their waiters raise at once; on NCCL the communicators are aborted) or, with none in flight,
marks the group dead. This thread reads and routes; what a fault does to a group is
fastdist.ops.fault's (:func:`fastdist.ops.fault.peer_fault`, :func:`fastdist.ops.fault.peer_died`).

What is and is not possible: a rank stopped (SIGSTOP), dead, or holding the GIL in a long C call
cannot answer; the report says it did not answer. On gloo an op in flight cannot be aborted:
fastdist ends the op for its caller at once, while gloo's worker finishes it at its own per-call
timeout, shortly after.
"""

from __future__ import annotations

import datetime
import logging
import threading
from typing import Any

from ..groups import pgstate, registry
from ..store import job, keys, keywait, ring, seal
from ..store.bounded import bounded
from ..store.etcd import queues_of
from . import fault

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

_lock = threading.Lock()
_listener: _Listener | None = None


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
        bounded(
            lambda _a: ring.deliver(listener.store, listener.rank, seal.seal_json({"kind": "exit"})),
            timeout,
            "the bell",
        )
    except Exception as exc:  # noqa: BLE001 - the store is gone: so is the listener's wait
        logger.debug("fastdist: could not wake the listener: %r", exc)
    listener.join(timeout)


def restart(store: Any, global_rank: int) -> None:
    """After the default group was rebuilt with other ranks (a shrink, a growth): listens on
    this rank's new inbox, in the new group's store."""
    stop()
    start(store, global_rank)


class _Listener(threading.Thread):
    def __init__(self, store: Any, rank: int) -> None:
        super().__init__(name="fastdist-bell", daemon=True)
        self.store = store  # for short operations (posting, forwarding)
        self.rank = rank

    def run(self) -> None:
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
            keywait.set_waiter(self.store.clone(), self.store)
        except Exception as exc:  # noqa: BLE001 - a store that cannot clone (a Python store but ours)
            logger.debug("fastdist: no second connection to the store; faults are not propagated: %r", exc)
            return
        while True:
            try:
                raw = conn.queue_pop(keys.inbox(self.rank))
            except Exception as exc:  # noqa: BLE001 - the store went away (job end, host died)
                logger.debug("fastdist: the fault listener stops: %r", exc)
                return
            rec = keys.parse_record(raw, _RING_FIELDS, "fault record")
            if rec is None:
                continue
            if rec["kind"] == "exit":
                return
            if rec["kind"] == "death":
                death = keys.parse_record(raw, job.DEATH_FIELDS)
                if death is not None:
                    _handle_death(death)
                continue
            peer = keys.parse_record(raw, _FAULT_FIELDS)
            if peer is None:
                continue
            try:
                if poster is conn:
                    conn.set_timeout(short)  # short operations: the job's store timeout
                _handle(poster, peer, raw)
            except Exception as exc:  # noqa: BLE001 - a listener must outlive one bad fault
                logger.warning("fastdist: handling a peer's fault failed: %r", exc)
            finally:
                if poster is conn:
                    conn.set_timeout(_FOREVER)


def _handle_death(death: dict[str, Any]) -> None:
    """``fastdist run``'s agent saw rank ``death["rank"]`` die: fastdist.ops.fault applies it."""
    fault.peer_died(death, _default_group())


def _default_group() -> Any:
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_group() if dist.is_initialized() else None


# The faults handled: a rank can be rung twice for one (its ringer rings the ranks whose ring
# parent stayed silent again, directly: fastdist.store.board.report; the first ring may have come from its
# watched backend, in C++), and acts once.
_handled: set[tuple[Any, ...]] = set()


def _handle(store: Any, rec: dict[str, Any], raw: bytes) -> None:
    """A peer's fault record ``rec`` (``raw``, as it came): fastdist.ops.fault applies it to the group
    of its generation, once."""
    key = tuple(rec[k] for k in ("group", "gen", "root", "op", "seq"))
    if key in _handled:
        return
    _handled.add(key)
    for pg in registry.watched_groups():
        st = pgstate.state_of(pg)
        if st.name != rec["group"] or st.generation != rec["gen"]:
            continue
        with st.generation_lock:  # a recovery rebuilding the group in place waits, or is not news
            if st.generation == rec["gen"]:
                fault.peer_fault(store, st, pg, rec, raw)
