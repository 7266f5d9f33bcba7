"""Who is missing, who is elsewhere, and where: the report made when a collective fails.

Nothing here runs on the fast path: a healthy collective never touches the store. When a
collective times out (or a peer closes the group), each rank that noticed posts one status record
for the group's current generation (the op and sequence number it is in) to the group's store.
The first one to post also rings every other live rank of the group (fastdist.diagnostics.listener): each of
them posts where it is (the op it is in, if any, and the Python stack of the thread that issued
it, or of its main thread) and ends its own op on the group at once. Then each reporting rank
waits, without polling, until every rank has posted or the window has passed:

- a rank that posted the same op and sequence number arrived and is stuck with us;
- a rank that posted another op or sequence number is alive but desynced (it is in that op);
- a rank that posted no op never arrived: its stack says where it is instead;
- a rank that posted nothing within the window did not answer (stopped, dead, or holding the
  GIL in a long C call) and never arrived.

Store work is O(1) per rank, and so are the bytes each rank reads: a compare-and-set, an
append to one key, an add, a blocking wait on one key and one read of a small summary; the ring
goes down a binary tree of the group's ranks (two store operations per rank; a group of up to
four is rung by the ringer directly). One rank closes the
board (the one whose post completes it, or whose window ends first) and it alone reads every
record: it writes the summary (ranks as ranges, each distinct stack once) that every other rank
waits on, so every rank that times out gets the same report: no circular blame. The window is
min(1 s, 10% of the timeout) plus 5 ms per level of the ring tree, and ends early once every rank
of the group has posted.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..deadlines import current_time
from ..groups import registry
from ..store import keys, keywait
from ..store.bounded import GRACE_SECONDS, StoreUnanswered, bounded
from ..store.job import JOB
from . import ring

if TYPE_CHECKING:
    from ..groups.pgstate import GroupState

logger = logging.getLogger(__name__)

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
    return keys.board(st.name, st.generation)


_posted_lock = threading.Lock()  # (see Lineage.posted)


# How many of a rank's last completed ops its status carries (as [seq, microseconds waited]),
# for the straggler hint: 16 pairs are about 200 bytes.
WAITS_KEPT = 16


def waits(st: GroupState) -> list[list[int]]:
    """This rank's last completed ops on the group as ``[seq, microseconds from issue to end]``
    pairs, from the watched backend's history ring (empty for a group fastdist does not watch)."""
    try:
        done = [r for r in st.history() if r["outcome"] == "ok" and r["end"] is not None]
        recent = done[-WAITS_KEPT:]
        return [[int(r["seq"]), round((float(r["end"]) - float(r["start"])) * 1e6)] for r in recent]
    except Exception as exc:  # noqa: BLE001 - a hint must never cost the report itself
        logger.debug("fastdist: no waits for the straggler hint: %r", exc)
        return []


def _posted_natively(st: GroupState) -> bool:
    pg = st.ref()
    return pg is not None and any(b.native_posted(st.generation) for b in registry.backends_of(pg))


def post_status(st: GroupState, record: dict[str, Any], store: Any = None) -> bool:
    """Appends this rank's status record to the group's board, once per generation: one append
    and one add. True when this rank's post completed the board (every rank of the group has now
    posted) and this rank closed it: then it alone reads the board and publishes the summary
    (:func:`publish`). False otherwise, and when this rank had posted already."""
    posted, key = st.lineage.posted, (st.generation, st.rank)
    with _posted_lock:
        if key in posted:
            return False
        posted.add(key)
    if _posted_natively(st):  # C++ posted it at the deadline, while Python could not run
        return False
    store = st.store if store is None else store
    prefix = _prefix(st)
    store.append(f"{prefix}/status", json.dumps(record) + "\n")
    if store.add(f"{prefix}/count", 1) < st.size:
        return False
    return _close(store, prefix, st.rank, "all")


