"""Who is missing, who is elsewhere, and where: the report made when a collective fails.

Nothing here runs on the fast path: a healthy collective never touches the store. When a
collective times out (or a peer closes the group), each rank that noticed posts one status record
for the group's current generation (the op and sequence number it is in) to the group's store.
The first one to post also rings every other live rank of the group (fastdist._bell): each of
them posts where it is (the op it is in, if any, and the Python stack of the thread that issued
it, or of its main thread) and ends its own op on the group at once. Then each reporting rank
waits, without polling, until every rank has posted or the window has passed:

- a rank that posted the same op and sequence number arrived and is stuck with us;
- a rank that posted another op or sequence number is alive but desynced (it is in that op);
- a rank that posted no op never arrived: its stack says where it is instead;
- a rank that posted nothing within the window did not answer (stopped, dead, or holding the
  GIL in a long C call) and never arrived.

Store work is O(1) per rank: a compare-and-set, an append to one key, an add, a blocking wait on
one key and one read; the ring goes down a binary tree of the group's ranks (two store
operations per rank). Every rank reads the same records, so every rank that times out gets the
same report: no circular blame. The window is min(1 s, 10% of the timeout) plus 5 ms per level of
the ring tree, and ends early once every rank of the group has posted.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import _keys
from ._bounded import GRACE_SECONDS, bounded
from ._timeouts import current_time

if TYPE_CHECKING:
    from ._groups import GroupState

logger = logging.getLogger(__name__)

# Where the job's store lives, for messages when it is gone: "HOST:PORT (in rank 0)" (set by
# fastdist.init_process_group), and what the last failed store operation said.
store_location: str | None = None
store_failure: str | None = None


def store_gone_reason() -> str:
    """Says that the job's store is unreachable, and where it was."""
    where = f" at {store_location}" if store_location else ""
    return (
        f"the job's store{where} cannot be reached ({store_failure or 'connection lost'}): its host exited "
        "or was killed, and reports and recovery go through it; restart the job"
    )


# A rank's status record: what report() writes, and checks before it believes one.
_STATUS_FIELDS: dict[str, type | tuple[type, ...]] = {
    "rank": int,
    "op": str,
    "seq": int,
    "state": str,
    "t": (int, float),
}
# "elsewhere": a rank that was rung while in no op on the group; "in_op": one that was in
# another op (or the same one) when it was rung.
_STATES = ("timed_out", "aborted", "elsewhere", "in_op")
_MAX_FRAMES = 6

MAX_WINDOW_SECONDS = 1.0
WINDOW_FRACTION = 0.1


@dataclass
class Report:
    missing: list[int] = field(default_factory=list)  # global ranks that never reached the op
    desynced: dict[int, str] = field(default_factory=dict)  # global rank -> "op #seq"
    timed_out: list[int] = field(default_factory=list)  # global ranks whose own deadline passed
    first_timeout_wall: float | None = None  # time.time() of the earliest of those timeouts
    # Global rank -> innermost frames ("file:line in function") of a rank that answered from
    # elsewhere; ranks of ``missing`` absent from it did not answer.
    stacks: dict[int, list[str]] = field(default_factory=dict)
    # "rank R arrived last in K of the last N ops ...", when the posted histories show one rank
    # arriving last over most of the recent ops (see straggler()).
    straggler: str | None = None


# Per level of the ring tree: the ring reaches the last of N ranks after about log2(N) hops.
HOP_SECONDS = 0.005


def window(budget: float, size: int = 2) -> float:
    """How long reporters wait for the others' statuses: min(1 s, 10% of the op's budget), plus
    5 ms per level of the ring tree (log2 of the group's size: 10 ms at 4 ranks, 50 ms at 1,024)."""
    return min(MAX_WINDOW_SECONDS, WINDOW_FRACTION * max(budget, 0.0)) + HOP_SECONDS * math.ceil(
        math.log2(max(size, 2))
    )


def _prefix(st: GroupState) -> str:
    return _keys.key("diag", st.name, st.generation)


# (group name, generation) pairs this process has posted its status for: once each, so that the
# count of posting ranks is exact (a rank can both time out and be rung by a peer).
_posted: set[tuple[str, int, int]] = set()
_posted_lock = threading.Lock()


