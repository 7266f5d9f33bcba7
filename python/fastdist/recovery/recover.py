"""Recovering a failed group in place.

``fastdist.recover()``, called by every live rank after a timeout or
a :class:`GroupAbortedError`, rebuilds the group without restarting the processes:

1. The ranks agree on a new generation through the store: each adds itself to the generation's
   member list. The round closes when every rank of the old group is in or, with
   ``allow_shrink=True``, when the first rank's deadline passes; ``compare_set`` makes the first
   closing decision the one every rank sees. A round that failed (a rank missing, no shrink)
   agreed nothing: the generation's next round waits for every rank anew, so recover() can be
   called again.
2. The dead group is retired without running its destructor on this thread (fastdist holds it
   until its in-flight op has ended, then lets it go).
3. A fresh group is built on the members, under a store prefix of its own, renumbered in order
   of their old ranks. It replaces the default group when the default group is the one that died.
4. The members compare how far each one's state got (fastdist.recovery.reconcile: one all-gather
   of op counts), and the live rank that got least far hands its state (``state=``) to the ranks
   that joined and to every live rank that got further, so that every member holds the same
   state. The group's ops are then numbered from 1 again on every member.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch.distributed as dist

from ..deadlines import (
    TimeoutLike,
    current_time,
    effective_deadline,
    get_default_timeout,
)
from ..diagnostics import events
from ..errors import RecoveryError
from ..groups import abort, pgstate, registry
from ..ops import listener
from ..store import job, keys
from ..store.bounded import GRACE_SECONDS, bounded, stuck
from ..store.job import JOB
from . import joining, reconcile, state_sync, world, wrappers
from .agreement import (
    GenerationTaken,
    _agree,
    _joiners,
    _joiners_key,
    _naming_the_absent,
    _place_open,
    party_of,
    read_latest,
)
from .handover import _ddp_layouts, _reconcile
from .rebuild import _rebuild_in_place, rebuild_default
from .snapshot import PeerSnapshot, halt_all

logger = logging.getLogger(__name__)


# A key written through the default group's store at init: a new connection must see it.
LINEAGE_PROBE = keys.key("lineage")


def _step_of(state: Any, snapshot: Any) -> int | None:
    """The step a joiner was handed, for fastdist run's line: the snapshot it rolled back to, else
    an int ``step`` (or ``global_step``) attribute of an entry of its state (a Progress); None."""
    restored = getattr(snapshot, "restored_step", None)
    if isinstance(restored, int):
        return restored
    for value in (state or {}).values():
        for name in ("step", "global_step"):
            step = getattr(value, name, None)
            if isinstance(step, int) and not isinstance(step, bool):
                return step
    return None


def recover_joining(state: Any, *, timeout: TimeoutLike = None, snapshot: Any = None) -> bool:
    """fastdist.sync_state on a process that takes a dead rank's place (or on a first start: False
    at once): it joins the live ranks' next ``recover(state=...)`` and loads their state."""
    state = state_sync.check_state(state)
    _check_snapshot(snapshot, state)
    if not joining.is_pending():
        return False
    if timeout is None:
        timeout = get_default_timeout()
    pg = dist.distributed_c10d._get_default_group()
    st = pgstate.state_of(pg)
    # The live ranks agree on the generation after the last one agreed: this rank's next. Unless
    # the last one was agreed with the process this one replaces, which died before it went on
    # to the rebuild: the others wait for this rank in that rebuild, and this process takes its
    # place there.
    latest = read_latest(JOB.root, st.name)
    open_place = latest >= 1 and _place_open(JOB.root, party_of(st), latest)
    st.generation = latest - 1 if open_place else latest
    deadline = effective_deadline(timeout, current_time())
    while True:
        try:
            recover(timeout=max(0.0, deadline - current_time()), state=state, snapshot=snapshot)
            break
        except GenerationTaken:
            # The rank this process replaces died inside a recovery, counted into the generation
            # the live ranks agreed: their rebuild fails on it, and they agree the next one.
            if current_time() >= deadline:
                raise
        except RecoveryError as err:
            # The rank handing this one the state died or stalled mid-way: the live ranks recover
            # again (steps.redo_after_fault), and this rank joins that recovery.
            if not err.retryable or current_time() >= deadline:
                raise
            logger.warning("fastdist: %s; joining the live ranks' next recovery", err)
    joining.set_pending(False)
    job.joined(dist.get_rank(), step=_step_of(state, snapshot))
    job.answering(dist.get_rank())  # a peer's timeout may have named this rank before it joined
    listener.start(dist.distributed_c10d._get_default_store(), dist.get_rank())
    return True


def _check_snapshot(snapshot: Any, state: Any) -> None:
    if snapshot is None:
        return
    if not isinstance(snapshot, PeerSnapshot):
        raise TypeError(f"snapshot must be a fastdist.PeerSnapshot, got {type(snapshot).__name__}")
    if state is None or set(snapshot.state) != set(state):
        raise ValueError("snapshot must be a PeerSnapshot of the same state (the same keys) as state=")


