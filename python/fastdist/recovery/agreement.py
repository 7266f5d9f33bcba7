"""The recovery agreement: a store protocol in which the live ranks of a group agree on its next
generation and its members (rounds, arrivals, the closing decision), name the ranks that do not
turn up, and record the generation agreed (a signed record). Split out of recover.py, which
coordinates."""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..deadlines import (
    current_time,
)
from ..errors import RecoveryError
from ..store import board, job, keys, keywait, seal
from ..store.bounded import GRACE_SECONDS, StoreUnanswered, bounded

if TYPE_CHECKING:
    from ..groups.pgstate import GroupState

logger = logging.getLogger(__name__)


@dataclass
class Party:
    """A rank's place in its group's recovery agreement, on plain data (as fastdist.store.board's
    Seat is its place on the board): what the protocol reads of the group, and nothing of torch's,
    so that the agreement runs for thousands of simulated ranks (bench/sim_report.py) and in unit
    tests. :func:`party_of` makes a live group's."""

    store: Any
    name: str
    rank: int  # in the group
    size: int
    global_ranks: list[int] | None = None  # None: the group's ranks are the global ones
    # The ranks of the current generation presumed gone (their connections closed, no answer to
    # the ring), read at each round: a round closes once every other rank is in.
    gone: Callable[[], set[int]] = set
    # The failed rounds of each generation this process saw (the group's lineage's, shared): their
    # keys go with the generation's.
    rounds: dict[int, int] = field(default_factory=dict)

    def global_rank(self, group_rank: int) -> int:
        """The global rank of the group's rank ``group_rank``."""
        return self.global_ranks[group_rank] if self.global_ranks is not None else group_rank

    @property
    def my_global_rank(self) -> int:
        """This rank's global rank."""
        return self.global_rank(self.rank)

    def error(self, generation: int, reason: str, missing: list[int] | None = None) -> RecoveryError:
        """The error of agreeing ``generation`` of the group on this rank."""
        return RecoveryError(
            group=self.name,
            rank=self.my_global_rank,
            generation=generation,
            reason=reason,
            missing_ranks=missing,
            retryable=False,
        )


def party_of(st: GroupState) -> Party:
    """A live group's :class:`Party` on this rank, now."""
    return Party(
        store=st.store,
        name=st.name,
        rank=st.rank,
        size=st.size,
        global_ranks=st.global_ranks,
        gone=st.gone,
        rounds=st.lineage.rounds,
    )


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


def _joiners_key(name: str, gen: int) -> str:
    """The key where generation ``gen``'s joiners of group ``name`` list themselves (signed)."""
    return f"{keys.key('recover', name)}/{gen}/joiners"


def _joiners(store: Any, name: str, gen: int) -> list[int]:
    """The global ranks that joined group ``name`` (the job) in generation ``gen`` (replacements,
    spares): the signed lines they wrote (_agree, before counting in)."""
    key = _joiners_key(name, gen)
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


