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
import datetime
import logging
import re
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from ..deadlines import (
    TimeoutLike,
    current_time,
    effective_deadline,
    fail_at,
    get_default_timeout,
)
from ..diagnostics import events, listener
from ..errors import FastdistError, RecoveryError
from ..groups import abort, pgstate, registry
from ..store import board, job, keys, keywait, seal
from ..store.bounded import GRACE_SECONDS, StoreUnanswered, bounded, stuck
from ..store.job import JOB
from . import joining, reconcile, state_sync, world, wrappers
from .snapshot import PeerSnapshot, halt_all, load_into, newest_covering, own_copy, replicas

logger = logging.getLogger(__name__)


# A key written through the default group's store at init: a new connection must see it.
LINEAGE_PROBE = keys.key("lineage")


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
    open_place = latest >= 1 and _place_open(JOB.root, st, latest)
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
    job.joined(dist.get_rank())
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
        with _naming_the_absent(store, st, gen, joiner):
            members = bounded(
                lambda abandoned: _agree(store, st, gen, deadline, allow_shrink, abandoned, joiner),
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
        joiners = _joiners(store, st, gen) if is_default else []
        published: list[str] = []
        if joiners:
            layouts, published = _ddp_layouts(store, st, gen, groups, joiners, deadline)
            wrappers.fresh_ddp_reducers(groups, layouts)
        _reconcile(pg, st, name, gen, state, snapshot, joiners, held, deadline)
        if joiners and me == joiners[0]:  # every member read the list before the hand-over's barrier
            with contextlib.suppress(RuntimeError):  # a store without delete keeps it
                store.delete_key(_joiners_key(st, gen))
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


def latest_key(name: str) -> str:
    """The last generation of group ``name`` that its members agreed (a signed record)."""
    return f"{keys.key('recover', name)}/latest"


def set_latest(store: Any, name: str, gen: int) -> None:
    """Records ``gen`` as group ``name``'s last agreed generation, signed with the job's secret
    (fastdist.store.seal): a value written by anything else (``add(key, 100)``) is ignored."""
    key = latest_key(name)
    store.set(key, seal.seal(f"{key} {gen}"))


def read_latest(store: Any, name: str) -> int:
    """Group ``name``'s last agreed generation: 0 before the first recovery, or when the record
    is not this job's (a warning says so)."""
    key = latest_key(name)
    if not store.check([key]):
        return 0
    body = seal.opened(store.get(key), "record of the last recovery's generation")
    parts = (body or "").rsplit(" ", 1)
    if len(parts) != 2 or parts[0] != key or not parts[1].isdigit():
        if body is not None:  # (an unsigned one was said by opened)
            logger.warning("fastdist: ignored a malformed record of the last recovery's generation")
        return 0
    return int(parts[1])


def _joiners_key(st: pgstate.GroupState, gen: int) -> str:
    return f"{keys.key('recover', st.name)}/{gen}/joiners"


def _joiners(store: Any, st: pgstate.GroupState, gen: int) -> list[int]:
    """The global ranks that joined the job in generation ``gen`` (replacements, spares)."""
    key = _joiners_key(st, gen)
    if not store.check([key]):
        return []
    # Each line is a joiner's own, signed with the key it was written to (fastdist.store.seal): a
    # line written by anything else, or copied from another generation's key, is ignored.
    out = set()
    for body in seal.opened_lines(bytes(store.get(key)), "joiner record"):
        where, _, rank = body.rpartition(" ")
        if where == key and rank.isdigit():
            out.add(int(rank))
    return sorted(out)


_LAYOUT_FIELDS: dict[str, type | tuple[type, ...]] = {"key": str, "layouts": list}


def _ddp_layouts_key(st: pgstate.GroupState, gen: int, group_name: str) -> str:
    return f"{keys.key('recover', st.name)}/{gen}/ddp/{group_name}"


def _ddp_layouts(
    store: Any,
    st: pgstate.GroupState,
    gen: int,
    groups: list[Any],
    joiners: list[int],
    deadline: float,
) -> tuple[dict[int, list[Any]], list[str]]:
    """The gradient buckets of the DDP modules on each of ``groups`` as the lowest live rank of the
    group has them (wrappers.ddp_layouts), for every member's new reducers: that rank writes its
    own in the store under the generation's keys (for every group it is that rank of, with DDP
    modules or not, so that no member waits for a key nobody writes), and the other members read
    them. Every member then reduces the step after the recovery over the buckets an undisturbed
    run has there. Returns them by ``id`` of the group, and the keys this rank wrote."""
    me = st.my_global_rank
    deadline = max(deadline, current_time() + RECONCILE_SECONDS)
    layouts: dict[int, list[Any]] = {}
    published: list[str] = []
    for g in groups:
        gst = pgstate.state_of(g)

        def fail(why: str, gst: pgstate.GroupState = gst) -> RecoveryError:
            return st.recovery_error(
                gen, f"handing over the buckets of the DDP modules on group {gst.name!r} failed: {why}"
            )

        live = [r for r in (gst.global_rank(i) for i in range(gst.size)) if r not in joiners]
        if not live:  # every member joined anew: all start from DDP's first layout
            continue
        key = _ddp_layouts_key(st, gen, gst.name)
        try:
            if me == live[0]:
                layouts[id(g)] = wrappers.ddp_layouts(g)
                store.set(key, seal.seal_json({"key": key, "layouts": layouts[id(g)]}))
                published.append(key)
                continue
            if not wrappers.ddp_layouts_wanted(g):
                continue
            if not keywait.wait_key(store, key, deadline):
                raise fail(f"rank {live[0]} did not hand them over before the deadline")
            record: Any = keys.parse_record(bytes(store.get(key)), _LAYOUT_FIELDS, "DDP layout record")
            if record is None or record["key"] != key:
                raise fail(f"the record at {key} is not rank {live[0]}'s (not signed with the job's secret)")
            layouts[id(g)] = record["layouts"]
        except (RuntimeError, ConnectionError, ValueError) as exc:  # the store failing, or garbage
            raise fail(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__) from None
    return layouts, published


def _reconcile(
    pg: Any,
    st: pgstate.GroupState,
    name: str,
    gen: int,
    state: dict[str, Any] | None,
    snapshot: PeerSnapshot | None,
    joiners: list[int],
    held: tuple[int, int],
    deadline: float,
) -> None:
    """Leaves every member of the rebuilt group ``pg`` (first called ``name``) with the same
    state: the members exchange how far their state got (``held``: this rank's op count and
    optimizer updates, -1 on a joiner; see fastdist.recovery.reconcile), and the live rank that
    got least far hands its state to the joiners and to every live rank that got further (it may
    have applied an update that the source had not: the step is redone everywhere). Then the
    group's ops are numbered from 1 again on every member."""
    me = st.my_global_rank
    # The agreement may have used all of recover()'s timeout waiting for a rank that never came (a
    # shrink closes at the deadline): the members, known alive now, get a few seconds of their own.
    deadline = max(deadline, current_time() + RECONCILE_SECONDS)
    counts, updates, has = reconcile.exchange(pg, st, gen, held, state is not None, deadline)
    done = reconcile.plan(counts, updates, has, joiners)
    if done is not None and done.diverged:
        reconcile.warn_diverged(me, done)
    ahead = done.ahead if done is not None else []
    alike: list[int] = []
    if done is not None and ahead and not done.applied and state_sync.sharded_entries(state or {}):
        # Their counts differ, yet no live rank applied an optimizer update that the source had not
        # (a broadcast's root completed, say, and a receiver's failed): their shards are alike, and
        # a rank's shards could not be handed to another anyway.
        alike, ahead = ahead, []
    if joiners or ahead:
        hand_over(
            pg,
            st,
            gen,
            state,
            joiners,
            deadline,
            snapshot,
            source=None if done is None else done.source,
            ahead=ahead,
        )
    same = me in joiners or me in ahead or me in alike
    count = counts[done.source] if done is not None and same else held[0]
    reconcile.finish(st, count, done)


# How long the members of a rebuilt group have at least to compare how far each got and hand
# over the state, whatever was left of recover()'s timeout.
RECONCILE_SECONDS = 5.0


def hand_over(
    pg: Any,
    st: pgstate.GroupState,
    gen: int,
    state: dict[str, Any] | None,
    joiners: list[int],
    deadline: float,
    snapshot: PeerSnapshot | None = None,
    *,
    source: int | None = None,
    ahead: list[int] | None = None,
) -> None:
    """A live rank's ``state`` to the ranks that joined; on a joiner, loaded into its ``state``.
    ``source``: the live rank that sends (default: the lowest). ``ahead``: live ranks that got
    further than the source before the group failed (they applied an update that it had not):
    they load its state too. Sharded state replicated along a mesh dimension (HSDP): each of those
    ranks gets its shards from a replica. Sharded state with a snapshot: every rank rolls back to
    the snapshot instead. The caller then numbers the group's ops from 1 again on every member
    (reconcile.renumber: the hand-over's sends are issued by some members only)."""
    ahead = sorted(ahead or [])
    me = st.my_global_rank
    receivers = sorted({*joiners, *ahead})
    names = ", ".join(f"rank {r}" for r in receivers)

    def fail(reason: str, retryable: bool = False) -> RecoveryError:
        return st.recovery_error(gen, reason, retryable=retryable)

    sharded = state_sync.sharded_entries(state) if state is not None else []
    held_twice = replicas(state) if sharded and state is not None else None
    if held_twice is not None and state is not None:
        _from_replicas(pg, st, gen, state, held_twice, joiners, ahead, deadline, fail)
        return
    if sharded and snapshot is not None:
        _roll_back(pg, st, gen, snapshot, joiners, deadline, fail)
        return
    if sharded and joiners:
        raise fail(
            f"{', '.join(f'rank {r}' for r in joiners)} joined in a dead rank's place, but the state "
            f"entries {', '.join(map(repr, sharded))} hold sharded tensors (FSDP2/DTensor): the dead rank's "
            "shards are on no live rank. Keep copies on other ranks (fastdist.PeerSnapshot, passed as "
            "snapshot=), or restart the job from a checkpoint"
        )
    if sharded:
        raise fail(
            f"{_split(ahead, source)}, and the state entries {', '.join(map(repr, sharded))} hold sharded "
            "tensors (FSDP2/DTensor): a rank's shards cannot be replaced by another rank's. Keep copies "
            "on other ranks (fastdist.PeerSnapshot, passed as snapshot=: every rank then rolls back to "
            "it), or restart the job from a checkpoint"
        )
    if len(joiners) >= st.size:
        raise fail(
            "every rank of the group joined anew (all of the first processes died): no live rank holds "
            "the state. Restart the job from a checkpoint"
        )
    if source is None:
        source = joining.source_of(st.size, joiners)
    problem = ""  # why a joiner could not load what it received
    try:
        if me in receivers:
            # A live rank receives into new tensors: its own state stays whole if the transfer
            # fails midway (it may be the source of the next attempt).
            received = state_sync.receive(source, pg, deadline, into=state if me in joiners else None)
            if me in joiners and state is not None and received is not None:
                problem = _load(state, received)
        else:
            received = None
            if me == source:
                state_sync.send(state, receivers, pg, deadline)
        # Every member learns whether the hand-over worked: a joiner that died mid-transfer fails
        # the source's send, and this all-reduce everywhere else; one that could not load the
        # state (the script built other objects there) counts itself in.
        with fail_at(deadline):
            failed = torch.tensor([1 if problem else 0], dtype=torch.int32, device=state_sync.device_of(pg))
            dist.all_reduce(failed, group=pg)
    except FastdistError as exc:
        # A death or a stall mid-way: one more fault, recovered by recovering again (a new
        # replacement, or another source).
        raise fail(f"handing the state to {names} failed: {exc}", retryable=True) from None
    if problem:
        raise fail(f"this rank could not load the state the live ranks handed over: {problem}")
    if int(failed.item()):
        raise fail(
            f"{names} could not load the state handed over (its objects differ from the live ranks': "
            "the script builds another model or optimizer there); its own error says how"
        )
    if state is None:
        raise fail(
            f"{names} joined in a dead rank's place, but recover() was called without state=: "
            "the joiners cannot be brought up to date (pass the same state dict that sync_state() takes)"
        )
    if me not in receivers:
        if me == source and ahead:
            logger.info(
                "rank %d: %s: sent them this rank's state (generation %d)", me, _split(ahead, source), gen
            )
        return
    if received is None:
        raise fail("the live ranks called recover() without state=: there is no state to load")
    if me not in joiners:  # (a joiner loaded it before the all-reduce)
        problem = _load(state, received)
        if problem:
            raise fail(f"this rank could not load the state rank {source} handed over: {problem}")
    if me in ahead:
        logger.info(
            "rank %d: had got further than rank %d when the group failed (it may have applied an update "
            "that rank %d had not): loaded rank %d's state, so that every rank goes on from the same one "
            "(generation %d)",
            me,
            source,
            source,
            source,
            gen,
        )
    else:
        logger.info("rank %d: loaded the state of rank %d (generation %d)", me, source, gen)


def _load(state: dict[str, Any], received: dict[str, Any]) -> str:
    """Loads ``received`` into ``state``; "" or why it could not."""
    if set(received) != set(state):
        return f"the live ranks' state has keys {sorted(received)}, this rank's {sorted(state)}"
    for key, obj in state.items():
        try:
            obj.load_state_dict(received[key])
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:
            text = " ".join(str(exc).split())
            return f"state[{key!r}].load_state_dict: {type(exc).__name__}: {text[:600]}"
    return ""


def _split(ahead: list[int], source: int | None) -> str:
    """Says which live ranks got further than the source before the group failed."""
    who = ("ranks " if len(ahead) > 1 else "rank ") + ", ".join(map(str, ahead))
    return (
        f"the live ranks had not all got as far when the group failed: {who} had got further than rank "
        f"{source} (and may have applied an update that it had not)"
    )


def _from_replicas(
    pg: Any,
    st: pgstate.GroupState,
    gen: int,
    state: dict[str, Any],
    held_twice: dict[int, list[int]],
    joiners: list[int],
    ahead: list[int],
    deadline: float,
    fail: Any,
) -> None:
    """Each joiner receives its predecessor's shards, as they are now, from the lowest live rank
    that holds the same ones (its replica along HSDP's replicate dimension): nothing rolls back.
    A live rank ``ahead`` (it applied an update the others had not) receives its shards so, from a
    replica that had not."""
    me = st.my_global_rank
    receivers = sorted({*joiners, *ahead})
    sources: dict[int, int] = {}
    for j in receivers:
        alive = [r for r in held_twice.get(j, []) if r not in receivers]
        if not alive and j in joiners:
            raise fail(
                f"rank {j} died with every rank that holds the same shards (its replicas: ranks "
                f"{', '.join(map(str, held_twice.get(j, [])))}): no live rank holds them. Restart the job "
                "from a checkpoint (fastdist.load_checkpoint)"
            )
        if not alive:
            raise fail(
                f"rank {j} had applied an update that other live ranks had not when the group failed, and "
                f"so had every live rank that holds the same shards (its replicas: ranks "
                f"{', '.join(map(str, held_twice.get(j, [])))}): no rank holds its shards as they were "
                "before. Keep copies (fastdist.PeerSnapshot, passed as snapshot=), or restart the job "
                "from a checkpoint (fastdist.load_checkpoint)"
            )
        sources[j] = min(alive)
    try:
        received = None
        for j in receivers:
            if me == sources[j]:
                state_sync.send_dicts(own_copy(state), [j], pg, deadline)
            elif me == j:
                received = state_sync.receive(sources[j], pg, deadline)
        if me in receivers:
            if received is None:
                raise fail(f"the shards of rank {me} did not arrive from rank {sources[me]}")
            load_into(state, received)
        with fail_at(deadline):
            dist.barrier(group=pg)
    except FastdistError as exc:
        raise fail(
            f"handing the replicas' shards to {', '.join(map(str, receivers))} failed: {exc}"
        ) from None
    if me in receivers:
        logger.info(
            "rank %d: loaded its shards from its replica, rank %d (generation %d)", me, sources[me], gen
        )


def _roll_back(
    pg: Any,
    st: pgstate.GroupState,
    gen: int,
    snapshot: PeerSnapshot,
    joiners: list[int],
    deadline: float,
    fail: Any,
) -> None:
    """Every member loads the newest snapshot whose copies cover every rank: its own copy, or, on
    a joiner, its predecessor's, sent by the lowest live rank that holds it. Then a snapshot of
    that step is taken afresh, so that the joiner holds its neighbours' copies again."""
    me = st.my_global_rank
    gathered: list[Any] = [None] * st.size
    try:
        with fail_at(deadline):
            dist.all_gather_object(gathered, snapshot.holdings(), group=pg)
    except FastdistError as exc:
        raise fail(f"agreeing on a snapshot failed: {exc}") from None
    live = [r for r in range(st.size) if r not in joiners]
    everyone = gathered
    target = newest_covering(everyone, joiners)
    if target is None:
        raise fail(_no_snapshot(snapshot, joiners, gathered))
    try:
        received = None
        for j in joiners:
            source = min(r for r in live if j in everyone[r].get(target, ()))
            if me == source:
                state_sync.send_dicts(snapshot.copy_of(target, j), [j], pg, deadline)
            elif me == j:
                received = state_sync.receive(source, pg, deadline)
        mine = received if me in joiners else snapshot.copy_of(target, me)
        if mine is None:
            raise fail(f"the copy of rank {me}'s shards did not arrive")
        snapshot.load(mine)
        with fail_at(deadline):
            dist.barrier(group=pg)
        snapshot.restored_step = target
        snapshot.take(target)
    except FastdistError as exc:
        raise fail(f"rolling back to the snapshot of step {target} failed: {exc}") from None
    logger.info("rank %d: rolled back to the snapshot of step %d (generation %d)", me, target, gen)


def _no_snapshot(snapshot: PeerSnapshot, joiners: list[int], gathered: list[Any]) -> str:
    """Why no snapshot covers the dead ranks ``joiners``: whose copies died with them."""
    dead = ("ranks " if len(joiners) > 1 else "rank ") + ", ".join(str(j) for j in joiners)
    why = []
    for j in joiners:
        kept = snapshot.holders[j]
        gone = [h for h in kept if h in joiners]
        where = ", ".join(str(h) for h in kept)
        if len(gone) == len(kept):
            why.append(f"rank {j}'s copies were on rank(s) {where}, dead too")
        else:
            why.append(f"rank {j}'s copies were on rank(s) {where}")
    if not any(gathered):
        why.append("no snapshot was taken yet")
    return (
        f"{dead} died and no snapshot that counted holds all their shards (copies="
        f"{snapshot.copies}): {'; '.join(why)}. Restart the job from a checkpoint "
        "(fastdist.load_checkpoint)"
    )


def _agree(
    store: Any,
    st: pgstate.GroupState,
    gen: int,
    deadline: float,
    allow_shrink: bool,
    abandoned: threading.Event | None = None,
    joiner: bool = False,
) -> list[int]:
    """The sorted global ranks of the new generation, the same on every member. ``abandoned``
    (set when the caller stopped waiting for an unanswering store): this rank must not join the
    agreement late, as a member nobody will see.

    A generation may take several rounds: a round that closed without everyone and without
    ``allow_shrink`` failed (its members got RecoveryError naming the missing ranks), and it
    agreed nothing, so the generation's next round starts afresh. A rank that counts itself into
    a round that had already failed (it came late, or it tries again) moves on to the next one, so
    that ``recover()`` tried again succeeds once every rank turns up."""
    key = keys.key("recover", st.name)
    me = st.my_global_rank
    # The last generation agreed (set by one member of it): 0 before the first recovery.
    latest = read_latest(store, st.name)
    if latest > gen or (latest == gen and not joiner):  # (a joiner may take a dead rank's place)
        raise st.recovery_error(
            gen, f"the other ranks already rebuilt the group as generation {latest} without this rank"
        )
    if joiner:  # before counting in: whoever sees a round complete sees this too
        store.append(_joiners_key(st, gen), seal.seal(f"{_joiners_key(st, gen)} {me}") + "\n")
    turn = 0
    while True:
        base = _round(key, gen, turn)
        if abandoned is not None and abandoned.is_set():
            raise StoreUnanswered("the caller gave up on the store before this rank joined the agreement")
        n, decision = _one_round(store, st, base, deadline, allow_shrink)
        count = st.size if decision == b"all" else _counted(decision)
        if not decision.startswith(b"missing:") or n <= count:
            break
        turn += 1  # this round had failed before this rank came: the next one is open
    st.lineage.rounds[gen] = turn
    if decision == b"all" and n > st.size and joiner and not _went_past(store, base, me):
        # Every place was taken before this rank counted in, its own by the process it replaces
        # (killed inside recover() after it counted in), which died before it left the agreement:
        # the others wait for this rank in the generation's rebuild, and this process takes the
        # dead one's place there, as the joiner it is (listed above, before counting in).
        store.append(f"{base}/past", f"{me}\n")
        return [st.global_rank(r) for r in range(st.size)]
    if decision == b"all" and n > st.size:
        # Every place was taken before this rank counted in: by a process that has died since,
        # after it had gone on to the rebuild (or this rank is no replacement). The others agreed
        # the generation with it, and their rebuild fails on it: the generation is used up, and
        # the next recover() agrees the next one.
        raise GenerationTaken(
            group=st.name,
            rank=me,
            generation=gen,
            missing_ranks=None,
            retryable=True,
            reason="the generation was agreed, before this rank came, by ranks that counted a process "
            "that has died since (a rank killed inside recover()): call recover() again",
        )
    # Whoever closed it first decided for everyone: the last arrival (then no one can have fixed
    # fewer), or a deadline (then the arrivals it counted; a later one is left out).
    if count < st.size and (not allow_shrink or decision.startswith(b"missing:")):
        arrived = _arrivals(store.get(f"{base}/members"), count)
        missing = [st.global_rank(r) for r in range(st.size) if st.global_rank(r) not in arrived]
        raise st.recovery_error(gen, "not every rank turned up before the deadline", missing)
    final = min(count, st.size)
    if n > final:
        raise st.recovery_error(
            gen, "this rank turned up after the others had closed the new generation without it"
        )
    if final >= st.size:
        members = [st.global_rank(r) for r in range(st.size)]
    else:
        members = _members(store, base, final)
    # This rank goes on to the rebuild: a process that replaces it from now on cannot take its
    # place in this generation (the others may have connected to this one).
    store.append(f"{base}/past", f"{me}\n")
    # The generation's housekeeping, shared out by arrival order (at most one operation each
    # from 10 members up): record it as the latest, and delete generation gen - 2's keys (gen - 1's
    # reports stay: a straggler of it, left out, reads them to learn that the others timed out
    # rather than blame them as dead).
    chores = [latest_key(st.name), *_keys_of_generation(st, gen - 2)]
    try:
        for i in range(n - 1, len(chores), final):
            if i == 0:
                set_latest(store, st.name, gen)
            else:
                store.delete_key(chores[i])
    except RuntimeError:  # a store without delete (FileStore): the keys stay
        pass
    return members


def _place_open(store: Any, st: pgstate.GroupState, gen: int) -> bool:
    """Whether generation ``gen`` was agreed with every rank, this one's too, by a process that
    died before it went on to the rebuild (see recover_joining)."""
    key = keys.key("recover", st.name)
    for turn in range(_MAX_ROUNDS):
        base = _round(key, gen, turn)
        if not store.check([f"{base}/closed"]):
            return False
        decision = bytes(store.get(f"{base}/closed"))
        if not decision.startswith(b"missing:"):
            return decision == b"all" and not _went_past(store, base, st.my_global_rank)
    return False


# More failed rounds of one generation than a joiner looks through for the agreed one.
_MAX_ROUNDS = 64


def _went_past(store: Any, base: str, rank: int) -> bool:
    """Whether ``rank``'s process had left the agreement at ``base`` for the rebuild."""
    if not store.check([f"{base}/past"]):
        return False
    return str(rank) in bytes(store.get(f"{base}/past")).decode().split()


class GenerationTaken(RecoveryError):
    """recover() came to a generation that other ranks had already agreed with a process that has
    died since: the generation is used up here too, and recover() called again joins the next."""


def _round(key: str, gen: int, turn: int) -> str:
    """The store prefix of round ``turn`` of generation ``gen``'s agreement."""
    return f"{key}/{gen}" if turn == 0 else f"{key}/{gen}/round{turn}"


def _one_round(
    store: Any, st: pgstate.GroupState, base: str, deadline: float, allow_shrink: bool
) -> tuple[int, bytes]:
    """Counts this rank into the round at ``base``, and waits for its decision: (this rank's
    arrival order, the decision)."""
    # O(1) store operations per rank: an add (arrival order), an append to one member list, and
    # a blocking wait on one key that holds the decision, read once: "all" (set by the last to
    # arrive), or at the first deadline, by that rank's closer, with how many had arrived:
    # "deadline:COUNT" (a closer that allows a shrink: the first COUNT are the members) or
    # "missing:COUNT" (one that does not: the round failed). The member list is read only when
    # the group shrinks: with everyone in, the members are the old ranks.
    n = store.add(f"{base}/count", 1)
    store.append(f"{base}/members", f"{n}:{st.my_global_rank}\n")
    if n >= st.size:
        return n, bytes(store.compare_set(f"{base}/closed", "", "all"))
    gone = st.gone() if allow_shrink else set()
    seen: list[bytes] = []  # the decision, as this rank's closer found it (set or read)
    # The closer and the wait's end can cross: a closer already running when the key came is
    # waited for (its answer is the decision), one that had not started is skipped. Either
    # way the decision costs this rank one read at most.
    closing = threading.Lock()
    woke: list[bool] = []
    what = "deadline" if allow_shrink else "missing"

    def close() -> None:
        with closing:
            if woke:
                return
            count = store.add(f"{base}/count", 0)
            seen.append(bytes(store.compare_set(f"{base}/closed", "", f"{what}:{count}")))

    if gone:
        # This rank saw ranks go (their connections closed, no answer to the ring): the round
        # closes as soon as every other rank is in, not at the deadline. Polled, briefly: the
        # others are on their way. (A presumed-gone rank that turns up after all is left out,
        # as at a deadline.)
        while not seen and current_time() < deadline:
            if store.check([f"{base}/closed"]):
                break
            if store.add(f"{base}/count", 0) >= st.size - len(gone):
                close()
                break
            time.sleep(0.005)
        if not seen and not store.check([f"{base}/closed"]):
            close()
    elif not keywait.wait_key(store, f"{base}/closed", deadline, close):
        raise StoreUnanswered("nobody could close the recovery agreement: the store is failing")
    with closing:
        woke.append(True)
    return n, seen[0] if seen else bytes(store.get(f"{base}/closed"))


# How long the members wait for an arrival counted but not yet in the member list (it added
# itself, then appends: microseconds apart unless it died in between).
APPEND_SECONDS = 0.5


def _members(store: Any, base: str, final: int) -> list[int]:
    """The sorted global ranks of the first ``final`` arrivals of a shrunk generation."""
    end = current_time() + APPEND_SECONDS
    while True:
        arrived = _arrivals(store.get(f"{base}/members"), final)
        if len(arrived) >= final or current_time() >= end:
            return sorted(arrived)
        time.sleep(0.005)


def _counted(decision: bytes) -> int:
    """The count a deadline's closer fixed ("deadline:COUNT" or "missing:COUNT"); 0 for anything
    else (a value not fastdist's: nobody is counted in, and recovery says so)."""
    what, _, count = decision.partition(b":")
    return int(count) if what in (b"deadline", b"missing") and count.isdigit() else 0


_ARRIVAL = re.compile(rb"^(\d+):(\d+)$", re.MULTILINE)


def _arrivals(raw: bytes, upto: int) -> set[int]:
    """The global ranks among the first ``upto`` arrivals in a member list ("ORDER:RANK" lines).
    (Parsed by one regular expression: every member reads the whole list when a group shrinks.)"""
    return {int(rank) for order, rank in _ARRIVAL.findall(raw) if int(order) <= upto}


# Under fastdist run, how long a live rank waits in the recovery agreement before it names the
# ranks that have not come (stopped, hung, not a death the agent saw) to the agent, which kills
# one that stays silent (--kill-missing-after) so that it is replaced.
NAME_ABSENT_AFTER = 3.0


@contextlib.contextmanager
def _naming_the_absent(store: Any, st: pgstate.GroupState, gen: int, joiner: bool) -> Any:
    """While the agreement of generation ``gen`` runs: after NAME_ABSENT_AFTER seconds, the ranks
    not yet in its first round are named missing (fastdist.store.job.name_missing). A rank that
    then enters recover() withdraws it (job.answering); a process that took the rank since is
    not the one named."""
    if joiner or not job.under_launcher():
        yield
        return
    since = time.time()

    def name() -> None:
        def read(_abandoned: threading.Event) -> set[int]:
            base = _round(keys.key("recover", st.name), gen, 0)
            raw = store.get(f"{base}/members") if store.check([f"{base}/members"]) else b""
            return _arrivals(bytes(raw), st.size)

        try:
            arrived = bounded(read, GRACE_SECONDS, "reading who came to the recovery")
        except Exception as exc:  # noqa: BLE001 - the store is failing: the agreement's deadline holds
            logger.debug("rank %d: could not read who came to the recovery: %r", st.my_global_rank, exc)
            return
        absent = [st.global_rank(r) for r in range(st.size) if st.global_rank(r) not in arrived]
        if absent:
            job.name_missing(absent, st.my_global_rank, f"the recovery of group {st.name!r}", since)

    timer = threading.Timer(NAME_ABSENT_AFTER, name)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _keys_of_generation(st: pgstate.GroupState, gen: int) -> list[str]:
    """fastdist's keys of generation ``gen`` of the group: once every member is two generations
    past it nothing reads them, and without deleting them the store would gain a dozen keys per
    timeout and recovery (gloo's own keys go in _forget_connections)."""
    if gen < 0:
        return []
    key = keys.key("recover", st.name)
    diag = keys.key("diag", st.name, gen)
    # Every round this process saw (a process that joined later knows only of the first).
    rounds = [_round(key, gen, turn) for turn in range(st.lineage.rounds.pop(gen, 0) + 1)]
    return [f"{base}/{k}" for base in rounds for k in ("count", "members", "closed", "past")] + [
        f"{diag}/{k}"
        for k in ("fault", "status", "count", "complete", "summary")
        + tuple(f"taker/{t}" for t in range(1, board.TAKER_TURNS + 1))
    ]


def _rebuild_in_place(pg: Any, is_default: bool, gen: int, deadline: float) -> list[Any]:
    """Swaps a fresh backend into every watched backend of ``pg`` (for the default group: of every
    watched group, the subgroups made from it too, oldest first, the same order on every rank),
    each on a store prefix of its own for this generation. Torch's connection set-up is bounded by
    what is left of ``deadline``."""
    groups = registry.watched_groups() if is_default else [pg]
    root = JOB.root if JOB.root is not None else pgstate.state_of(pg).store
    # A subgroup recovered on its own numbers its generations from its last rebuild by the
    # default group's recovery, which sets them to the default group's: its keys are apart from
    # those (under the default group's generation), or a later recovery of the default group
    # would meet a generation's addresses published before and connect to a live backend.
    own = "" if is_default else f"own{_default_generation()}"
    if root is None:  # recover() refused a group without a store before agreeing
        raise RuntimeError("no store to rebuild the group through")
    for g in groups:
        gst = pgstate.state_of(g)
        for backend in registry.backends_of(g):
            left = deadline - current_time()
            if left <= 0:
                raise gst.recovery_error(gen, "the deadline passed while the groups were rebuilt")
            prefix = dist.PrefixStore(_rebuild_prefix(gen, gst, backend, own), root)
            fresh = _fresh_backend(backend, prefix, min(left, 1e6), gst)
            backend.swap_inner(fresh)
            _forget_connections(root, gst, backend, gen - 2, own)
        pgstate.revive(gst)
        gst.generation = gen
        gst.checks_seq = 0
    pgstate.release_finished()
    return groups


def _default_generation() -> int:
    return (
        pgstate.state_of(dist.distributed_c10d._get_default_group()).generation
        if dist.is_initialized()
        else 0
    )


def _rebuild_prefix(gen: int, st: pgstate.GroupState, backend: Any, own: str) -> str:
    """The store prefix of generation ``gen`` of ``backend`` (of group ``st``) rebuilt in place;
    ``own``: a subgroup's own recovery (see _rebuild_in_place)."""
    return keys.key(f"gen{gen}", st.name, backend.name(), *([own] if own else [])) + "/"


def _forget_connections(root: Any, st: pgstate.GroupState, backend: Any, gen: int, own: str) -> None:
    """Deletes the address this rank's gloo published for generation ``gen`` of a rebuilt backend
    (its first device's, ``DEVICE/RANK`` under the generation's prefix): every member agreed a
    later generation, so nobody connects through it any more. Each member deletes its own: one
    operation per rank, not one per rank pair. (NCCL's keys are its own; they stay.)"""
    if gen < 1 or backend.inner.name() != "gloo":
        return
    old = dist.PrefixStore(_rebuild_prefix(gen, st, backend, own), root)
    try:
        old.delete_key(f"0/{backend.rank()}")
    except RuntimeError:  # a store without delete
        pass


def _fresh_backend(old: Any, store: Any, seconds: float, st: pgstate.GroupState) -> Any:
    """A new backend of ``old``'s kind (gloo, NCCL, or a third-party backend registered with
    ``torch.distributed.Backend.register_backend``) for the same rank and size.

    gloo gets what is left of recover()'s budget (``seconds``) as its timeout: it bounds the
    connections made here, and every op gets its own timeout from fastdist. An NCCL-like backend
    keeps the group's own timeout (:func:`_group_timeout`): its watchdog enforces that timeout on
    every op and aborts the communicator when it passes, after which the op in flight reads as
    completed with no error; a timeout shorter than fastdist's deadlines would let torch's
    watchdog act first."""
    inner = old.inner
    name = inner.name()
    td = datetime.timedelta(seconds=seconds) if not old.polled else _group_timeout(inner)
    fresh: Any
    try:
        if name == "gloo":
            fresh = dist.ProcessGroupGloo(store, old.rank(), old.size(), td)
        elif name == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = td
            fresh = dist.ProcessGroupNCCL(store, old.rank(), old.size(), opts)
        elif name.upper() in dist.Backend._plugins:  # a third-party backend: torch's own creator
            plugin = dist.Backend._plugins[name.upper()]
            if plugin.extended_api:
                raise st.recovery_error(
                    st.generation + 1, f"cannot rebuild a {name} backend (extended API) in place"
                )
            with joining.real_classes():  # (a joiner's stand-ins are still in place here)
                fresh = plugin.creator_fn(store, old.rank(), old.size(), td)
        else:
            raise st.recovery_error(st.generation + 1, f"cannot rebuild a {name} backend in place")
    except RuntimeError as exc:  # a member vanished while the connections were made
        raise st.recovery_error(
            st.generation + 1,
            f"rebuilding the connections failed: {str(exc).strip().splitlines()[0]}",
        ) from None
    try:
        fresh._set_sequence_number_for_group()
    except (RuntimeError, AttributeError):
        pass
    return fresh


def _group_timeout(inner: Any) -> datetime.timedelta:
    """The timeout the group was made with: the backend's own options (ProcessGroupNCCL's),
    else the one given to fastdist.init_process_group, else torch's default for the backend."""
    timeout = getattr(pgstate.backend_options(inner), "_timeout", None)
    if isinstance(timeout, datetime.timedelta):
        return timeout
    if isinstance(JOB.timeout, datetime.timedelta):
        return JOB.timeout
    nccl_default = getattr(dist.constants, "default_pg_nccl_timeout", None)
    return nccl_default if nccl_default is not None else dist.constants.default_pg_timeout


def rebuild_default(gen: int, rank: int, world_size: int) -> Any:
    # The dead group is held by fastdist (see _groups.hold), so dropping torch's references to
    # it here does not run its destructor, which could block on an op still in flight.
    dist.destroy_process_group()
    root = JOB.root
    store = dist.PrefixStore(keys.key(f"gen{gen}") + "/", root)
    kwargs = {} if JOB.timeout is None else {"timeout": JOB.timeout}
    dist.init_process_group(backend=JOB.backend, store=store, rank=rank, world_size=world_size, **kwargs)
    return dist.distributed_c10d._get_default_group()
