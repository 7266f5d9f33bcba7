"""The report's summary and the recovery agreement, in one process (issue 14's "the report
scales"): what one rank writes once must give every rank the report it would have built from
every record, in a few hundred bytes whatever the group's size; the agreement's one decision key
must give every member the same members, in a handful of store operations each. Threads stand
in for ranks, on a HashStore (waits poll it: there is no second connection)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import torch.distributed as dist
from fastdist.deadlines import current_time
from fastdist.errors import RecoveryError
from fastdist.groups import pgstate
from fastdist.recovery import agreement
from fastdist.store import board, keys, ring

pytestmark = pytest.mark.timeout(60)


def _party(store: Any, rank: int, size: int, name: str = "g") -> agreement.Party:
    """Rank ``rank``'s place in a simulated group's recovery agreement: plain data, no torch group."""
    return agreement.Party(store, name, rank, size)


def _state(store: Any, rank: int, size: int, name: str) -> pgstate.GroupState:
    """The state of rank ``rank`` of a simulated group with no torch group behind it (no ops, so
    no history): for the listener, which applies a fault to a group's state."""
    from fastdist._native import _watched, hand_engine_over

    st = pgstate.GroupState.__new__(pgstate.GroupState)
    st.ref = lambda: None
    st.name, st.rank, st.size, st.global_ranks, st.store = name, rank, size, None, store
    st.backend, st.polled, st.is_default, st.watched, st.own = "", False, False, None, {}
    hand_engine_over()
    st.ctl = _watched.GroupCtl(name, rank, size, False)
    st._begin(pgstate.Lineage())
    return st


def _seat(store: Any, rank: int, size: int, name: str = "g") -> board.Seat:
    """Rank ``rank``'s seat on the board of a simulated group's generation 0, as a real rank's
    (its children in the ring tree rooted at it)."""
    return board.Seat(store, name, 0, rank, size, children=ring.children(rank, rank, size, None))


