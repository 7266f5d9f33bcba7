"""Ringing a group: the first rank to report a fault on a group tells every other live rank.

The ring goes down a binary tree of the group's ranks, rooted at the ringer, each rank forwarding
it to its two children (fastdist.ops.listener), so every rank does O(1) store operations
and the last one hears it after about log2(N) hops. A group of at most :data:`FLAT_RING_MAX`
ranks is rung by the ringer alone, directly: a push costs a store round trip (about 0.1 ms), a
hop a listener's wake-up, a parse and a push (about 1 ms on a loaded host). Each rank's inbox is a
store queue (``inbox/RANK``).

This module is the tree and the push; what is rung, and when, is the board's
(fastdist.store.board). A timeout's ring is pushed from C++ (``NativeReport`` in
csrc/watched/watched.h) as soon as the error's builder has the GIL, or instead of Python when it
does not get it in time; the report then finds the claim its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import keys
from .etcd import queues_of

# Groups of up to this many ranks are rung by the ringer directly, not down a tree.
FLAT_RING_MAX = 4


def child_positions(pos: int, size: int) -> range:
    """The positions (from the root, 0) of the children of position ``pos`` in the ring tree."""
    if size <= FLAT_RING_MAX:
        return range(1, size) if pos == 0 else range(0)
    return range(2 * pos + 1, min(2 * pos + 3, size))


def parent_position(pos: int, size: int) -> int:
    """The position of the parent of position ``pos`` (> 0) in the ring tree."""
    return 0 if size <= FLAT_RING_MAX else (pos - 1) // 2


def children(
    rank: int, root: int, size: int, table: Sequence[int] | None, dead: frozenset[int] = frozenset()
) -> list[int]:
    """The children of group rank ``rank`` in the ring tree rooted at group rank ``root``, as
    global ranks (``table``: group rank -> global rank, None for the identity); a child in
    ``dead`` (global ranks known dead) is skipped for its own children, so that its subtree is
    still rung."""
    out: list[int] = []
    todo = [(rank - root) % size]
    while todo:
        pos = todo.pop()
        for c in child_positions(pos, size):
            g = (root + c) % size
            child = g if table is None else table[g]
            if child in dead:
                todo.append(c)
            else:
                out.append(child)
    return out


def deliver(store: Any, global_rank: int, record: str) -> None:
    """Pushes ``record`` to the inbox of ``global_rank``."""
    queues_of(store).queue_push(keys.inbox(global_rank), record)


def dead_of(record: dict[str, Any]) -> frozenset[int]:
    """The global ranks a fault record names dead."""
    ranks = record.get("dead_ranks")
    return frozenset(r for r in ranks if isinstance(r, int)) if isinstance(ranks, list) else frozenset()