def _claimed_in_cpp(claim: bytes, me: dict[str, Any]) -> bool:
    """Whether the group's fault was claimed, and rung, by this rank's watched backend for the same
    timeout (see ``NativeReport`` in csrc/watched/watched.h: at the deadline, as soon as this
    rank's Python could run, or instead of it)."""
    rec = keys.parse_record(claim, _CLAIM_FIELDS)
    if rec is None or rec["state"] != "timed_out" or me["state"] != "timed_out":
        return False
    return all(rec[k] == me[k] for k in ("rank", "op", "seq"))


_CLAIM_FIELDS: dict[str, type | tuple[type, ...]] = {"rank": int, "op": str, "seq": int, "state": str}


def _ring_missed(st: GroupState, store: Any, prefix: str, status: dict[str, Any]) -> None:
    """The ringer, halfway through its window: rings the ranks its ring did not reach (see
    fastdist.diagnostics.ring.ring_missed), unless the board is closed already."""
    if not store.check([f"{prefix}/complete"]):
        ring.ring_missed(st, status, posted_ranks(st, store, prefix))


def posted_ranks(st: GroupState, store: Any, prefix: str) -> set[int]:
    """The group ranks whose status is on the board under ``prefix`` (one read of it)."""
    if not store.check([f"{prefix}/status"]):
        return set()
    return set(_records(st, bytes(store.get(f"{prefix}/status")))[0])


def _close(store: Any, prefix: str, rank: int, why: str) -> bool:
    """Closes the board under ``prefix``: True for the one rank whose close won (its token is
    its own, so that a close that lost never reads as won)."""
    token = f"{why}:{rank}"
    return bytes(store.compare_set(f"{prefix}/complete", "", token)) == token.encode()


def publish(st: GroupState, store: Any, prefix: str | None = None) -> dict[str, Any]:
    """Reads the closed board (the one read of every record, by the one rank that closed it),
    writes its summary to the key every other reporter waits on, and returns it. ``prefix``:
    the board's, fixed when the fault began (default: the group's current generation's)."""
    prefix = _prefix(st) if prefix is None else prefix
    summary = summarize(st, bytes(store.get(f"{prefix}/status")))
    mine = json.dumps(summary, separators=(",", ":"))
    # The first summary written stays (a rank that took over from a slow closer, below, and the
    # closer may both write one): every rank gets the same report.
    stored = bytes(store.compare_set(f"{prefix}/summary", "", mine))
    if stored != mine.encode():
        first = parse_summary(stored, st.size)
        return summary if first is None else first
    return summary


def _read_summary(st: GroupState, store: Any, prefix: str, raw: bytes | None = None) -> dict[str, Any]:
    """The published summary (``raw``: as read already, else read now) or, when it is not
    fastdist's, the records themselves."""
    summary = parse_summary(bytes(store.get(f"{prefix}/summary")) if raw is None else raw, st.size)
    if summary is not None:
        return summary
    logger.warning(
        "rank %d: the report's summary in the store is not fastdist's (is something else using it?): "
        "reading the records themselves",
        st.my_global_rank,
    )
    return summarize(st, bytes(store.get(f"{prefix}/status")))


# How long a reporter waits for the summary past its own window: the closer reads every record
# once, summarizes and writes (about 10 ms at 1,024 ranks); past this the writer is taken to be
# slow or gone and one rank takes its place (report(), below).
SUMMARY_SECONDS = 1.0
# How many ranks in turn take the place of a closer whose summary did not come (a second each;
# the report's bound, GRACE_SECONDS past the first wait, ends the turns about then anyway).
TAKER_TURNS = 3


ANNOUNCE_SECONDS = 0.2