class Counting:
    """A store proxy counting the operations made through it. A wait here polls ``check`` (a
    HashStore has no second connection); in a job it is one blocking wait: counted as one."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.names: list[str] = []
        self.calls: list[tuple[str, Any]] = []  # (operation, its first argument)

    @property
    def ops(self) -> int:
        polls = self.names.count("check")
        return len(self.names) - polls + (1 if polls else 0)

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.inner, name)

        def counted(*args: Any) -> Any:
            self.names.append(name)
            self.calls.append((name, args[0] if args else None))
            return fn(*args)

        return counted


def _board(size: int) -> bytes:
    """The records of a 1,024-rank fault: rank 0 timed out first, ranks 1-9 timed out too, the
    rest were rung in the same op with one stack, except rank 5 (in another op), rank 7 (in no op,
    loading data), and ranks 1000-1023 (did not answer)."""
    lines = []
    for r in range(1000):
        rec: dict[str, Any] = {"rank": r, "op": "all_reduce", "seq": 57, "state": "in_op", "t": 100.0 + r}
        rec["stack"] = ["train.py:88 in main", "train.py:61 in step"]
        if r < 10:
            rec["state"] = "timed_out"
        if r == 5:
            rec.update(op="barrier", seq=3, stack=["eval.py:12 in evaluate"])
        if r == 7:
            rec.update(op="", seq=0, state="elsewhere", stack=["data.py:40 in load_batch"])
        rec["waits"] = [[s, 5_000 if r != 9 else 30] for s in range(41, 57)]  # rank 9 is always last
        lines.append(json.dumps(rec))
    lines.append("{garbage")
    return ("\n".join(lines) + "\n").encode()


def test_the_summary_gives_every_rank_the_full_report_in_a_few_hundred_bytes() -> None:
    size = 1024
    summary = board.summarize(_seat(None, 0, size), _board(size))
    text = json.dumps(summary, separators=(",", ":"))
    assert len(text) < 1024, (len(text), text)  # from 1,000 records of about 400 bytes each
    parsed = board.parse_summary(text.encode(), size)
    assert parsed == summary and parsed["invalid"] == 1

    rep = board._judge(_seat(None, 3, size), "all_reduce", 57, parsed)
    assert rep.missing == [7, *range(1000, 1024)]  # in no op, and did not answer
    assert rep.desynced == {5: "barrier #3"}
    assert rep.timed_out == [0, 1, 2, 4, 5, 6, 8, 9]  # every other rank whose deadline passed
    assert rep.first_timeout_wall == 100.0
    assert rep.stacks[7] == ["data.py:40 in load_batch"] and rep.stacks[5] == ["eval.py:12 in evaluate"]
    assert rep.stacks[500] == ["train.py:88 in main", "train.py:61 in step"] and 1000 not in rep.stacks
    assert 3 not in rep.stacks and 3 not in rep.missing  # never itself
    assert rep.straggler is not None and rep.straggler.startswith("rank 9 arrived last in 16 of the last 16")
    # Rank 0 is the earliest timeout: its own report takes the next one.
    assert board._judge(_seat(None, 0, size), "all_reduce", 57, parsed).first_timeout_wall == 101.0
    # The same summary, judged by the rank in the other op: everyone in all_reduce #57 is desynced.
    other = board._judge(_seat(None, 5, size), "barrier", 3, parsed)
    assert len(other.desynced) == 998 and other.desynced[0] == "all_reduce #57" and 5 not in other.desynced


@pytest.mark.parametrize(
    "bad",
    [
        b"{not json",
        b"[1, 2]",
        json.dumps({"classes": [["barrier", 1, "in_op", [[0, 4]]]]}).encode(),  # fields missing
        json.dumps(  # a rank outside the group
            {"classes": [["barrier", 1, "in_op", [[0, 4]]]], "stacks": [], "first_timeouts": [], "invalid": 0}
        ).encode(),
        json.dumps(  # a state that is not fastdist's
            {
                "classes": [["barrier", 1, "napping", [[0, 1]]]],
                "stacks": [],
                "first_timeouts": [],
                "invalid": 0,
            }
        ).encode(),
    ],
)
def test_a_summary_that_is_not_fastdists_is_refused(bad: bytes) -> None:
    assert board.parse_summary(bad, 4) is None


def test_a_rank_reads_the_records_itself_when_the_summary_is_not_fastdists() -> None:
    store = dist.HashStore()
    prefix = keys.key("diag", "g", 0)
    for r in (1, 2):
        rec = {"rank": r, "op": "barrier", "seq": 4, "state": "in_op", "t": 1.0, "stack": [f"x.py:{r} in f"]}
        store.append(f"{prefix}/status", json.dumps(rec) + "\n")
    store.add(f"{prefix}/count", 2)
    store.set(f"{prefix}/summary", "garbage")  # a stranger's, or a corrupt value
    # Rank 0 of 4 posts (3 of 4: the board stays open), finds the summary invalid, and builds the
    # report from the records: rank 3 did not answer.
    rep = board.report(_seat(store, 0, 4), "barrier", 4, "timed_out", 1.0)
    assert rep is not None and rep.missing == [3] and rep.stacks == {1: ["x.py:1 in f"], 2: ["x.py:2 in f"]}


def test_the_rank_that_completes_the_board_publishes_the_summary_once() -> None:
    store = dist.HashStore()
    ranks = [_seat(store, r, 3, name="h") for r in range(3)]
    rec = {"op": "barrier", "seq": 1, "state": "in_op", "t": 1.0}
    assert not board.post_status(ranks[1], dict(rec, rank=1))
    assert not board.post_status(ranks[1], dict(rec, rank=1))  # once per generation
    assert not board.post_status(ranks[2], dict(rec, rank=2))
    counting = Counting(store)
    rep = board.report(_seat(counting, 0, 3, name="h"), "barrier", 1, "timed_out", 1.0)
    assert rep is not None and rep.missing == [] and not rep.desynced
    # A compare-and-set (the fault), the ring's two pushes, the post (an append and an add),
    # closing the board, one read of every record and the summary's write: no wait.
    assert counting.ops == 8, counting.ops
    assert board.parse_summary(store.get(keys.key("diag", "h", 0) + "/summary"), 3) is not None


def test_when_the_closer_never_publishes_one_rank_takes_its_place_and_every_rank_gets_its_summary() -> None:
    # The board was closed by a rank whose summary never came (it died, or the store was too busy
    # for it): the live reporters must not each read every record (N^2 bytes from the one store:
    # 5 GB at 4,096 ranks). One takes over, reads the records once and publishes; the others wait.
    store = dist.HashStore()
    prefix = keys.key("diag", "t", 0)
    store.compare_set(f"{prefix}/complete", "", "deadline:3")
    reports: dict[int, Any] = {}
    counters = {r: Counting(store) for r in range(3)}

    def run(r: int) -> None:
        reports[r] = board.report(_seat(counters[r], r, 4, name="t"), "barrier", 2, "timed_out", 1.0)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    assert all(rep is not None and rep.missing == [3] for rep in reports.values()), reports
    assert len({json.dumps(sorted(rep.stacks.items())) for rep in reports.values()}) == 1  # the same
    calls = {r: c.calls for r, c in counters.items()}
    readers = [r for r, cs in calls.items() if ("get", f"{prefix}/status") in cs]
    assert len(readers) == 1, calls
    assert all(("get", f"{prefix}/summary") in cs for r, cs in calls.items() if r not in readers), calls
    assert store.get(f"{prefix}/taker/1") == str(readers[0]).encode()
    assert not store.check([f"{prefix}/taker/2"])


def _agree_all(
    size: int, gen: int, present: list[int], seconds: float, shrink: bool, name: str
) -> dict[int, Any]:
    store = dist.HashStore()
    out: dict[int, Any] = {}

    def run(r: int) -> None:
        counting = Counting(store)
        try:
            members = agreement._agree(counting, _party(store, r, size, name), gen, deadline, shrink)
            out[r] = (members, counting)
        except RecoveryError as exc:
            out[r] = (exc, counting)

    deadline = current_time() + seconds
    threads = [threading.Thread(target=run, args=(r,)) for r in present]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return out


def test_the_agreement_gives_every_member_the_same_members_in_a_handful_of_operations() -> None:
    # Everyone in: the last arrival decides at once, nobody reads the member list.
    start = time.monotonic()
    out = _agree_all(12, 1, list(range(12)), 20.0, False, "a")
    assert time.monotonic() - start < 10  # not the deadline
    assert all(members == list(range(12)) for members, _ in out.values()), out
    ops = sorted(c.ops for _, c in out.values())
    # latest, add, append, wait, the decision, the rebuild marker (a replacement of a member that
    # died before it can take its place: recover.py _went_past), one chore at most
    assert ops[-1] <= 7, ops

    # Rank 4 gone, allow_shrink: the first deadline decides, and every member sees the same 11.
    out = _agree_all(12, 3, [r for r in range(12) if r != 4], 1.0, True, "b")
    expected = [r for r in range(12) if r != 4]
    assert all(members == expected for members, _ in out.values()), out
    assert max(c.ops for _, c in out.values()) <= 10  # (the rebuild marker: one more)

    # Without allow_shrink: every member is told who did not turn up.
    out = _agree_all(4, 1, [0, 1, 2], 1.0, False, "c")
    for err, _ in out.values():
        assert isinstance(err, RecoveryError) and err.missing_ranks == [3], err


def test_a_rank_arriving_after_the_deadline_decided_is_left_out() -> None:
    store = dist.HashStore()
    out: dict[int, Any] = {}

    def run(r: int, seconds: float) -> None:
        try:
            out[r] = agreement._agree(store, _party(store, r, 3, "late"), 1, current_time() + seconds, True)
        except RecoveryError as exc:
            out[r] = exc

    early = [threading.Thread(target=run, args=(r, 0.5)) for r in (0, 1)]
    for t in early:
        t.start()
    for t in early:
        t.join(30)
    assert out[0] == out[1] == [0, 1]
    run(2, 5.0)  # after the others fixed the generation without it
    assert isinstance(out[2], RecoveryError) and "already rebuilt" in str(out[2]), out[2]


def test_a_replacement_of_a_rank_that_died_inside_the_agreement_moves_on_to_the_next_generation() -> None:
    # Issue 40, item 3: rank 2 counted itself into generation 1 and died; its replacement came to
    # generation 1 too (the dead rank never recorded it as the latest), as a fourth arrival, and
    # failed "after the others had closed the new generation without it", at every try. It must
    # learn that the generation is used up, and meet the live ranks in the next one.
    store = dist.HashStore()
    out: dict[int, Any] = {}

    def run(r: int, gen: int, joiner: bool = False) -> None:
        try:
            out[r] = agreement._agree(
                store, _party(store, r, 3, "d"), gen, current_time() + 5.0, False, None, joiner
            )
        except RecoveryError as exc:
            out[r] = exc

    def together(runs: list[tuple[int, int, bool]]) -> None:
        threads = [threading.Thread(target=run, args=a) for a in runs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)

    together([(0, 1, False), (1, 1, False), (2, 1, False)])  # rank 2's first process, then it dies
    assert out[0] == out[1] == [0, 1, 2]
    # Rank 2 was the first arrival, whose chore is to record the generation as the latest: it died first.
    store.delete_key(agreement.latest_key("d"))
    run(2, 1, True)  # its replacement
    assert type(out[2]).__name__ == "GenerationTaken" and "call recover() again" in str(out[2]), out[2]
    together([(0, 2, False), (1, 2, False), (2, 2, True)])  # everyone's next recover()
    assert out[0] == out[1] == out[2] == [0, 1, 2], out


def test_a_failed_round_agrees_nothing_and_the_next_round_waits_for_everyone() -> None:
    # Issue 40, item 2, at the protocol: ranks 0 and 1 give up on rank 2 (no shrink); rank 2 comes
    # after, then all three call again: one round later every rank is a member.
    store = dist.HashStore()
    out: dict[int, Any] = {}

    def run(r: int, seconds: float) -> None:
        try:
            out[r] = agreement._agree(store, _party(store, r, 3, "f"), 1, current_time() + seconds, False)
        except RecoveryError as exc:
            out[r] = exc

    early = [threading.Thread(target=run, args=(r, 0.3)) for r in (0, 1)]
    for t in early:
        t.start()
    for t in early:
        t.join(30)
    assert all(isinstance(out[r], RecoveryError) and out[r].missing_ranks == [2] for r in (0, 1)), out
    threads = [threading.Thread(target=run, args=(r, 10.0)) for r in (2, 0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out[0] == out[1] == out[2] == [0, 1, 2], out


def test_the_ringer_rings_again_the_ranks_under_a_silent_parent() -> None:
    """A ring tree whose branch holds a rank that died unannounced (a node lost with its agent):
    halfway through its window the ringer rings, directly, each rank that has not posted and
    whose parent has not either; ranks under a parent that posted (and so forwarded) are not rung
    twice, nor are ranks known dead."""
    store = dist.HashStore()
    # 7 ranks rooted at rank 2: positions 1..6 are ranks 3, 4, 5, 6, 0, 1; the parent of
    # position p is position (p - 1) // 2, so rank 3 (position 1) is the parent of 5 and 6.
    seat = _seat(store, 2, 7)
    status = {"op": "all_reduce", "seq": 4, "state": "timed_out", "t": 1.0}
    # Rank 3 is silent (the root rang it itself: not again); ranks 5 and 6 under it are rung.
    assert board.ring_missed(seat, status, posted={2, 4, 0, 1}) == 2
    got = {r: store.queue_len(keys.inbox(r)) for r in range(7)}
    assert got == {0: 0, 1: 0, 2: 0, 3: 0, 4: 0, 5: 1, 6: 1}, got
    record = json.loads(store.queue_pop(keys.inbox(5), False))
    assert (record["root"], record["op"], record["seq"]) == (2, "all_reduce", 4)
    # Under a parent that posted (it was alive and forwarded) nobody is rung again; a rank known
    # dead (the launcher said so) is not rung either.
    assert board.ring_missed(_seat(dist.HashStore(), 2, 7), status, posted={2, 3, 4}) == 0
    fresh = dist.HashStore()
    dead = {**status, "dead": "rank 6 is dead", "dead_ranks": [6]}
    assert board.ring_missed(_seat(fresh, 2, 7), dead, posted={2, 4}) == 1
    assert [fresh.queue_len(keys.inbox(r)) for r in range(7)] == [0, 0, 0, 0, 0, 1, 0]


@pytest.mark.parametrize("claimed_by", ["cpp", "python", "peer"])
def test_a_fault_claimed_and_rung_from_cpp_is_the_reports_own(claimed_by: str) -> None:
    """At a timeout the rank's watched backend claims the group's fault and rings, in C++, as soon
    as the error's builder has the GIL (csrc/watched/native_report.cpp: before the report's
    hand-over to its store thread). The report takes that claim for its own: it does not ring a
    second time, and halfway through its window it rings the ranks the ring missed, as after a
    claim of its own. A peer's claim is not its own: it rings nobody."""
    store = dist.HashStore()
    # 7 ranks, the tree rooted at rank 0: 1 and 2 under it, 3-6 under them; nobody else posts.
    seat = _seat(store, 0, 7)
    claim = {"rank": 0, "op": "barrier", "seq": 4, "state": "timed_out", "t": 1.0, "waits": []}
    if claimed_by == "cpp":
        store.set(f"{keys.board('g', 0)}/fault", json.dumps(claim))
    elif claimed_by == "peer":
        store.set(f"{keys.board('g', 0)}/fault", json.dumps({**claim, "rank": 1}))
    rep = board.report(seat, "barrier", 4, "timed_out", 1.0)
    assert rep is not None and rep.missing == [1, 2, 3, 4, 5, 6], rep
    rung = [store.queue_len(keys.inbox(r)) for r in range(7)]
    # The root's children (1, 2): rung by whoever claimed (here, C++ only in a real job); their
    # own children (3-6), whose parents stayed silent: rung again halfway through the window.
    expected = {"cpp": [0, 0, 0, 1, 1, 1, 1], "python": [0, 1, 1, 1, 1, 1, 1], "peer": [0] * 7}[claimed_by]
    assert rung == expected, rung


