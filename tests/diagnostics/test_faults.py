"""Faults on real processes (3 or 4 ranks, gloo, TCPStore on 127.0.0.1): which ranks raise,
within what time, what the report says, and that recovery then gives correct results.

Timing: the step timeout is 1.5 s (faults_ranks.STEP_TIMEOUT). A rank that waited must raise no
earlier than that and within 1 s after it (the report window adds at most 0.15 s; the rest is
slack for a loaded 2-core machine).
"""

from __future__ import annotations

import re

import faults_ranks
import pytest
from mp import describe, run_ranks

pytestmark = pytest.mark.timeout(120)
T = 1.5


def _check_timed_out(r, info, missing, seconds_max=T + 1.0):
    err = r.record("error")
    assert err["kind"] == "CollectiveTimeoutError", info
    assert err["missing"] == missing, info
    call = r.record("failing_call")
    # A rank rung by another rank's timeout raises when that rank's deadline passes: up to the
    # difference in their ops' start times before its own.
    assert T - 0.1 <= call["seconds"] < seconds_max, info
    return err


def _check_recovered(r, info, world_size, expected_sum):
    rec = r.record("recovered")
    assert rec["world_size"] == world_size and rec["sum"] == expected_sum, info
    assert rec["objs"] == list(range(world_size)) and rec["default"], info
    return rec


def test_two_ranks_of_four_hang() -> None:
    results = run_ranks(faults_ranks.fault_hang_two_of_four, 4, stuck=(2, 3))
    info = describe(results)
    for r in results[:2]:
        assert r.returncode == 0, info
        err = _check_timed_out(r, info, [2, 3])
        assert r.record("failed_at")["step"] == 2
        first, *where = err["message"].splitlines()
        # (a rank rung by the other's timeout within 50 ms of its own deadline says who was first)
        other = 1 - r.rank
        assert first.removesuffix(f" [rank {other} timed out first]") == (
            f"all_reduce #3 on group 'default' timed out on rank {r.rank} after a timeout of 1.5 s: "
            "ranks 2, 3 never arrived (last seen in all_reduce #2)"
        ), info
        # Where the two stuck ranks are (issue 14): alive, in the scenario's loop, not in an op.
        assert [w.split(":")[0].strip() for w in where] == [
            "rank 2 is not in a collective",
            "rank 3 is not in a collective",
        ]
        assert all("faults_ranks.py:" in w and " in _train" in w for w in where), info
        rec = _check_recovered(r, info, 2, 3.0)
        assert rec["rank"] == r.rank
        assert r.record("recover_time")["seconds"] < 5.0, info


def test_a_stopped_rank_is_reported_and_left_out() -> None:
    results = run_ranks(faults_ranks.fault_sigstop, 3, stuck=(2,))
    info = describe(results)
    for r in results[:2]:
        assert r.returncode == 0, info
        _check_timed_out(r, info, [2])
        _check_recovered(r, info, 2, 3.0)


def test_a_rank_that_exits_is_reported_and_left_out() -> None:
    results = run_ranks(faults_ranks.fault_exit, 3)
    info = describe(results)
    assert results[1].returncode == 0 and not results[1].has("error"), info
    for r in (results[0], results[2]):
        assert r.returncode == 0, info
        err = r.record("error")
        # The peer's closed sockets are noticed at once (GroupAbortedError naming it), or, if
        # this rank's ring neighbour is alive, at the deadline (a timeout naming it missing).
        if err["kind"] == "GroupAbortedError":
            assert "rank 1 exited or was killed" in err["message"], info
            assert r.record("failing_call")["seconds"] < T + 1.0, info
        else:
            _check_timed_out(r, info, [1])
        rec = _check_recovered(r, info, 2, 3.0)
        assert rec["rank"] == (0 if r.rank == 0 else 1), info  # renumbered in old-rank order


def _named_dead(message: str) -> set[int]:
    """The ranks an error's message says exited or were killed."""
    found = re.findall(r"ranks? ([\d, ]+) exited or w", message)
    return {int(x) for group in found for x in group.split(",")}