def announce(
    st: GroupState,
    op: str,
    seq: int,
    state: str,
    dead: str | None = None,
    dead_ranks: list[int] | None = None,
) -> None:
    """Claims the group's fault for this rank (``state``: why it left ``op`` #``seq``; ``dead``:
    which peers are known dead, and how) and rings the other ranks, without waiting for their
    answers; bounded by ANNOUNCE_SECONDS."""
    store = st.store
    if store is None or st.size <= 1:
        return
    prefix = _prefix(st)
    me = {"rank": st.rank, "op": op, "seq": seq, "state": state, "t": time.time(), "waits": waits(st)}
    if dead:
        me["dead"] = dead
        me["dead_ranks"] = sorted(dead_ranks or [])

    def work(_abandoned: threading.Event) -> None:
        mine = json.dumps(me)
        if store.compare_set(f"{prefix}/fault", "", mine) == mine.encode():
            ring.ring(st, me)

    try:
        bounded(work, ANNOUNCE_SECONDS, "ringing the group")
    except (RuntimeError, StoreUnanswered) as exc:
        logger.warning("rank %d: could not ring group %r: %r", st.my_global_rank, st.name, exc)


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
    (fastdist.diagnostics.listener) and has posted already; it closes the board only a while after its own
    window ends, in case its ringer died."""
    store = st.store
    if store is None or st.size <= 1:
        return Report() if st.size <= 1 else None
    prefix = _prefix(st)
    me = {"rank": st.rank, "op": op, "seq": seq, "state": state, "t": time.time(), "waits": waits(st)}
    later = max(0.0, (until or 0.0) - time.monotonic())
    span = later + window(budget, st.size)

    def work(_abandoned: threading.Event) -> dict[str, Any]:  # (late posts to a closed board are harmless)
        mine = json.dumps(me)
        again = None
        claim = None if rung else bytes(store.compare_set(f"{prefix}/fault", "", mine))
        if claim is not None and (claim == mine.encode() or _claimed_in_cpp(claim, me)):
            if claim == mine.encode():
                ring.ring(st, me)  # the first to report: every other live rank learns it now
            # Halfway through the window, once more to the ranks whose ring parent is silent.
            again = keywait.at_deadline(
                current_time() + span / 2,
                lambda: _ring_missed(st, store, prefix, me),
                "ringing the ranks the ring missed",
            )
        try:
            return collect(_abandoned)
        finally:
            if again is not None:
                again.cancel()

    def collect(_abandoned: threading.Event) -> dict[str, Any]:
        if post_status(st, me):  # this rank's post completed the board: it summarizes
            return publish(st, store, prefix)
        # Until everyone posted or the window closes: whichever reporter's window ends first
        # closes the board for all and publishes the summary that the others wait on. A rung
        # rank closes only later (its ringer, whose window ended first, is closing it), in case
        # the ringer died.
        end = current_time() + span

        published: list[dict[str, Any]] = []  # by this rank's closer, if it closed the board

        def close() -> None:
            # This generation's board: a closer that runs late (this rank was stopped, say) must
            # not close the board of the generation recover() has moved the group to since.
            if _close(store, prefix, st.rank, "deadline"):
                published.append(publish(st, store, prefix))

        close_at = end + (SUMMARY_SECONDS / 2 if rung else 0.0)
        raw = keywait.get_key(store, f"{prefix}/summary", end + SUMMARY_SECONDS, close, close_at)
        if raw is not None:
            if published:  # (else read it: the closer may not have appended it yet)
                return published[0]
            return _read_summary(st, store, prefix, raw)
        # No summary yet: its writer is slow (the store is busy: every rank posted at once) or
        # died after closing the board. One rank at a time takes its place, reads the records
        # once and publishes; the others go on waiting on the key. Every rank reading the
        # records instead would be N^2 bytes from the one store at its busiest (5 GB at 4,096
        # ranks). This ends with the summary, or when the report's bound gives up on the store.
        turn = 0
        while not _abandoned.is_set():
            turn += 1
            token = str(st.rank)
            if turn <= TAKER_TURNS and bytes(store.compare_set(f"{prefix}/taker/{turn}", "", token)) == (
                token.encode()
            ):
                return publish(st, store, prefix)
            if keywait.wait_key(store, f"{prefix}/summary", current_time() + SUMMARY_SECONDS):
                return _read_summary(st, store, prefix)
        return summarize(st, b"")  # (given up on: the caller has moved on)

    try:
        # A store cut off by the network would hold this rank here for minutes: bounded.
        summary = bounded(work, span + SUMMARY_SECONDS + GRACE_SECONDS, "the report's store work")
    except Exception as exc:  # noqa: BLE001 - a dead store must not turn a timeout into another failure
        JOB.note_store_failure(exc)
        logger.warning(
            "rank %d: could not assemble the report for %s #%d: %s", st.my_global_rank, op, seq, JOB.failure
        )
        return None
    if summary["invalid"]:
        logger.warning(
            "rank %d: ignored %d invalid status record(s) in the store (is something else using it?)",
            st.my_global_rank,
            summary["invalid"],
        )
    return _judge(st, op, seq, summary)


# A frame is "file:line in function"; a stranger's record could make one of any length.
_MAX_FRAME_CHARS = 200


def _records(st: GroupState, raw: bytes) -> tuple[dict[int, dict[str, Any]], int]:
    """The board's valid status records (``raw``: one JSON status per line) by rank, the first of
    each rank's, and how many lines were not fastdist's."""
    records: dict[int, dict[str, Any]] = {}
    invalid = 0
    for line in raw.decode(errors="replace").splitlines():
        rec: dict[str, Any] | None = keys.parse_record(line, _STATUS_FIELDS)
        if rec is None or rec["state"] not in _STATES or not 0 <= rec["rank"] < st.size:
            invalid += 1  # not fastdist's: see the README's Security section
            continue
        records.setdefault(rec["rank"], rec)
    return records, invalid


def summarize(st: GroupState, raw: bytes) -> dict[str, Any]:
    """The board's records (``raw``: one JSON status per line), summarized so that its size
    depends on how many kinds of answer there were, not on how many ranks gave them: the ranks
    of each ``(op, seq, state)`` as ranges, each distinct stack once with its ranks, the two
    earliest timeouts, the straggler hint, and how many records were not fastdist's."""
    records, invalid = _records(st, raw)
    classes: dict[tuple[str, int, str], list[int]] = {}
    stacks: dict[tuple[str, ...], list[int]] = {}
    timeouts: list[tuple[float, int]] = []
    for r in sorted(records):
        rec = records[r]
        classes.setdefault((rec["op"], rec["seq"], rec["state"]), []).append(r)
        stack = rec.get("stack")
        if isinstance(stack, list) and stack:
            frames = tuple(str(f)[:_MAX_FRAME_CHARS] for f in stack[:_MAX_FRAMES])
            stacks.setdefault(frames, []).append(r)
        if rec["state"] == "timed_out":
            timeouts.append((float(rec["t"]), r))
    return {
        "classes": [[o, s, state, _ranges(rs)] for (o, s, state), rs in classes.items()],
        "stacks": [[list(frames), _ranges(rs)] for frames, rs in stacks.items()],
        "first_timeouts": [[t, r] for t, r in sorted(timeouts)[:2]],
        "straggler": straggler({st.global_rank(r): rec.get("waits") for r, rec in records.items()}),
        "invalid": invalid,
    }