# How many of a rank's last completed ops its status carries (as [seq, microseconds waited]),
# for the straggler hint: 16 pairs are about 200 bytes.
WAITS_KEPT = 16


def waits(st: GroupState) -> list[list[int]]:
    """This rank's last completed ops on the group as ``[seq, microseconds from issue to end]``
    pairs, from the watched backend's history ring (empty for a group fastdist does not watch)."""
    from . import _watch

    pg = st.ref()
    if pg is None:
        return []
    try:
        done = [r for r in _watch.history(pg) if r["outcome"] == "ok" and r["end"] is not None]
        recent = done[-WAITS_KEPT:]
        return [[int(r["seq"]), round((float(r["end"]) - float(r["start"])) * 1e6)] for r in recent]
    except Exception as exc:  # noqa: BLE001 - a hint must never cost the report itself
        logger.debug("fastdist: no waits for the straggler hint: %r", exc)
        return []


def post_status(st: GroupState, record: dict[str, Any], store: Any = None) -> bool:
    """Appends this rank's status record to the group's board, once per generation: one append
    and one add; the rank that completes the count sets the key the reporters wait on. False if
    this rank had posted already."""
    with _posted_lock:
        if (st.name, st.generation, st.rank) in _posted:
            return False
        _posted.add((st.name, st.generation, st.rank))
    store = st.store if store is None else store
    prefix = _prefix(st)
    store.append(f"{prefix}/status", json.dumps(record) + "\n")
    if store.add(f"{prefix}/count", 1) >= st.size:
        store.set(f"{prefix}/complete", "all")
    return True


def report(
    st: GroupState,
    op: str,
    seq: int,
    state: str,
    budget: float,
    until: float | None = None,
    rung: bool = False,
) -> Report | None:
    """Publishes this rank's status (``state``: ``"timed_out"`` or ``"aborted"``), rings the
    group's other ranks if no one has yet, and collects everyone's status for the window after
    now, or after ``until`` (a ``time.monotonic()`` value) when given. ``None`` when the group has
    no store or the store cannot be reached. ``rung``: this rank learnt of the fault from a peer
    (fastdist._bell) and has posted already; it only collects (the ringer closes the window)."""
    from . import _bell

    store = st.store
    if store is None or st.size <= 1:
        return Report() if st.size <= 1 else None
    prefix = _prefix(st)
    me = {"rank": st.rank, "op": op, "seq": seq, "state": state, "t": time.time(), "waits": waits(st)}
    later = max(0.0, (until or 0.0) - time.monotonic())
    span = later + window(budget, st.size)

    def work(_abandoned: threading.Event) -> bytes:  # (late posts to a closed board are harmless)
        mine = json.dumps(me)
        if not rung and store.compare_set(f"{prefix}/fault", "", mine) == mine.encode():
            _bell.ring(st, me)  # the first to report: every other live rank learns it now
        post_status(st, me)  # (a no-op when this rank was rung first and has posted already)
        # Until everyone posted or the window closes: whichever reporter's window ends first
        # closes it for all (a rung rank only collects: its ringer closes it).
        _bell.wait_key(store, f"{prefix}/complete", current_time() + span, close=not rung)
        return bytes(store.get(f"{prefix}/status"))

    try:
        # A store cut off by the network would hold this rank here for minutes: bounded.
        raw = bounded(work, span + GRACE_SECONDS, "the report's store work")
    except Exception as exc:  # noqa: BLE001 - a dead store must not turn a timeout into another failure
        global store_failure
        store_failure = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        logger.warning(
            "rank %d: could not assemble the report for %s #%d: %s", st.my_global_rank, op, seq, store_failure
        )
        return None
    records: dict[int, dict[str, Any]] = {st.rank: me}
    invalid = 0
    for line in raw.decode(errors="replace").splitlines():
        rec = _keys.parse_record(line, _STATUS_FIELDS)
        if rec is None or rec["state"] not in _STATES or not 0 <= rec["rank"] < st.size:  # type: ignore[operator]
            invalid += 1  # not fastdist's: see the README's Security section
            continue
        records.setdefault(rec["rank"], rec)  # type: ignore[arg-type]
    if invalid:
        logger.warning(
            "rank %d: ignored %d invalid status record(s) in the store (is something else using it?)",
            st.my_global_rank,
            invalid,
        )
    return _judge(st, op, seq, records)


