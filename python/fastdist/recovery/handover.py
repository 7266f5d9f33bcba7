"""The hand-over of a recovery: the joiners of a generation, DDP's bucket layouts for them, the
reconciliation of how far each member got, the state sent to the joiners and to the ranks that
got further, and the roll-back to a snapshot (FSDP2) or the shards of a replica (HSDP). Split out
of recover.py, which coordinates."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from ..deadlines import (
    current_time,
    fail_at,
)
from ..errors import FastdistError, RecoveryError
from ..groups import pgstate
from ..store import keys, keywait, seal
from . import joining, randomness, reconcile, state_sync, wrappers
from .snapshot import PeerSnapshot, load_into, newest_covering, own_copy, replicas

logger = logging.getLogger(__name__)


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
    if joiners:
        live = [r for r in (st.global_rank(i) for i in range(st.size)) if r not in joiners]
        if live:  # each joiner's predecessor's random state at the start of the step redone
            randomness.hand_over(st.name, gen, me, min(live), joiners, deadline)
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
            dist.all_gather_object(gathered, (snapshot.holdings(), snapshot.redoing_at()), group=pg)
    except FastdistError as exc:
        raise fail(f"agreeing on a snapshot failed: {exc}") from None
    live = [r for r in range(st.size) if r not in joiners]
    everyone = [held for held, _ in gathered]
    target = newest_covering(everyone, joiners)
    if target is None:
        raise fail(_no_snapshot(snapshot, joiners, everyone))
    # Where run_step's live ranks are (a step-start snapshot's exchange the death cut short): a
    # joiner that rolls back behind them catches up to that step, its loop's framework
    # collectives local meanwhile (the live ranks ran theirs before the death).
    at = [a for r, (_, a) in enumerate(gathered) if r in live and a is not None]
    if me in joiners and at and max(at) > target:
        snapshot.catch_up_to = max(at)
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