def recover(
    group: Any = None,
    *,
    timeout: TimeoutLike = None,
    allow_shrink: bool = False,
    state: Any = None,
    snapshot: Any = None,
) -> Any:
    """Rebuilds ``group`` (default: the default group) after a timeout or a
    :class:`GroupAbortedError`; every live rank of the group must call it. Returns the new group
    (for the default group, it also becomes the default).

    Without ``allow_shrink`` every rank must turn up before ``timeout``, else
    :class:`RecoveryError` names the missing ones, and ``recover()`` may be called again: it
    succeeds once every rank turns up. With ``allow_shrink=True`` the ranks that have
    not turned up by the first rank's deadline are left out and the rest are renumbered in the
    order of their old ranks; a rank that turns up later gets :class:`RecoveryError`.

    On NCCL the timed-out group's communicators are still being aborted when the timeout is
    raised; ``recover`` waits for that abort first (torch's abort frees device memory, so it
    also waits for kernels still running on the GPU), bounded by ``FASTDIST_ABORT_TIMEOUT``.

    ``state`` (a dict of Statefuls, as :func:`sync_state` takes): the live ranks' states are
    reconciled with it. A fault can split them: a rank that died mid-all-reduce lets one
    neighbour's all-reduce return (it applies the step's update) and not another's. The live rank
    whose state got least far (the fewest of the group's ops completed; ties: the lowest rank)
    sends its state to every live rank that got further, and to each process that joined in the
    place of a dead rank (a replacement or a spare), so that every member holds the same state and
    the step is redone once, everywhere (a loop that keeps its position in ``state``, as the
    README's does, redoes it). Without ``state`` a joiner cannot be brought up to date, and
    recovery raises :class:`RecoveryError` on every rank rather than train on with a rank that
    holds other weights; live ranks that got unequally far are named in a warning (their models
    may differ). Sharded state (FSDP2) that cannot be reconciled so raises
    :class:`RecoveryError` on every rank.

    ``snapshot`` (a :class:`fastdist.PeerSnapshot` of ``state``): when a joiner takes a dead
    rank's place and ``state`` is sharded (FSDP2), every rank loads the newest snapshot whose
    copies cover every rank (the joiner its predecessor's copy, from a rank that holds it), so the
    job rolls back to it; ``snapshot.restored_step`` says which step (None: no roll-back, as after
    a stall). The group is returned as always.
    """
    if state is not None:
        state = state_sync.check_state(state)
    _check_snapshot(snapshot, state)
    if snapshot is not None:
        snapshot.restored_step = None  # this recovery's roll-back, if any, sets it
    start = current_time()
    deadline = effective_deadline(timeout, start)
    if not isinstance(allow_shrink, bool):
        raise TypeError(f"allow_shrink must be a bool, got {type(allow_shrink).__name__}: {allow_shrink!r}")
    pg = pgstate.resolve(group)
    if pg is None:
        raise ValueError("this process is not a member of the group it asked to recover")
    return _one_at_a_time(pg, deadline, lambda: _recover(pg, start, deadline, allow_shrink, state, snapshot))


def _one_at_a_time(pg: Any, deadline: float, attempt: Any) -> Any:
    """Runs ``attempt``, the recovery of ``pg``, unless another thread's runs: then waits for it
    and shares its outcome (see pgstate.Turns)."""
    turns = pgstate.state_of(pg).turns
    with turns.cond:
        if turns.running:
            seen = turns.finished
            turns.waiting += 1
            try:
                ok = turns.cond.wait_for(
                    lambda: turns.finished > seen, timeout=max(0.0, min(deadline - current_time(), 1e6))
                )
                result, error = turns.outcome
            finally:
                turns.waiting -= 1
                if turns.waiting == 0:
                    turns.outcome = (None, None)
            if not ok:
                st = pgstate.state_of(pg)
                raise st.recovery_error(
                    st.generation + 1,
                    "another thread of this rank is recovering the group, and it did not finish "
                    "within this call's timeout",
                )
            if error is not None:
                raise error
            return result
        turns.running = True
    result, error = None, None
    try:
        result = attempt()
        return result
    except BaseException as exc:
        error = exc
        raise
    finally:
        with turns.cond:
            turns.running = False
            turns.finished += 1
            if turns.waiting:
                turns.outcome = (result, error)
            turns.cond.notify_all()


