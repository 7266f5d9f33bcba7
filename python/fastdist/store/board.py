"""Who is missing, who is elsewhere, and where: the report made when a collective fails.

Nothing here runs on the fast path: a healthy collective never touches the store. When a
collective times out (or a peer closes the group), each rank that noticed posts one status record
for the group's current generation (the op and sequence number it is in) to the group's store.
The first one to post also rings every other live rank of the group (fastdist.ops.listener): each of
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

The board is a protocol over the store, like the rendezvous beside it: it takes a :class:`Seat`
(the rank's place in the group, as plain data) and knows nothing of torch's groups. The ranks'
side of it, what they post and when, is fastdist.ops.fault's and fastdist.ops.listener's.

Why one file of about 600 lines: the board is one protocol (post, ring, wait, close, summarise)
whose steps share its records' shapes and keys; split, each part would need the others' insides.
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
from typing import Any

from ..deadlines import current_time
from . import keys, keywait, ring, seal
from .bounded import GRACE_SECONDS, StoreUnanswered, bounded
from .job import JOB

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
    """What a group's report found about a failed op, in global ranks: who never reached it
    (``missing``), who is in another op (``desynced``), whose own deadline passed (``timed_out``),
    where those that answered from elsewhere are (``stacks``), and a rank that keeps arriving last
    (``straggler``)."""

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

    @property
    def silent(self) -> list[int]:
        """The ranks of ``missing`` that posted nothing within the window: stopped or dead (a
        rank that answered from elsewhere is alive, in no op on the group)."""
        return [r for r in self.missing if r not in self.stacks]


class Posts:
    """The statuses a group's lineage has posted, as (generation, rank): once each, so that the
    count of posting ranks is exact (a rank can both time out and be rung by a peer)."""

    __slots__ = ("_done", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[tuple[int, int], None] = {}

    def first(self, generation: int, rank: int) -> bool:
        """Records a post of ``rank`` in ``generation``: True the first time, False after."""
        with self._lock:
            if (generation, rank) in self._done:
                return False
            self._done[generation, rank] = None
            return True


@dataclass(frozen=True)
class Seat:
    """One rank's place in a group's generation, as the board needs it: plain data, taken from
    the group's state when a fault begins (``GroupState.seat``), so that the protocol below knows
    the store and nothing of torch's groups (a simulation makes its own: bench/sim_report.py)."""

    store: Any
    group: str
    generation: int
    rank: int  # in the group
    size: int
    global_ranks: Sequence[int] | None = None  # group rank -> global rank; None: the same
    posted: Posts = field(default_factory=Posts)  # the group's lineage's
    # The backends that may have posted this rank's status from C++ (``native_posted``).
    backends: Sequence[Any] = ()
    children: Sequence[int] = ()  # this rank's children in the ring tree rooted at it
    dead: frozenset[int] = frozenset()  # global ranks known dead, skipped for their children
    waits: list[list[int]] = field(default_factory=list)  # see GroupState.waits

    @property
    def prefix(self) -> str:
        """The prefix of this group generation's report keys in the store."""
        return keys.board(self.group, self.generation)

    def global_rank(self, group_rank: int) -> int:
        """The global rank of the group's rank ``group_rank`` (the same number when ``global_ranks``
        is None)."""
        return group_rank if self.global_ranks is None else self.global_ranks[group_rank]

    @property
    def my_global_rank(self) -> int:
        """This rank's global rank."""
        return self.global_rank(self.rank)

    def status(self, op: str, seq: int, state: str, **more: Any) -> dict[str, Any]:
        """This rank's status record: ``state`` in ``op`` #``seq`` now (``more``: its stack, ...)."""
        return {
            "rank": self.rank,
            "op": op,
            "seq": seq,
            "state": state,
            "t": time.time(),
            "waits": self.waits,
        } | more


# Per level of the ring tree: the ring reaches the last of N ranks after about log2(N) hops.
HOP_SECONDS = 0.005


def window(budget: float, size: int = 2) -> float:
    """How long reporters wait for the others' statuses: min(1 s, 10% of the op's budget), plus
    5 ms per level of the ring tree (log2 of the group's size: 10 ms at 4 ranks, 50 ms at 1,024)."""
    return min(MAX_WINDOW_SECONDS, WINDOW_FRACTION * max(budget, 0.0)) + HOP_SECONDS * math.ceil(
        math.log2(max(size, 2))
    )


def _posted_natively(seat: Seat) -> bool:
    return any(b.native_posted(seat.generation) for b in seat.backends)