def _ranges(ranks: list[int]) -> list[list[int]]:
    """Sorted ranks as ``[first, last]`` runs: [0, 1, 2, 5] -> [[0, 2], [5, 5]]."""
    out: list[list[int]] = []
    for r in ranks:
        if out and out[-1][1] == r - 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _valid_ranges(v: Any, size: int) -> bool:
    return isinstance(v, list) and all(
        isinstance(p, list) and len(p) == 2 and _is_int(p[0]) and _is_int(p[1]) and 0 <= p[0] <= p[1] < size
        for p in v
    )


_SUMMARY_FIELDS: dict[str, type | tuple[type, ...]] = {
    "classes": list,
    "stacks": list,
    "first_timeouts": list,
    "invalid": int,
}


def parse_summary(raw: bytes, size: int) -> dict[str, Any] | None:
    """A summary read from the store, or None when it is not one fastdist wrote for a group of
    ``size`` ranks (the store has no authentication: see the README's Security section)."""
    s: dict[str, Any] | None = keys.parse_record(raw, _SUMMARY_FIELDS)
    if s is None:
        return None
    ok = (
        all(
            isinstance(c, list)
            and len(c) == 4
            and isinstance(c[0], str)
            and _is_int(c[1])
            and c[2] in _STATES
            and _valid_ranges(c[3], size)
            for c in s["classes"]
        )
        and all(
            isinstance(e, list)
            and len(e) == 2
            and isinstance(e[0], list)
            and all(isinstance(f, str) for f in e[0])
            and _valid_ranges(e[1], size)
            for e in s["stacks"]
        )
        and all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], (int, float)) and _is_int(p[1])
            for p in s["first_timeouts"]
        )
        and (s.get("straggler") is None or isinstance(s.get("straggler"), str))
    )
    return s if ok else None