def test_a_rank_rung_twice_for_one_fault_acts_once() -> None:
    """A fault rung from C++ and rung again by the ringer's report (its records differ in their
    bytes: another writer, another time) is handled once."""
    from fastdist.ops import listener

    fault = {"kind": "fault", "group": "g-once", "gen": 3, "root": 0, "rank": 0, "op": "barrier", "seq": 4}
    before = len(listener._handled)
    for t in (1.0, 1.5):
        raw = json.dumps({**fault, "state": "timed_out", "t": t}).encode()
        listener._handle(dist.HashStore(), json.loads(raw), raw)
    assert len(listener._handled) == before + 1


def test_the_seat_of_a_group_torch_made_asks_its_private_backends_whether_cpp_posted() -> None:
    """A rank whose Python could not run at its deadline has its status posted from C++ by the
    backend its native report is armed on; its report must then not post a second time (the
    count would close the board one rank early). On a group torch made, that backend is one of
    fastdist's private ones, which torch's group does not list as watched."""
    import datetime

    from fastdist._native import watched_backends

    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))
    st = pgstate.state_of(pg)
    assert st.watched is None and st.own and watched_backends(pg) == []
    seat = st.seat()
    assert list(seat.backends) == list(st.own.values()) == st.reporting_backends()

    class Posted:  # a backend whose native report posted this generation's status
        def native_posted(self, generation: int) -> bool:
            return generation == 0

    store = dist.HashStore()
    posted = board.Seat(store, "n", 0, 0, 2, backends=[Posted()])
    assert not board.post_status(posted, posted.status("barrier", 1, "timed_out"))
    assert not store.check([f"{posted.prefix}/status"])  # nothing posted a second time