def post_status(seat: Seat, record: dict[str, Any]) -> bool:
    """Appends this rank's status record to the group's board, once per generation: one append
    and one add. True when this rank's post completed the board (every rank of the group has now
    posted) and this rank closed it: then it alone reads the board and publishes the summary
    (:func:`publish`). False otherwise, and when this rank had posted already."""
    if not seat.posted.first(seat.generation, seat.rank):
        return False
    if _posted_natively(seat):  # C++ posted it at the deadline, while Python could not run
        return False
    seat.store.append(f"{seat.prefix}/status", seal.seal_json(record) + "\n")
    if seat.store.add(f"{seat.prefix}/count", 1) < seat.size:
        return False
    return _close(seat, "all")


def _claimed_in_cpp(claim: bytes, me: dict[str, Any]) -> bool:
    """Whether the group's fault was claimed, and rung, by this rank's watched backend for the same
    timeout (see ``NativeReport`` in csrc/watched/watched.h: at the deadline, as soon as this
    rank's Python could run, or instead of it)."""
    rec = keys.parse_record(claim, _CLAIM_FIELDS, "fault claim")
    if rec is None or rec["state"] != "timed_out" or me["state"] != "timed_out":
        return False
    return all(rec[k] == me[k] for k in ("rank", "op", "seq"))


_CLAIM_FIELDS: dict[str, type | tuple[type, ...]] = {"rank": int, "op": str, "seq": int, "state": str}


def _ring_record(seat: Seat, status: dict[str, Any]) -> str:
    return seal.seal_json(
        {
            "kind": "fault",
            "group": seat.group,
            "gen": seat.generation,
            "root": seat.rank,
            "rank": seat.my_global_rank,
            "op": status["op"],
            "seq": status["seq"],
            "state": status["state"],
            "t": status["t"],
            **({"dead": status["dead"], "dead_ranks": status["dead_ranks"]} if status.get("dead") else {}),
        }
    )


def ring_group(seat: Seat, status: dict[str, Any]) -> None:
    """Rings the group: this rank reported its fault first (``status``: its record), and pushes
    it to its children in the ring tree rooted at it (``seat.children``)."""
    record = _ring_record(seat, status)
    try:
        for child in seat.children:
            ring.deliver(seat.store, child, record)
    except RuntimeError as exc:  # a store without queues (FileStore): the others find out at their deadline
        logger.debug("fastdist: could not ring the group: %r", exc)


def ring_missed(seat: Seat, status: dict[str, Any], posted: set[int]) -> int:
    """Rings again, directly, each rank that has not posted (``posted``: group ranks) and whose
    parent in the tree has not either: a parent that died unannounced (a whole node lost) holds
    its subtree's ring, which would otherwise learn of the fault only at its own deadline (and
    be named dead in the report). Called by the ringer halfway through its report's window;
    returns how many it rang."""
    record = _ring_record(seat, status)
    dead = ring.dead_of(status)
    rung = 0
    for pos in range(1, seat.size):
        rank = (seat.rank + pos) % seat.size
        parent = (seat.rank + ring.parent_position(pos, seat.size)) % seat.size
        if rank in posted or parent in posted or seat.global_rank(rank) in dead:
            continue
        ring.deliver(seat.store, seat.global_rank(rank), record)
        rung += 1
    return rung


def _ring_missed_unless_closed(seat: Seat, status: dict[str, Any]) -> None:
    """The ringer, halfway through its window: rings the ranks its ring did not reach
    (:func:`ring_missed`), unless the board is closed already."""
    if not seat.store.check([f"{seat.prefix}/complete"]):
        ring_missed(seat, status, posted_ranks(seat))


def posted_ranks(seat: Seat) -> set[int]:
    """The group ranks whose status is on the board (one read of it)."""
    if not seat.store.check([f"{seat.prefix}/status"]):
        return set()
    return set(_records(seat.size, bytes(seat.store.get(f"{seat.prefix}/status")))[0])


def _close(seat: Seat, why: str) -> bool:
    """Closes the board: True for the one rank whose close won (its token is its own, so that a
    close that lost never reads as won)."""
    token = f"{why}:{seat.rank}"
    return bytes(seat.store.compare_set(f"{seat.prefix}/complete", "", token)) == token.encode()


def publish(seat: Seat) -> dict[str, Any]:
    """Reads the closed board (the one read of every record, by the one rank that closed it),
    writes its summary to the key every other reporter waits on, and returns it."""
    summary = summarize(seat, bytes(seat.store.get(f"{seat.prefix}/status")))
    mine = seal.seal(json.dumps(summary, separators=(",", ":")))
    # The first summary written stays (a rank that took over from a slow closer, below, and the
    # closer may both write one): every rank gets the same report.
    stored = bytes(seat.store.compare_set(f"{seat.prefix}/summary", "", mine))
    if stored != mine.encode():
        first = parse_summary(stored, seat.size)
        return summary if first is None else first
    return summary