def _globals(st: GroupState, ranks: Sequence[int]) -> list[int]:
    """Group ranks as global ranks (a C-speed copy for the default group)."""
    table = getattr(st, "global_ranks", None)
    return list(ranks) if table is None else [table[r] for r in ranks]


def _judge(st: GroupState, op: str, seq: int, summary: dict[str, Any]) -> Report:
    """This rank's report from the group's summary: the same for every rank in the same op.
    Built from ranges (no per-rank work in Python beyond the lists the report holds)."""
    out = Report()
    me = st.my_global_rank
    posted: list[list[int]] = []
    absent: list[range] = []  # alive but in no op on the group: never arrived
    timed_out: list[int] = []
    for rop, rseq, state, ranges in summary["classes"]:
        for a, b in ranges:
            posted.append([a, b])
            ranks = range(a, b + 1)
            if rop == "" and state == "elsewhere":
                absent.append(ranks)
                continue
            if (rop, rseq) != (op, seq):
                out.desynced.update(dict.fromkeys(_globals(st, ranks), f"{rop} #{rseq}"))
            if state == "timed_out":
                timed_out += _globals(st, ranks)
    absent += _gaps(posted, st.size)  # posted nothing in the window: did not answer
    missing = sorted(r for ranks in absent for r in ranks)
    out.missing = [g for g in _globals(st, missing) if g != me]
    out.desynced.pop(me, None)
    out.timed_out = sorted(g for g in timed_out if g != me)
    for frames, ranges in summary["stacks"]:
        for a, b in ranges:
            out.stacks.update(dict.fromkeys(_globals(st, range(a, b + 1)), frames))
    out.stacks.pop(me, None)
    firsts = [float(t) for t, r in summary["first_timeouts"] if st.global_rank(r) != me]
    out.first_timeout_wall = firsts[0] if firsts else None
    out.straggler = summary["straggler"]
    return out


def _gaps(posted: list[list[int]], size: int) -> list[range]:
    """The group ranks in no ``[first, last]`` run of ``posted``."""
    out: list[range] = []
    nxt = 0
    for a, b in sorted(posted):
        if a > nxt:
            out.append(range(nxt, a))
        nxt = max(nxt, b + 1)
    if nxt < size:
        out.append(range(nxt, size))
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
        # (type() is int: a bool is not a sequence number; this runs over every rank's pairs)
        got = {
            p[0]: p[1]
            for p in pairs
            if type(p) is list and len(p) == 2 and type(p[0]) is int and type(p[1]) is int
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
        # The two shortest waits (a full sort per op costs too much at thousands of ranks).
        (w0, first), (w1, _) = heapq.nsmallest(2, [(w[seq], r) for r, w in per_rank.items()])
        if w1 - w0 >= STRAGGLER_MARGIN_US:
            last[first] = last.get(first, 0) + 1
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