def test_a_peer_closed_verdict_names_as_dead_only_the_ranks_that_did_not_answer() -> None:
    """Rank 2 posted nothing (killed); rank 1 answered from outside the op (alive, it had not
    reached it yet): only rank 2 is said to have exited, and only it is presumed gone."""
    from fastdist.diagnostics import verdict

    rep = board.Report(missing=[1, 2], stacks={1: ["train.py:10 in step"]})
    assert rep.silent == [2]
    cause, why = verdict.peer_closed_verdict(rep, time.time())
    assert cause is None
    assert why == "rank 2 exited or was killed; rank 1 answered from outside the op (alive)"
    assert verdict.peer_closed_verdict(board.Report(missing=[1, 2]), time.time())[1] == (
        "ranks 1, 2 exited or were killed"
    )


def test_records_signed_in_python_and_in_cpp_carry_the_same_tag_and_a_forged_one_is_ignored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 51: with the job's secret, a record without its tag (or with another's) is ignored
    by every reader; C++ (the report made when Python cannot run) tags as Python does."""
    from fastdist._native import _watched
    from fastdist.store import seal

    body = '{"kind": "fault", "group": "default", "gen": 0, "root": 1, "op": "all_reduce", "seq": 3}'
    for key in ("k", "s" * 64, "s" * 100, "é-secret"):
        assert _watched.seal_tag(key, body) == seal.tag(body, key.encode()), key
    monkeypatch.setenv(seal.SECRET_ENV, "job-secret")
    fields = {"kind": str, "seq": int}
    assert keys.parse_record(seal.seal(body), fields) == json.loads(body)
    assert keys.parse_record(body, fields) is None  # no tag
    assert keys.parse_record(body + seal.SEP + "0" * seal.TAG_HEX, fields) is None  # a wrong one
    other = seal.tag(body, b"another job")
    assert keys.parse_record(f"{body}{seal.SEP}{other}", fields) is None
    # Without a secret the store is trusted, as torch trusts it: a tag, if any, is dropped.
    monkeypatch.delenv(seal.SECRET_ENV)
    assert keys.parse_record(body, fields) == keys.parse_record(f"{body}{seal.SEP}{other}", fields)


def test_forged_joiners_and_ddp_layouts_do_not_shape_a_recovery(monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue-51 attack: live ranks appended to a generation's joiners and a DDP bucket layout
    rewritten made two ranks take a forged layout (the model off, exit 0). With the job's secret
    only a joiner's own signed line counts (not one copied from another generation), and a layout
    record that is not the lowest live rank's fails the recovery, typed, instead of being used."""
    from fastdist.recovery import handover as rec
    from fastdist.store import seal

    monkeypatch.setenv(seal.SECRET_ENV, "job-secret")
    store = dist.HashStore()
    key1, key2 = agreement._joiners_key("g", 1), agreement._joiners_key("g", 2)
    store.append(key1, "0\n1\n")  # forged: no tag
    store.append(key1, f"{key1} 1\n")  # forged: the new form, no tag
    store.append(key1, seal.seal(f"{key2} 0") + "\n")  # signed, but another generation's
    assert agreement._joiners(store, "g", 1) == []
    store.append(key1, seal.seal(f"{key1} 2") + "\n")  # a joiner's own
    assert agreement._joiners(store, "g", 1) == [2]
    forged = json.dumps({"key": "x", "layouts": [{"params": [], "buckets": [[1], [0]]}]})
    assert keys.parse_record(forged, rec._LAYOUT_FIELDS) is None
    assert keys.parse_record(seal.seal(forged), rec._LAYOUT_FIELDS) is not None