def _judge(st: GroupState, op: str, seq: int, records: dict[int, dict[str, Any]]) -> Report:
    out = Report()
    for r in range(st.size):
        rec = records.get(r)
        g = st.global_rank(r)
        if rec is None:
            out.missing.append(g)  # did not answer
            continue
        stack = rec.get("stack")
        if isinstance(stack, list) and stack:
            out.stacks[g] = [str(f) for f in stack[:_MAX_FRAMES]]
        if rec["op"] == "" and rec["state"] == "elsewhere":
            out.missing.append(g)  # alive, but not in any op on the group
            continue
        if (rec["op"], rec["seq"]) != (op, seq):
            out.desynced[g] = f"{rec['op']} #{rec['seq']}"
        if rec["state"] == "timed_out" and r != st.rank:
            out.timed_out.append(g)
            t = float(rec["t"])
            out.first_timeout_wall = t if out.first_timeout_wall is None else min(out.first_timeout_wall, t)
    out.straggler = straggler({st.global_rank(r): rec.get("waits") for r, rec in records.items()})
    return out


# A rank counts as last in an op when it waited at least this much less than every other rank
# (below it, the order is scheduler noise), and is named when it was last in at least
# STRAGGLER_SHARE of at least STRAGGLER_MIN_OPS ops that every answering rank completed.
STRAGGLER_MARGIN_US = 100
STRAGGLER_SHARE = 0.6
STRAGGLER_MIN_OPS = 4


def straggler(posted: dict[int, Any]) -> str | None:
    """The straggler hint, from the waits each rank posted at the fault (no traffic while the job
    is healthy). A collective ends on all ranks at about the same time, so the rank that arrived
    last is the one that waited least: with clocks never compared across hosts, only the local
    durations. What this cannot know: ranks that did not answer (no history), ops before the last
    16, and by how much a rank was late in absolute time (only that it was last)."""
    per_rank: dict[int, dict[int, int]] = {}
    for rank, pairs in posted.items():
        if not isinstance(pairs, list):
            continue
        got = {
            p[0]: p[1]
            for p in pairs
            if isinstance(p, list)
            and len(p) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in p)
        }
        if got:
            per_rank[rank] = got
    if len(per_rank) < 2:
        return None
    common = sorted(set.intersection(*(set(w) for w in per_rank.values())))
    if len(common) < STRAGGLER_MIN_OPS:
        return None
    last: dict[int, int] = {}
    for seq in common:
        order = sorted(per_rank, key=lambda r: per_rank[r][seq])
        if per_rank[order[1]][seq] - per_rank[order[0]][seq] >= STRAGGLER_MARGIN_US:
            last[order[0]] = last.get(order[0], 0) + 1
    if not last:
        return None
    rank, count = max(last.items(), key=lambda kv: (kv[1], -kv[0]))
    if count < max(STRAGGLER_MIN_OPS, STRAGGLER_SHARE * len(common)):
        return None
    return (
        f"rank {rank} arrived last in {count} of the last {len(common)} ops every answering rank "
        "completed: it is a straggler (slow data loading, a slower device or host, or more work)"
    )


def peer_closed_verdict(rep: Report | None, started_wall: float) -> tuple[str | None, str]:
    """What a report says about a group a peer closed under this rank's op (started at
    ``started_wall``, a time.time()): ``(cause, "")`` when a peer timed out while this rank was in
    the op (then this is a timeout too), else ``(None, why)``: this rank arrived after a peer had
    timed out and aborted (a straggler), or peers exited or were killed."""
    if (
        rep is not None
        and rep.timed_out
        and rep.first_timeout_wall is not None
        and rep.first_timeout_wall > started_wall
    ):
        return f"rank {min(rep.timed_out)} timed out first and closed the group", ""
    if rep is not None and rep.timed_out:
        return None, f"rank {min(rep.timed_out)} had timed out and aborted the group before this rank arrived"
    if rep is not None and rep.missing:
        many = len(rep.missing) > 1
        return (
            None,
            (
                f"rank{'s' if many else ''} {', '.join(map(str, rep.missing))} exited or "
                f"{'were' if many else 'was'} killed"
            ),
        )
    return None, "a peer exited or was killed"
