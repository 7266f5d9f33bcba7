"""Defects found by a fault and bad-input sweep, each with its regression test: huge timeouts,
non-contiguous tensors, op numbers that a refused call must not skew, the message of a call made
after its deadline, two threads in blocking calls on one group, the engine's shutdown against
stats(), an op the backend fails as it is issued. (Ctrl-C in DDP's backward and in recv, and the
exit after it: tests/groups/test_watched.py.)"""

from __future__ import annotations

import threading

import pytest
import reliability_ranks
from mp import describe, run_ranks

pytestmark = pytest.mark.timeout(120)


def test_huge_timeouts_non_contiguous_tensors_refused_calls_and_expired_deadlines() -> None:
    results = run_ranks(reliability_ranks.reliability_single, 1, timeout=60)
    info = describe(results)
    r = results[0]
    assert r.returncode == 0, info
    # Any finite timeout beyond what gloo can represent: no backend timeout, no overflow, no hang.
    assert all(r.record("huge")["ok"].values()), info
    errors = r.record("contiguous")["errors"]
    for name, message in errors.items():
        arg = "tensor_list" if name == "all_gather_list" else "tensor"
        assert message is not None and message.startswith(f"{arg} must be contiguous"), info
    seq = r.record("seq")
    assert seq["refused"] == ["ValueError", "TypeError"] and seq["after"] == seq["before"], info
    expired = r.record("expired")
    assert (
        expired["timeout"] < 0 and "was not issued on rank 0: its deadline had passed" in expired["message"]
    ), info
    assert "timed out after -" not in expired["message"], info
    assert r.record("after")["ok"] is True, info


def test_a_second_thread_on_a_busy_group_is_refused_naming_both() -> None:
    results = run_ranks(reliability_ranks.two_threads_one_group, 2, timeout=60)
    info = describe(results)
    assert all(r.returncode == 0 for r in results), info
    rec = results[0].record("threads")
    assert rec["first"] == 2.0, info
    assert "thread 'MainThread' called it while thread 'trainer'" in rec["second"], info


def test_engine_shutdown_while_another_thread_reads_stats() -> None:
    from fastdist import _core

    e = _core.Engine(fake_clock=True)
    gate = threading.Event()
    for _ in range(200):
        e.add(1.0, lambda: gate.wait(0.002))  # Python actions, queued on the executor
    e.advance(2.0)
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            e.stats()

    t = threading.Thread(target=reader)
    t.start()
    done = threading.Event()
    threading.Thread(target=lambda: (e.shutdown(1.0), done.set()), daemon=True).start()
    try:
        assert done.wait(20), "Engine.shutdown() deadlocked against stats()"
    finally:
        stop.set()
        t.join(5)


def test_every_public_op_times_out_naming_the_missing_rank() -> None:
    results = run_ranks(reliability_ranks.every_op_times_out, 2, absent=(1,), timeout=90)
    info = describe(results)
    assert results[0].returncode == 0, info
    rec = results[0].record("ops")
    T = rec["timeout"]
    for name, r in rec["results"].items():
        assert r["kind"] == "CollectiveTimeoutError", f"{name}: {r}\n{info}"
        assert r["missing"] == [1] and r["dead"], f"{name}: {r}\n{info}"
        assert T <= r["seconds"] < T + 1.0, f"{name}: {r}\n{info}"


def test_a_member_killed_inside_recover_bounds_it_and_the_next_recover_works() -> None:
    results = run_ranks(reliability_ranks.member_dies_inside_recover, 3, timeout=90)
    info = describe(results)
    assert results[2].returncode == -9, info
    for r in results[:2]:
        assert r.returncode == 0, info
        assert r.record("timeout")["missing"] == [2], info
        err = r.record("recovery_error")
        assert err["seconds"] < 4 + 1.0, info  # within recover's timeout plus a second
        rec = r.record("recovered")
        assert rec["world_size"] == 2 and rec["value"] == 2.0, info