def test_a_rank_killed_in_the_middle_of_an_all_reduce() -> None:
    results = run_ranks(faults_ranks.fault_sigkill_mid_all_reduce, 3)
    info = describe(results)
    assert results[2].returncode == -9, info
    for r in results[:2]:
        assert r.returncode == 0, info
        err = r.record("error")
        assert err["kind"] in ("GroupAbortedError", "CollectiveTimeoutError"), info
        if err["kind"] == "GroupAbortedError":
            if "while this rank was in no op on it" in err["message"]:
                # Rung by the other live rank before it reached the op: it says who failed.
                assert f"rank {1 - r.rank} failed in all_reduce #2" in err["message"], info
            else:
                # The dead rank named as dead, the live one (rung outside the op) as alive.
                assert _named_dead(err["message"]) == {2}, info
        else:
            assert err["missing"] == [2], info
        assert err["elapsed"] < T + 2.0, info
        _check_recovered(r, info, 2, 3.0)


def test_wrong_collective_gives_the_same_desync_report_everywhere_then_checks_catch_a_mismatch() -> None:
    results = run_ranks(faults_ranks.fault_wrong_collective, 3)
    info = describe(results)
    for r in results:
        assert r.returncode == 0, info
        err = r.record("error")
        assert err["kind"] == "CollectiveTimeoutError" and err["missing"] == [], info
        if r.rank == 2:
            assert err["desynced"] == {"0": "all_reduce #2", "1": "all_reduce #2"}, info
            assert err["message"].startswith(
                "barrier #2 on group 'default' timed out on rank 2 after a timeout of 1.5 s: "
                "rank 0 is in all_reduce #2; rank 1 is in all_reduce #2"
            ), info
        else:
            assert err["desynced"] == {"2": "barrier #2"}, info
            assert err["message"].startswith(
                f"all_reduce #2 on group 'default' timed out on rank {r.rank} after a timeout of 1.5 s: "
                "rank 2 is in barrier #2"
            ), info
        _check_recovered(r, info, 3, 6.0)
        mismatch = r.record("mismatch")
        assert mismatch["differing"] == {
            "2": "all_gather(float32[3], [float32[2], float32[2], float32[2]])"
        }, info
        assert r.record("after_mismatch")["value"] == 3.0, info


def test_straggler_is_refused_at_once_then_joins_the_recovery() -> None:
    results = run_ranks(faults_ranks.fault_straggler_rejoins, 3)
    info = describe(results)
    for r in results[:2]:
        assert r.returncode == 0, info
        _check_timed_out(r, info, [2])
    straggler = results[2]
    assert straggler.returncode == 0, info
    assert straggler.record("error")["kind"] == "GroupAbortedError", info
    assert straggler.record("failing_call")["seconds"] < 0.5, info
    # It was told while it was still elsewhere (issue 14: the fault reaches every rank at once).
    assert re.search(
        r"rank [01] timed out in all_reduce #\d+ and aborted group 'default' "
        r"while this rank was in no op on it",
        straggler.record("error")["message"],
    ), info
    for r in results:
        _check_recovered(r, info, 3, 6.0)


def test_straggler_left_out_by_a_shrinking_recovery_is_told_so() -> None:
    results = run_ranks(faults_ranks.fault_straggler_left_out, 3)
    info = describe(results)
    for r in results[:2]:
        assert r.returncode == 0, info
        _check_timed_out(r, info, [2])
        _check_recovered(r, info, 2, 3.0)
    straggler = results[2]
    assert straggler.returncode == 0, info
    assert straggler.record("error")["kind"] == "GroupAbortedError", info
    assert straggler.record("failing_call")["seconds"] < 0.5, info
    assert (
        "already rebuilt the group as generation 1 without this rank"
        in straggler.record("left_out")["message"]
    ), info


def test_a_dead_peer_is_not_waited_for_by_its_ops_or_by_a_shrinking_recovery() -> None:
    results = run_ranks(faults_ranks.dead_peer_not_waited_for, 3, timeout=60)
    info = describe(results)
    assert results[2].returncode == -9, info
    died = results[2].record("dying")["wall"]
    for r in results[:2]:
        assert r.returncode == 0, info
        err = r.record("error")
        # The rank connected to it names it; a rank rung by that one says what it saw.
        assert err["kind"] == "GroupAbortedError" and "exited or was killed" in err["message"], info
        assert err["wall"] - died < 1.0, info  # not the 3.3 s deadline
        assert r.record("recover_time")["seconds"] < 2.0, info  # not recover's 20 s
        _check_recovered(r, info, 2, 3.0)
