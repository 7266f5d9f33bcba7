"""The world's size and epoch, and the watchers that learn a grower waits (see
fastdist.recovery.growing): what a shrink in :func:`fastdist.recover` and a growth in
:func:`fastdist.grow` both change, kept below both.

The world's size and its epoch (one more at each shrink or growth) are in the job's store
(``world``: "EPOCH:SIZE", written by rank 0 of each new world). While the world is smaller than
the launch made it, every live rank has a thread blocked in a store wait on ``grow/EPOCH/target``
(rank 0 also on ``grow/EPOCH/request``): no CPU, no polling; what they learn is read by grow().
"""

from __future__ import annotations

import datetime
import logging
import threading
from typing import Any

from ..store import keys
from ..store.job import JOB

logger = logging.getLogger(__name__)

_FOREVER = datetime.timedelta(days=3650)
_STALE = "stale"  # what ends the watchers of an epoch that is over


def world_key() -> str:
    """The store key of the world's epoch and size (``world``: "EPOCH:SIZE")."""
    return keys.key("world")


def grow_key(epoch: int, what: str) -> str:
    """The store key ``grow/EPOCH/WHAT`` of the growth in ``epoch`` (``what``: ``target``,
    ``request``, ...)."""
    return keys.key("grow", epoch, what)


def read_world(store: Any) -> tuple[int, int] | None:
    """(epoch, size) of the world as the last shrink or growth left it; None before any."""
    if not store.check([world_key()]):
        return None
    epoch, _, size = bytes(store.get(world_key())).decode().partition(":")
    return int(epoch), int(size)


def prepare_growth(epoch: int, launched: int, grower: bool) -> None:
    """At init (after the job's store is recorded): the world's epoch, and whether this process
    is a grower."""
    g = JOB.world
    with g.lock:
        g.epoch, g.launched, g.grower = epoch, launched, grower


def arm(epoch: int, rank: int, size: int) -> None:
    """Once the world changed (a shrink, a growth): watches for a grower in the new epoch while
    the world is smaller than launched. Each watcher is a thread blocked in a store wait on a
    connection of its own."""
    g, store = JOB.world, JOB.store
    with g.lock:
        old, was_armed = g.epoch, g.armed
        g.epoch, g.calls, g.requested, g.target = epoch, 0, False, None
        g.armed = store is not None and size < g.launched
    if was_armed and rank == 0 and old != epoch:
        # The last epoch's watchers (on every rank) still wait: their keys end them (one
        # thread and one connection each would be left behind per shrink).
        for what in ("target", "request"):
            store.compare_set(grow_key(old, what), "", _STALE)
    if not g.armed:
        return
    _watch(store, grow_key(epoch, "target"), epoch, _on_target)
    if rank == 0:
        _watch(store, grow_key(epoch, "request"), epoch, _on_request)


def shrunk(rank: int, size: int) -> None:
    """recover() left ranks out: a new world epoch, recorded by its rank 0 (``rank``, ``size``:
    this rank's place in the new world and its size)."""
    g, store = JOB.world, JOB.store
    if store is None:
        return
    if rank == 0:
        store.set(world_key(), f"{g.epoch + 1}:{size}")
    arm(g.epoch + 1, rank, size)


def _watch(store: Any, name: str, epoch: int, then: Any) -> None:
    def run() -> None:
        try:
            conn = store.clone()
            conn.set_timeout(_FOREVER)
            conn.wait([name])
            value = bytes(conn.get(name)).decode()
        except Exception as exc:  # noqa: BLE001 - the store went away (job end): nobody grows
            logger.debug("fastdist: the grow watcher on %s stops: %r", name, exc)
            return
        with JOB.world.lock:
            if JOB.world.epoch == epoch and value != _STALE:
                then(value)

    threading.Thread(target=run, name="fastdist-grow", daemon=True).start()


def _on_request(_value: str) -> None:
    JOB.world.requested = True


def _on_target(value: str) -> None:
    JOB.world.target = int(value)