def _read_summary(seat: Seat, raw: bytes | None = None) -> dict[str, Any]:
    """The published summary (``raw``: as read already, else read now) or, when it is not
    fastdist's, the records themselves."""
    summary = parse_summary(
        bytes(seat.store.get(f"{seat.prefix}/summary")) if raw is None else raw, seat.size
    )
    if summary is not None:
        return summary
    logger.warning(
        "rank %d: the report's summary in the store is not fastdist's (is something else using it?): "
        "reading the records themselves",
        seat.my_global_rank,
    )
    return summarize(seat, bytes(seat.store.get(f"{seat.prefix}/status")))


# How long a reporter waits for the summary past its own window: the closer reads every record
# once, summarizes and writes (about 10 ms at 1,024 ranks); past this the writer is taken to be
# slow or gone and one rank takes its place (report(), below).
SUMMARY_SECONDS = 1.0
# How many ranks in turn take the place of a closer whose summary did not come (a second each;
# the report's bound, GRACE_SECONDS past the first wait, ends the turns about then anyway).
TAKER_TURNS = 3


ANNOUNCE_SECONDS = 0.2


def announce(seat: Seat, op: str, seq: int, state: str, dead: str | None = None) -> None:
    """Claims the group's fault for this rank (``state``: why it left ``op`` #``seq``; ``dead``:
    which peers are known dead, and how: ``seat`` was taken skipping them in the ring) and rings
    the other ranks, without waiting for their answers; bounded by ANNOUNCE_SECONDS."""
    if seat.store is None or seat.size <= 1:
        return
    more = {"dead": dead, "dead_ranks": sorted(seat.dead)} if dead else {}
    me = seat.status(op, seq, state, **more)

    def work(_abandoned: threading.Event) -> None:
        mine = seal.seal_json(me)
        if seat.store.compare_set(f"{seat.prefix}/fault", "", mine) == mine.encode():
            ring_group(seat, me)

    try:
        bounded(work, ANNOUNCE_SECONDS, "ringing the group")
    except (RuntimeError, StoreUnanswered) as exc:
        logger.warning("rank %d: could not ring group %r: %r", seat.my_global_rank, seat.group, exc)