def _recover(
    pg: Any,
    start: float,
    deadline: float,
    allow_shrink: bool,
    state: dict[str, Any] | None,
    snapshot: PeerSnapshot | None = None,
) -> Any:
    st = pgstate.state_of(pg)
    is_default = dist.is_initialized() and pg is dist.distributed_c10d._get_default_group()
    joiner = joining.is_pending() and is_default
    # How far this rank's state got, before anything renumbers the group's ops (-1: a joiner).
    held = (-1, -1) if joiner else reconcile.begin(st)
    name = st.name
    if is_default:
        halt_all()  # a snapshot exchange in flight issues nothing on the groups rebuilt below
    if is_default and JOB.root is None:
        JOB.backend, JOB.timeout = dist.get_backend(), None
        JOB.root = dist.distributed_c10d._get_default_store()
    store = JOB.root if is_default else st.store
    gen = st.generation + 1
    me = st.my_global_rank
    if not joiner:
        job.answering(me)  # fastdist run's agent must not kill a rank a peer named missing earlier
    if store is None:
        raise st.recovery_error(gen, "the group has no store to agree through")

    try:
        if stuck():
            # A store call given up on earlier (a partition) still holds the old connection until
            # TCP's next retransmission, which backs off to minutes (and clone() waits behind it
            # too): a new connection answers at once once the network is back.
            make = JOB.reconnect or store.clone
            store = bounded(lambda _a: make(), deadline - current_time() + GRACE_SECONDS, "a new connection")
            if is_default:
                JOB.root = store
        # Bounded: a store cut off by the network would otherwise hold this rank for minutes.
        party = party_of(st)
        with _naming_the_absent(store, party, gen, joiner):
            members = bounded(
                lambda abandoned: _agree(store, party, gen, deadline, allow_shrink, abandoned, joiner),
                deadline - current_time() + GRACE_SECONDS,
                "the recovery agreement's store work",
            )
    except GenerationTaken:
        pgstate.next_generation(st.name)
        st.generation = gen
        raise
    except (RuntimeError, ConnectionError) as exc:  # dist.DistError and its kin: the store is gone
        JOB.note_store_failure(exc)
        raise st.recovery_error(gen, JOB.store_gone_reason()) from None
    new_rank, new_size = members.index(me), len(members)
    pgstate.next_generation(st.name)
    # The agreed generation is used up, whatever happens next: if a member vanishes while the
    # group is rebuilt (RecoveryError at the deadline), the next recover() agrees on the one after.
    st.generation = gen
    # Either way the groups number their ops afresh: their histories go to the metrics first.
    for g in registry.watched_groups() if is_default else [pg]:
        events.retire(pgstate.state_of(g).name, registry.history(g))
    if len(members) == st.size and registry.is_watched(pg):
        # Everyone came back: rebuild in place, under the same ProcessGroup objects that DDP,
        # FSDP2, DeviceMesh and user code hold.
        if not abort.wait_aborts():
            logger.warning(
                "rank %d: torch is still aborting the communicators of a timed-out group; rebuilding anyway",
                me,
            )
        groups = _rebuild_in_place(pg, is_default, gen, deadline)
        wrappers.reset_ddp(groups)
        wrappers.reset_fsdp()
        logger.info("rank %d: group %r rebuilt in place as generation %d", me, st.name, gen)
        joiners = _joiners(store, st.name, gen) if is_default else []
        published: list[str] = []
        if joiners:
            layouts, published = _ddp_layouts(store, st, gen, groups, joiners, deadline)
            wrappers.fresh_ddp_reducers(groups, layouts)
        _reconcile(pg, st, name, gen, state, snapshot, joiners, held, deadline)
        if joiners and me == joiners[0]:  # every member read the list before the hand-over's barrier
            with contextlib.suppress(RuntimeError):  # a store without delete keeps it
                store.delete_key(_joiners_key(st.name, gen))
        for key in published:  # every member read it before _reconcile's exchange
            with contextlib.suppress(RuntimeError):
                store.delete_key(key)
        for j in joiners:
            events.emit("replacement", me, st.name, gen, replaced_rank=j)
        events.emit(
            "recovery",
            me,
            st.name,
            gen,
            world_size=st.size,
            in_place=True,
            joiners=joiners,
            recovery=current_time() - start,
        )
        return pg
    if st.dead_reason is None:
        st.mark_dead("replaced by fastdist.recover()", level=logging.INFO)
    if not abort.wait_aborts():
        logger.warning(
            "rank %d: torch is still aborting the communicators of a timed-out group; rebuilding anyway", me
        )
    pgstate.hold(pg)
    if is_default:
        old_groups = registry.watched_groups() or [pg]
        new = rebuild_default(gen, new_rank, new_size)
        wrappers.reset_ddp(old_groups, new)
        registry.retire(old_groups)
    else:
        new = dist.new_group(members, timeout=JOB.timeout, use_local_synchronization=True)
        registry.retire([pg])
    pgstate.release_finished()
    logger.info(
        "rank %d: group %r rebuilt as generation %d: rank %d of %d", me, st.name, gen, new_rank, new_size
    )
    left_out = sorted(set(st.global_ranks or range(st.size)) - set(members))
    events.emit("shrink", me, st.name, gen, world_size=new_size, left_out=left_out)
    if is_default:
        # This rank's inbox is its new rank's, in the new group's store.
        listener.restart(dist.distributed_c10d._get_default_store(), new_rank)
        world.shrunk(new_rank, new_size)
    if registry.is_watched(new):  # (an op on a group fastdist does not watch is not bounded)
        _reconcile(new, pgstate.state_of(new), name, gen, state, snapshot, [], held, deadline)
    else:
        reconcile.forget(st)
    events.emit(
        "recovery", me, st.name, gen, world_size=new_size, in_place=False, recovery=current_time() - start
    )
    return new