def _agree(
    store: Any,
    party: Party,
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
    key = keys.key("recover", party.name)
    me = party.my_global_rank
    # The last generation agreed (set by one member of it): 0 before the first recovery.
    latest = read_latest(store, party.name)
    if latest > gen or (latest == gen and not joiner):  # (a joiner may take a dead rank's place)
        raise party.error(
            gen, f"the other ranks already rebuilt the group as generation {latest} without this rank"
        )
    if joiner:  # before counting in: whoever sees a round complete sees this too
        store.append(_joiners_key(party.name, gen), seal.seal(f"{_joiners_key(party.name, gen)} {me}") + "\n")
    turn = 0
    while True:
        base = _round(key, gen, turn)
        if abandoned is not None and abandoned.is_set():
            raise StoreUnanswered("the caller gave up on the store before this rank joined the agreement")
        n, decision = _one_round(store, party, base, deadline, allow_shrink)
        count = party.size if decision == b"all" else _counted(decision)
        if not decision.startswith(b"missing:") or n <= count:
            break
        turn += 1  # this round had failed before this rank came: the next one is open
    party.rounds[gen] = turn
    if decision == b"all" and n > party.size and joiner and not _went_past(store, base, me):
        # Every place was taken before this rank counted in, its own by the process it replaces
        # (killed inside recover() after it counted in), which died before it left the agreement:
        # the others wait for this rank in the generation's rebuild, and this process takes the
        # dead one's place there, as the joiner it is (listed above, before counting in).
        store.append(f"{base}/past", f"{me}\n")
        return [party.global_rank(r) for r in range(party.size)]
    if decision == b"all" and n > party.size:
        # Every place was taken before this rank counted in: by a process that has died since,
        # after it had gone on to the rebuild (or this rank is no replacement). The others agreed
        # the generation with it, and their rebuild fails on it: the generation is used up, and
        # the next recover() agrees the next one.
        raise GenerationTaken(
            group=party.name,
            rank=me,
            generation=gen,
            missing_ranks=None,
            retryable=True,
            reason="the generation was agreed, before this rank came, by ranks that counted a process "
            "that has died since (a rank killed inside recover()): call recover() again",
        )
    # Whoever closed it first decided for everyone: the last arrival (then no one can have fixed
    # fewer), or a deadline (then the arrivals it counted; a later one is left out).
    if count < party.size and (not allow_shrink or decision.startswith(b"missing:")):
        arrived = _arrivals(store.get(f"{base}/members"), count)
        missing = [party.global_rank(r) for r in range(party.size) if party.global_rank(r) not in arrived]
        raise party.error(gen, "not every rank turned up before the deadline", missing)
    final = min(count, party.size)
    if n > final:
        raise party.error(
            gen, "this rank turned up after the others had closed the new generation without it"
        )
    if final >= party.size:
        members = [party.global_rank(r) for r in range(party.size)]
    else:
        members = _members(store, base, final)
    # This rank goes on to the rebuild: a process that replaces it from now on cannot take its
    # place in this generation (the others may have connected to this one).
    store.append(f"{base}/past", f"{me}\n")
    # The generation's housekeeping, shared out by arrival order (at most one operation each
    # from 10 members up): record it as the latest, and delete generation gen - 2's keys (gen - 1's
    # reports stay: a straggler of it, left out, reads them to learn that the others timed out
    # rather than blame them as dead).
    chores = [latest_key(party.name), *_keys_of_generation(party, gen - 2)]
    try:
        for i in range(n - 1, len(chores), final):
            if i == 0:
                set_latest(store, party.name, gen)
            else:
                store.delete_key(chores[i])
    except RuntimeError:  # a store without delete (FileStore): the keys stay
        pass
    return members


def _place_open(store: Any, party: Party, gen: int) -> bool:
    """Whether generation ``gen`` was agreed with every rank, this one's too, by a process that
    died before it went on to the rebuild (see recover_joining)."""
    key = keys.key("recover", party.name)
    for turn in range(_MAX_ROUNDS):
        base = _round(key, gen, turn)
        if not store.check([f"{base}/closed"]):
            return False
        decision = bytes(store.get(f"{base}/closed"))
        if not decision.startswith(b"missing:"):
            return decision == b"all" and not _went_past(store, base, party.my_global_rank)
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


def _one_round(store: Any, party: Party, base: str, deadline: float, allow_shrink: bool) -> tuple[int, bytes]:
    """Counts this rank into the round at ``base``, and waits for its decision: (this rank's
    arrival order, the decision)."""
    # O(1) store operations per rank: an add (arrival order), an append to one member list, and
    # a blocking wait on one key that holds the decision, read once: "all" (set by the last to
    # arrive), or at the first deadline, by that rank's closer, with how many had arrived:
    # "deadline:COUNT" (a closer that allows a shrink: the first COUNT are the members) or
    # "missing:COUNT" (one that does not: the round failed). The member list is read only when
    # the group shrinks: with everyone in, the members are the old ranks.
    n = store.add(f"{base}/count", 1)
    store.append(f"{base}/members", f"{n}:{party.my_global_rank}\n")
    if n >= party.size:
        return n, bytes(store.compare_set(f"{base}/closed", "", "all"))
    gone = party.gone() if allow_shrink else set()
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
            if store.add(f"{base}/count", 0) >= party.size - len(gone):
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
def _naming_the_absent(store: Any, party: Party, gen: int, joiner: bool) -> Any:
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
            base = _round(keys.key("recover", party.name), gen, 0)
            raw = store.get(f"{base}/members") if store.check([f"{base}/members"]) else b""
            return _arrivals(bytes(raw), party.size)

        try:
            arrived = bounded(read, GRACE_SECONDS, "reading who came to the recovery")
        except Exception as exc:  # noqa: BLE001 - the store is failing: the agreement's deadline holds
            logger.debug("rank %d: could not read who came to the recovery: %r", party.my_global_rank, exc)
            return
        absent = [party.global_rank(r) for r in range(party.size) if party.global_rank(r) not in arrived]
        if absent:
            job.name_missing(absent, party.my_global_rank, f"the recovery of group {party.name!r}", since)

    timer = threading.Timer(NAME_ABSENT_AFTER, name)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _keys_of_generation(party: Party, gen: int) -> list[str]:
    """fastdist's keys of generation ``gen`` of the group: once every member is two generations
    past it nothing reads them, and without deleting them the store would gain a dozen keys per
    timeout and recovery (gloo's own keys go in _forget_connections)."""
    if gen < 0:
        return []
    key = keys.key("recover", party.name)
    diag = keys.key("diag", party.name, gen)
    # Every round this process saw (a process that joined later knows only of the first).
    rounds = [_round(key, gen, turn) for turn in range(party.rounds.pop(gen, 0) + 1)]
    return [f"{base}/{k}" for base in rounds for k in ("count", "members", "closed", "past")] + [
        f"{diag}/{k}"
        for k in ("fault", "status", "count", "complete", "summary")
        + tuple(f"taker/{t}" for t in range(1, board.TAKER_TURNS + 1))
    ]
