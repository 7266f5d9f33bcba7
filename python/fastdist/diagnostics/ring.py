"""Ringing a group: the first rank to report a fault on a group tells every other live rank.

The ring goes down a binary tree of the group's ranks, rooted at the ringer, each rank forwarding
it to its two children (fastdist.diagnostics.listener), so every rank does O(1) store operations
and the last one hears it after about log2(N) hops. A group of at most ``pgstate.FLAT_RING_MAX``
ranks is rung by the ringer alone, directly (the tree: ``GroupState.ring_children``): a push costs
a store round trip (about 0.1 ms), a hop a listener's wake-up, a parse and a push (about 1 ms on a
loaded host). Each rank's inbox is a store queue (``inbox/RANK``).

A timeout's ring is pushed from C++ (``NativeReport`` in csrc/watched/watched.h) as soon as the
error's builder has the GIL, or instead of Python when it does not get it in time; the report
(fastdist.diagnostics.board) then finds the claim its own.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from ..groups import pgstate
from ..store import keys
from ..store.etcd import queues_of

if TYPE_CHECKING:
    from ..groups.pgstate import GroupState

logger = logging.getLogger(__name__)


def deliver(store: Any, global_rank: int, record: str) -> None:
    queues_of(store).queue_push(keys.inbox(global_rank), record)


def dead_of(record: dict[str, Any]) -> frozenset[int]:
    ranks = record.get("dead_ranks")
    return frozenset(r for r in ranks if isinstance(r, int)) if isinstance(ranks, list) else frozenset()


def gil_note(record: dict[str, Any]) -> str:
    """For a fault record that C++ made because the ringer's Python could not run at its deadline
    (``"gil": true``; see ``NativeReport`` in csrc/watched/watched.h): says so, else ``""``."""
    if record.get("gil") is not True:
        return ""
    return (
        " (its Python could not run within 0.2 s of its deadline: a thread there held the GIL, or its "
        "host was starved; fastdist reported it from C++)"
    )


def _record(st: GroupState, status: dict[str, Any]) -> str:
    return json.dumps(
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


def ring(st: GroupState, status: dict[str, Any]) -> None:
    """Rings the group of ``st``: this rank reported its fault first (``status``: its record)."""
    if st.store is None:
        return
    record = _record(st, status)
    try:
        for child in st.ring_children(st.rank, dead_of(status)):
            deliver(st.store, child, record)
    except RuntimeError as exc:  # a store without queues (FileStore): the others find out at their deadline
        logger.debug("fastdist: could not ring the group: %r", exc)


def ring_missed(st: GroupState, status: dict[str, Any], posted: set[int]) -> int:
    """Rings again, directly, each rank that has not posted (``posted``: group ranks) and whose
    parent in the tree has not either: a parent that died unannounced (a whole node lost) holds
    its subtree's ring, which would otherwise learn of the fault only at its own deadline (and
    be named dead in the report). Called by the ringer halfway through its report's window;
    returns how many it rang."""
    if st.store is None:
        return 0
    record = _record(st, status)
    dead = dead_of(status)
    rung = 0
    for pos in range(1, st.size):
        rank = (st.rank + pos) % st.size
        parent = (st.rank + pgstate.ring_parent_position(pos, st.size)) % st.size
        if rank in posted or parent in posted or st.global_rank(rank) in dead:
            continue
        deliver(st.store, st.global_rank(rank), record)
        rung += 1
    return rung
