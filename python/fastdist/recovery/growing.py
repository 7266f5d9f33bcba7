"""Growing back after a shrink: a process that joins a job that shrank (``recover(allow_shrink=
True)`` left a dead rank out) is admitted by :func:`grow`, which the live ranks call at a step
boundary, and the world returns to its size.

The world's size and its epoch (one more at each shrink or growth) are in the job's store
(``world``: "EPOCH:SIZE", written by rank 0 of each new world). A process that joins while the
world is smaller than the launch made it is a *grower*: it makes its groups on stand-in backends
as rank SIZE of SIZE + 1 (fastdist.recovery.joining), then :func:`fastdist.sync_state` asks to be
admitted: it claims ``grow/EPOCH/request``, and waits for the live ranks' decision.

What :func:`grow` costs when nobody waits: reading two attributes (no store traffic, no system
call). Every live rank has a thread blocked in a store wait on ``grow/EPOCH/target`` (rank 0 also
on the request): no CPU, no polling. When the request comes, rank 0's next ``grow()`` call, its
K-th since the world last changed, sets the target to K + MARGIN; every rank runs the growth at
its call number K + MARGIN, the same point of the training loop everywhere (ranks in step stay
within one step of each other, so the target reaches every rank's watcher before its call).

The growth itself: the live ranks and the grower count in (the last one in closes the round;
at the deadline a rank closes it as failed, and the live ranks go on at their size); the default
group is rebuilt at SIZE + 1 (the grower is rank SIZE), DDP modules move to it as a shrink moves
them, and rank 0 sends the state to the grower over it (fastdist.recovery.state_sync).
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from ..deadlines import (
    TimeoutLike,
    check_timeout,
    current_time,
    effective_deadline,
    get_default_timeout,
    validate_seconds,
)
from ..diagnostics import events
from ..errors import RecoveryError
from ..groups import pgstate, registry
from ..ops import listener
from ..store import keywait
from ..store.job import JOB
from . import joining, reconcile, state_sync, wrappers
from .agreement import set_latest
from .handover import hand_over
from .rebuild import rebuild_default
from .recover import recover_joining
from .world import arm, grow_key, world_key

logger = logging.getLogger(__name__)

# grow() calls between rank 0 seeing a request and the growth, on every rank.
MARGIN = 3


def grow(state: Any, *, timeout: TimeoutLike = None) -> bool:
    """Admits a process waiting to join a job that shrank, at a step boundary: call it on every
    live rank once per step, at the same point of the loop. Returns False at once when nobody
    waits (no store traffic, no system call); True when a process joined: the default group is
    then one rank larger (the newcomer is its last rank), DDP modules train on it, and the
    newcomer holds ``state`` (a dict of Statefuls, as :func:`sync_state` takes).

    The growth happens ``MARGIN`` calls after rank 0 learns of the request, on every rank at the
    same call. When the newcomer does not turn up within ``timeout`` (default: the default
    timeout) the live ranks go on at their size and this returns False.
    """
    state = state_sync.check_state(state)
    if timeout is not None:
        validate_seconds(timeout, "timeout")
    g = JOB.world
    if not g.armed:
        return False
    g.calls += 1
    if g.target is None:
        if g.requested:  # rank 0: tell every rank when
            g.requested = False
            JOB.store.set(grow_key(g.epoch, "target"), str(g.calls + MARGIN))
        return False
    if g.calls < g.target:
        return False
    if g.calls > g.target:
        raise RecoveryError(
            group="default",
            rank=dist.get_rank(),
            generation=-1,
            missing_ranks=None,
            retryable=False,
            reason=f"this rank learnt of the growth due at grow() call #{g.target} only at call "
            f"#{g.calls}: call fastdist.grow() once per step, at the same point, on every rank",
        )
    return _grow(state, _deadline(timeout), newcomer=False)


def _deadline(timeout: TimeoutLike) -> float:
    return effective_deadline(timeout if timeout is not None else get_default_timeout(), current_time())


def sync_state(state: Any, *, timeout: TimeoutLike = None, snapshot: Any = None) -> bool:
    """Loads the live ranks' state into ``state`` on a process that joined a running job, and
    returns True; returns False at once on a first start (nothing to load).

    ``state`` is a dict of objects with ``state_dict()`` / ``load_state_dict()`` (what
    ``torch.distributed.checkpoint`` takes: the model, the optimizer, the user's step counter),
    built as on a first start. A joiner takes a dead rank's place at the live ranks'
    ``recover(state=...)``, or, when the job shrank since it was launched, is admitted by their
    :func:`grow` as one rank more: either way every group it made is connected for real, and a
    live rank sends its state over the default group. Bounded by ``timeout`` (default: the
    default timeout); raises :class:`RecoveryError` when the live ranks do not take it in, or
    when ``state`` holds sharded tensors (FSDP2) and no ``snapshot`` (a
    :class:`fastdist.PeerSnapshot` of ``state``, made before this call): with one, the joiner
    receives its predecessor's shards from a rank that holds a copy, and the whole job rolls back
    to that snapshot.
    """
    # Checked here, on a first start too: recover_joining returns False before it needs one.
    check_timeout(timeout)
    if not JOB.world.grower:
        return recover_joining(state, timeout=timeout, snapshot=snapshot)
    _join(state_sync.check_state(state), _deadline(timeout))
    return True


def _join(state: dict[str, Any], deadline: float) -> None:
    """On a grower: asks the live ranks to admit it and takes part in the growth."""
    g = JOB.world
    mine = str(dist.get_rank())
    if bytes(JOB.store.compare_set(grow_key(g.epoch, "request"), "", mine)) != mine.encode():
        raise _failed("another process is joining the shrunk job: start this one after it has joined")
    if not keywait.wait_key(JOB.store, grow_key(g.epoch, "admit"), deadline):
        raise _failed(
            "the live ranks did not admit this process before the timeout: do they call "
            "fastdist.grow(state) at each step?"
        )
    if not _grow(state, deadline, newcomer=True):
        raise _failed("the growth timed out: a live rank did not count in")
    g.grower = False


def _failed(reason: str) -> RecoveryError:
    return RecoveryError(
        group="default",
        rank=dist.get_rank(),
        generation=-1,
        missing_ranks=None,
        reason=reason,
        retryable=False,
    )


def _grow(state: dict[str, Any] | None, deadline: float, *, newcomer: bool) -> bool:
    g = JOB.world
    store, epoch, start = JOB.store, g.epoch, current_time()
    old = dist.distributed_c10d._get_default_group()
    st = pgstate.state_of(old)
    admit = grow_key(epoch, "admit")
    if newcomer:
        gen_s, _, size_s = bytes(store.get(admit)).decode().partition(":")
        gen, size = int(gen_s), int(size_s)
        me = size
    else:
        gen, size, me = st.generation + 1, st.size, st.rank
        if me == 0:
            store.set(admit, f"{gen}:{size}")
    # Count in: the last one in closes the round; at the deadline it closes as failed.
    closed = grow_key(epoch, "closed")
    if store.add(grow_key(epoch, "count"), 1) >= size + 1:
        store.compare_set(closed, "", "all")
    keywait.wait_key(store, closed, deadline, lambda: store.compare_set(closed, "", "failed"))
    if bytes(store.get(closed)) != b"all":
        if not newcomer:
            logger.warning(
                "rank %d: the process that asked to join did not turn up; training on at %d", me, size
            )
            if me == 0:
                store.set(world_key(), f"{epoch + 1}:{size}")
            arm(epoch + 1, me, size)
        return False
    pgstate.set_generation(st.name, gen)  # (the newcomer's own count is not the live ranks')
    st.generation = gen
    old_groups = registry.watched_groups() or [old]
    pgstate.hold(old)
    if newcomer:
        joining.set_pending(False)
    new = rebuild_default(gen, me, size + 1)
    wrappers.reset_ddp(old_groups, new)
    wrappers.fresh_ddp_reducers([new])
    registry.retire(old_groups)
    pgstate.release_finished()
    new_st = pgstate.state_of(new)
    hand_over(new, new_st, gen, state, [size], deadline)
    reconcile.renumber(new_st)  # (the hand-over's sends were numbered on rank 0 only)
    if me == 0:
        store.set(world_key(), f"{epoch + 1}:{size + 1}")
        # The generation is used: a later recovery (or a replacement's) agrees on the next one.
        set_latest(JOB.root, st.name, gen)
    listener.restart(dist.distributed_c10d._get_default_store(), me)
    arm(epoch + 1, me, size + 1)
    logger.info("rank %d: the world grew to %d ranks (generation %d)", me, size + 1, gen)
    events.emit(
        "grow", me, new_st.name, gen, world_size=size + 1, joined=size, recovery=current_time() - start
    )
    return True