def report(
    seat: Seat,
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
    (fastdist.ops.listener) and has posted already; it closes the board only a while after
    its own window ends, in case its ringer died."""
    store = seat.store
    if store is None or seat.size <= 1:
        return Report() if seat.size <= 1 else None
    prefix = seat.prefix
    me = seat.status(op, seq, state)
    later = max(0.0, (until or 0.0) - time.monotonic())
    span = later + window(budget, seat.size)

    def work(_abandoned: threading.Event) -> dict[str, Any]:  # (late posts to a closed board are harmless)
        mine = seal.seal_json(me)
        again = None
        claim = None if rung else bytes(store.compare_set(f"{prefix}/fault", "", mine))
        if claim is not None and (claim == mine.encode() or _claimed_in_cpp(claim, me)):
            if claim == mine.encode():
                ring_group(seat, me)  # the first to report: every other live rank learns it now
            # Halfway through the window, once more to the ranks whose ring parent is silent.
            again = keywait.at_deadline(
                current_time() + span / 2,
                lambda: _ring_missed_unless_closed(seat, me),
                "ringing the ranks the ring missed",
            )
        try:
            return collect(_abandoned)
        finally:
            if again is not None:
                again.cancel()

    def collect(_abandoned: threading.Event) -> dict[str, Any]:
        if post_status(seat, me):  # this rank's post completed the board: it summarizes
            return publish(seat)
        # Until everyone posted or the window closes: whichever reporter's window ends first
        # closes the board for all and publishes the summary that the others wait on. A rung
        # rank closes only later (its ringer, whose window ended first, is closing it), in case
        # the ringer died.
        end = current_time() + span

        published: list[dict[str, Any]] = []  # by this rank's closer, if it closed the board

        def close() -> None:
            # This generation's board: a closer that runs late (this rank was stopped, say) must
            # not close the board of the generation recover() has moved the group to since.
            if _close(seat, "deadline"):
                published.append(publish(seat))

        close_at = end + (SUMMARY_SECONDS / 2 if rung else 0.0)
        raw = keywait.get_key(store, f"{prefix}/summary", end + SUMMARY_SECONDS, close, close_at)
        if raw is not None:
            if published:  # (else read it: the closer may not have appended it yet)
                return published[0]
            return _read_summary(seat, raw)
        # No summary yet: its writer is slow (the store is busy: every rank posted at once) or
        # died after closing the board. One rank at a time takes its place, reads the records
        # once and publishes; the others go on waiting on the key. Every rank reading the
        # records instead would be N^2 bytes from the one store at its busiest (5 GB at 4,096
        # ranks). This ends with the summary, or when the report's bound gives up on the store.
        turn = 0
        while not _abandoned.is_set():
            turn += 1
            token = str(seat.rank)
            if turn <= TAKER_TURNS and bytes(store.compare_set(f"{prefix}/taker/{turn}", "", token)) == (
                token.encode()
            ):
                return publish(seat)
            if keywait.wait_key(store, f"{prefix}/summary", current_time() + SUMMARY_SECONDS):
                return _read_summary(seat)
        return summarize(seat, b"")  # (given up on: the caller has moved on)

    try:
        # A store cut off by the network would hold this rank here for minutes: bounded.
        summary = bounded(work, span + SUMMARY_SECONDS + GRACE_SECONDS, "the report's store work")
    except Exception as exc:  # noqa: BLE001 - a dead store must not turn a timeout into another failure
        JOB.note_store_failure(exc)
        logger.warning(
            "rank %d: could not assemble the report for %s #%d: %s", seat.my_global_rank, op, seq, JOB.failure
        )
        return None
    if summary["invalid"]:
        logger.warning(
            "rank %d: ignored %d invalid status record(s) in the store (is something else using it?)",
            seat.my_global_rank,
            summary["invalid"],
        )
    return _judge(seat, op, seq, summary)


# A frame is "file:line in function"; a stranger's record could make one of any length.
_MAX_FRAME_CHARS = 200


def _records(size: int, raw: bytes) -> tuple[dict[int, dict[str, Any]], int]:
    """The board's valid status records (``raw``: one JSON status per line) by rank, the first of
    each rank's, and how many lines were not fastdist's."""
    records: dict[int, dict[str, Any]] = {}
    invalid = 0
    for line in raw.decode(errors="replace").splitlines():
        rec: dict[str, Any] | None = keys.parse_record(line, _STATUS_FIELDS, "report status")
        if rec is None or rec["state"] not in _STATES or not 0 <= rec["rank"] < size:
            invalid += 1  # not fastdist's: see docs/security.md
            continue
        records.setdefault(rec["rank"], rec)
    return records, invalid


def summarize(seat: Seat, raw: bytes) -> dict[str, Any]:
    """The board's records (``raw``: one JSON status per line), summarized so that its size
    depends on how many kinds of answer there were, not on how many ranks gave them: the ranks
    of each ``(op, seq, state)`` as ranges, each distinct stack once with its ranks, the two
    earliest timeouts, the straggler hint, and how many records were not fastdist's."""
    records, invalid = _records(seat.size, raw)
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
        "straggler": straggler({seat.global_rank(r): rec.get("waits") for r, rec in records.items()}),
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
    ``size`` ranks (the store has no authentication: see docs/security.md)."""
    s: dict[str, Any] | None = keys.parse_record(raw, _SUMMARY_FIELDS, "report summary")
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


def _globals(seat: Seat, ranks: Sequence[int]) -> list[int]:
    """Group ranks as global ranks (a C-speed copy for the default group)."""
    table = seat.global_ranks
    return list(ranks) if table is None else [table[r] for r in ranks]


def _judge(seat: Seat, op: str, seq: int, summary: dict[str, Any]) -> Report:
    """This rank's report from the group's summary: the same for every rank in the same op.
    Built from ranges (no per-rank work in Python beyond the lists the report holds)."""
    out = Report()
    me = seat.my_global_rank
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
                out.desynced.update(dict.fromkeys(_globals(seat, ranks), f"{rop} #{rseq}"))
            if state == "timed_out":
                timed_out += _globals(seat, ranks)
    absent += _gaps(posted, seat.size)  # posted nothing in the window: did not answer
    missing = sorted(r for ranks in absent for r in ranks)
    out.missing = [g for g in _globals(seat, missing) if g != me]
    out.desynced.pop(me, None)
    out.timed_out = sorted(g for g in timed_out if g != me)
    for frames, ranges in summary["stacks"]:
        for a, b in ranges:
            out.stacks.update(dict.fromkeys(_globals(seat, range(a, b + 1)), frames))
    out.stacks.pop(me, None)
    firsts = [float(t) for t, r in summary["first_timeouts"] if seat.global_rank(r) != me]
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