def test_the_store_host_dies_and_the_errors_say_so() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = run_ranks(
        reliability_ranks.store_host_dies, 3, timeout=90, env={"FASTDIST_RDZV_PORT": str(port)}
    )
    info = describe(results)
    assert results[0].returncode == -9, info
    for r in results[1:]:
        assert r.returncode == 0, info
        err = r.record("error")
        assert err["kind"] in ("GroupAbortedError", "CollectiveTimeoutError"), info
        assert f"store at 127.0.0.1:{port} (in rank 0) cannot be reached" in err["message"], info
        rec = r.record("recovery_error")
        assert rec["seconds"] < 1.0 and f"127.0.0.1:{port} (in rank 0)" in rec["message"], info


def test_a_timeout_handler_that_raises_on_fastdist_s_thread_reaches_unraisablehook() -> None:
    results = run_ranks(reliability_ranks.unwaited_handler_raises, 2, absent=(1,), timeout=60)
    info = describe(results)
    assert results[0].returncode == 0, info
    rec = results[0].record("unraisable")
    assert rec["seen"] == ["ValueError('handler saw CollectiveTimeoutError')"], info
    assert rec["completed"] and rec["error"] == "CollectiveTimeoutError", info


def test_a_forked_child_exits_promptly() -> None:
    results = run_ranks(reliability_ranks.fork_child_exits, 2, timeout=60)
    info = describe(results)
    assert all(r.returncode == 0 for r in results), info
    child = results[0].record("child")
    assert child["status"] == 0 and child["seconds"] < 3.0, info


def test_recover_called_from_two_threads_at_once_is_shared_never_a_crash() -> None:
    results = run_ranks(reliability_ranks.recover_from_two_threads, 2, timeout=100)
    info = describe(results)
    assert all(r.returncode == 0 for r in results), info
    for r in results:
        outcomes = r.record("two_threads_recover")["outcomes"]
        assert len(outcomes) == 20, info
        assert all(o == {"a": "ok", "b": "ok", "sum": 2.0} for o in outcomes), outcomes


def test_recover_called_again_after_a_failed_agreement_succeeds_once_every_rank_is_there() -> None:
    # Issue 40, item 2: the failed round used the generation up, and every later recover() on every
    # rank failed at once with the first error (rank 2 naming itself as missing), forever.
    results = run_ranks(reliability_ranks.recover_again_after_a_failed_agreement, 3, timeout=90)
    info = describe(results)
    assert all(r.returncode == 0 for r in results), info
    for r in results:
        rec = r.record("attempts")
        attempts = rec["attempts"]
        assert attempts[-1]["ok"] and rec["value"] == 3.0 and rec["world_size"] == 3, info
        assert all(r.rank not in (a.get("missing") or []) for a in attempts), info
        if r.rank < 2:  # their first recover() gave up on rank 2, their second succeeded
            assert [a["ok"] for a in attempts] == [False, True] and attempts[0]["missing"] == [2], info
        else:
            assert [a["ok"] for a in attempts] == [True], info


def test_an_op_the_backend_fails_as_it_is_issued_raises_fastdists_error() -> None:
    """gloo throws at once for a recv from a peer whose connection already closed (so does NCCL
    for an op on a communicator its watchdog aborted): raised raw, it ended a replacement that was
    receiving its state instead of letting it recover. It is a fault of the group, named."""
    results = run_ranks(reliability_ranks.op_after_a_peer_left_between_ops, 2, timeout=60)
    info = describe(results)
    assert results[0].returncode == 0 and results[1].record("leaving"), info
    for name in ("recv", "all_reduce"):
        rec = results[0].record(name)
        assert rec["fastdist"] and rec["kind"] == "GroupAbortedError", info
        assert "rank 1 exited or was killed" in rec["message"], info
    assert "recv #2 failed" in results[0].record("recv")["message"], info