def test_a_peers_fault_read_just_before_a_recovery_does_not_end_the_rebuilt_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The listener reads a peer's fault of generation g; while it applies it, this rank's
    recovery (another thread) moves the group to g + 1 and rebuilds its backends in place. The
    fault must land on generation g's backends (which the rebuild revives) or on none, never on
    the rebuilt ones: it would abort the new generation's first op (a CI failure of
    test_twenty_timeout_recover_cycles...: "rank 0 timed out in barrier #2 and aborted group
    'default' while this rank was in no op on it", raised by the next generation's all_gather)."""
    from fastdist.groups import registry
    from fastdist.ops import listener

    store = dist.HashStore()
    st = _state(store, 1, 2, name="g-race")
    st.generation = 9
    events: list[str] = []

    def recovery() -> None:  # recover.py's order: the generation, then the in-place rebuild
        st.generation = 10
        events.append("rebuilt")

    rebuild = threading.Thread(target=recovery)

    class Backend:
        ctl = st.ctl

        def inflight_ops(self) -> list[Any]:
            rebuild.start()  # the recovery runs while the fault is being applied
            rebuild.join(0.5)
            return []

        def fail_remote(self, detail: str, reason: str) -> bool:
            events.append("failed")
            return False

    pg = object()
    monkeypatch.setattr(registry, "watched_groups", lambda: [pg])
    monkeypatch.setattr(registry, "backends_of", lambda _pg: [Backend()])
    monkeypatch.setattr(pgstate, "state_of", lambda _pg: st)
    fault = {"kind": "fault", "group": "g-race", "gen": 9, "root": 0, "rank": 0, "op": "barrier", "seq": 2}
    raw = json.dumps({**fault, "state": "timed_out", "t": 1.0}).encode()
    listener._handle(store, fault, raw)
    rebuild.join(10)
    assert events == ["failed", "rebuilt"], events


def test_a_forged_latest_generation_does_not_fail_every_later_recovery(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 51: one ``add(.../recover/g/latest, 100)`` made every later recovery fail ("the
    other ranks already rebuilt the group as generation 100"). The record is signed now: a value
    the job's processes did not write is ignored, with a warning, and the agreement goes on."""
    store = dist.HashStore()
    assert agreement.read_latest(store, "g") == 0
    agreement.set_latest(store, "g", 3)
    assert agreement.read_latest(store, "g") == 3
    store.delete_key(agreement.latest_key("g"))
    store.add(agreement.latest_key("g"), 100)  # forged: an integer, no record
    with caplog.at_level("WARNING", logger="fastdist"):
        assert agreement.read_latest(store, "g") == 0
    assert "malformed record of the last recovery" in caplog.text or "not signed" in caplog.text
    out: dict[int, Any] = {}
    deadline = current_time() + 20

    def run(r: int) -> None:
        try:
            out[r] = agreement._agree(store, _party(store, r, 3, "g"), 1, deadline, False)
        except RecoveryError as exc:
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}, out
    assert agreement.read_latest(store, "g") == 1  # recorded afresh, signed
