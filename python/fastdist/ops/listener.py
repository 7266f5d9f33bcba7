"""Fault propagation: when one rank's op on a group fails, every other live rank of the group
learns it at once, says where it is, and ends its own op on the group.

Each process runs one listener thread (started by ``fastdist.init_process_group``) blocked on its
own store connection in a pop from its inbox (fastdist.store.ring): an idle rank makes no
wake-ups and no store traffic. A rung rank forwards the ring to its children, posts its status
(the op it is in on that group, and the Python stack of the thread that issued it, or of its
main thread when it is in none) to the group's board, then fails its ops in flight on the group
(their waiters raise at once; on NCCL the communicators are aborted) or, with none in flight,
marks the group dead.

What is and is not possible: a rank stopped (SIGSTOP), dead, or holding the GIL in a long C call
cannot answer; the report says it did not answer. On gloo an op in flight cannot be aborted:
fastdist ends the op for its caller at once, while gloo's worker finishes it at its own per-call
timeout, shortly after.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import threading
from typing import Any

from ..groups import pgstate, registry
from ..store import board, keys, keywait, ring, seal
from ..store.bounded import bounded
from ..store.etcd import queues_of
from . import events, stacks, verdict

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
                death = keys.parse_record(raw, _DEATH_FIELDS)
                if death is not None:
                    _handle_death(death)
                continue
            fault = keys.parse_record(raw, _FAULT_FIELDS)
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


def _handle_death(death: dict[str, Any]) -> None:
    """``fastdist run``'s agent saw rank ``death["rank"]`` die (its record: how, when). On an
    NCCL-like group that holds it, the collectives in flight may never end on their own (a kernel
    spins until the deadline): they fail now with the record, and the communicators are aborted
    (fastdist.ops.watching); with none in flight the group is marked dead, so the next op is
    refused at once. gloo's groups learn it from their closed connections: left alone. A group
    whose generation began after the death (rebuilt since, or this process is the dead rank's
    replacement) is left alone too."""
    dead = death["rank"]
    said = f"rank {dead} is dead ({death['how']})"
    told: list[tuple[Any, Any]] = []  # groups without the dead rank
    for pg in registry.watched_groups():
        st = pgstate.state_of(pg)
        ranks = st.global_ranks or []
        if dead == st.my_global_rank or st.began > death["time"]:
            continue
        if dead not in ranks:
            told.append((pg, st))
            continue
        if not st.polled:
            continue
        reason = f"{said}: fastdist run's record"
        detail = json.dumps({"rank": ranks.index(dead), "op": "", "seq": 0, "state": "dead", "dead": said})
        failed = False
        for b in registry.backends_of(pg):
            failed = b.fail_remote(detail, reason) or failed
        if not failed:
            st.mark_dead(reason)
    # The job recovers: an op on a group without the dead rank would hold this rank out of it.
    default = _default_group()
    if not told or default is None:
        return
    dst = pgstate.state_of(default)
    with dst.generation_lock:  # (a recovery that began since rebuilds these groups: not news)
        if dst.began <= death["time"]:
            for pg, st in told:
                _tell(pg, st, f"{said}: fastdist run's record", "", 0)


def _default_group() -> Any:
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_group() if dist.is_initialized() else None


_DEATH_FIELDS: dict[str, type | tuple[type, ...]] = {"rank": int, "how": str, "time": (int, float)}


# The faults handled: a rank can be rung twice for one (its ringer rings the ranks whose ring
# parent stayed silent again, directly: fastdist.store.board.report; the first ring may have come from its
# watched backend, in C++), and acts once.
_handled: set[tuple[Any, ...]] = set()


def _handle(store: Any, fault: dict[str, Any], raw: bytes) -> None:
    key = tuple(fault[k] for k in ("group", "gen", "root", "op", "seq"))
    if key in _handled:
        return
    _handled.add(key)
    for pg in registry.watched_groups():
        st = pgstate.state_of(pg)
        if st.name != fault["group"] or st.generation != fault["gen"]:
            continue
        with st.generation_lock:  # a recovery rebuilding the group in place waits, or is not news
            if st.generation == fault["gen"]:
                _apply(store, st, pg, fault, raw)


def _apply(store: Any, st: Any, pg: Any, fault: dict[str, Any], raw: bytes) -> None:
    """Applies a peer's fault to ``pg`` (of the fault's generation, held there)."""
    record = raw.decode() if isinstance(raw, bytes) else str(raw)
    for child in st.ring_children(fault["root"], ring.dead_of(fault)):
        ring.deliver(store, child, record)
    backends = registry.backends_of(pg)
    inflight = sorted((op for b in backends for op in b.inflight_ops()), key=lambda o: o[1])
    seat = dataclasses.replace(st.seat(), store=store)
    if inflight:
        op, seq, thread, _start = inflight[0]
        status = seat.status(op, seq, "in_op", stack=stacks.stack_of(thread))
    else:
        status = seat.status("", 0, "elsewhere", stack=stacks.stack_of(stacks.issuer(backends)))
    if board.post_status(seat, status):
        # This rank's post completed the board: it publishes the summary, before it ends its
        # ops (ending one can run that op's own report, which waits for the summary, here).
        board.publish(seat)
    verb = {"timed_out": "timed out in", "interrupted": "was interrupted (KeyboardInterrupt) in"}.get(
        str(fault.get("state")), "failed in"
    )
    reason = (
        f"rank {fault['rank']} {verb} {fault['op']} #{fault['seq']}{verdict.gil_note(fault)} and aborted "
        f"group {st.name!r} while this rank was in no op on it"
    )
    if isinstance(fault.get("dead"), str):
        reason = f"{fault['dead']}; {reason}"
    for b in backends:
        b.fail_remote(seal.opened(record, "fault record") or "{}", reason)  # (the record itself)
    if not inflight:  # (an op in flight counts its fault where it fails: fastdist.ops.watching)
        st.mark_dead(reason)
        events.emit("abort", st.my_global_rank, st.name, st.generation, str(fault["op"]), reason=reason)
    if st.is_default:  # the whole job recovers: an op on another group would hold this rank
        what = f"rank {fault['rank']} {verb} {fault['op']} #{fault['seq']} and aborted group 'default'"
        for other in registry.watched_groups():
            if other is not pg:
                ost = pgstate.state_of(other)
                _tell(other, ost, what, str(fault["op"]), int(fault["seq"]))


def _tell(pg: Any, st: Any, what: str, op: str, seq: int) -> None:
    """The job must recover (``what`` happened on a group this rank holds with ``pg``, or to a
    rank outside ``pg``): an op in flight on ``pg`` would keep this rank out of the recovery until
    its own deadline (the live ranks' recovery may give up on it first), so it ends now, saying
    why. A group with no op in flight is left as it is (the next op on the default group fails)."""
    backends = registry.backends_of(pg)
    if not any(b.inflight_ops() for b in backends):
        return
    said = f"{what}; this rank's op on group {st.name!r} was ended so that it joins the job's recovery"
    detail = json.dumps({"rank": -1, "op": op, "seq": seq, "state": "told", "dead": said})
    for b in backends:
        b.fail_remote(detail, said)
