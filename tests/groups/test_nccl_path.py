"""fastdist's NCCL code path (poll for device completion, deadline, abort, dead group, recover)
on the CPU, against tests/support/fake_nccl.py: a C++ double of ProcessGroupNCCL that follows torch's
contract for it (isSuccess() raises, a synchronous op hands back no work, futures complete at
enqueue, wait() only orders streams, an aborted op reads as completed) and rides the C++ path
real NCCL takes. Not a claim about NCCL itself: that runs in tests/gpu."""

from __future__ import annotations

import warnings

import nccl_path_ranks
import pytest
from mp import EXIT_SLACK, describe, run_ranks


@pytest.mark.timeout(60)
def test_nccl_path_logic_on_a_test_double() -> None:
    results = run_ranks(nccl_path_ranks.fake_nccl_logic, 1, env={"FASTDIST_ABORT_TIMEOUT": "0.5"})
    info = describe(results)
    r = results[0]
    assert 0.6 <= r.record("blocking")["elapsed"] < 2.0, info  # two ops, 0.3 s of "device" time each
    a = r.record("async")
    assert a["first"] is False and a["ok"] is True and 0.2 <= a["elapsed"] < 0.5, info
    assert a["unwaited_done"], info
    t = r.record("timeout")
    assert 0.5 <= t["elapsed"] < 1.5 and t["aborts_done"] and t["aborted"] == 1, info
    assert "all_reduce #5 on group 'default' timed out on rank 0 after a timeout of 0.5 s" in t["message"], (
        info
    )
    assert r.has("refused"), info
    rec = r.record("recovered")
    assert rec["value"] == 3.0 and rec["dead"] is False, info
    un = r.record("unwaited")
    assert (
        un["completed"] and un["error"] == "CollectiveTimeoutError" and un["dead"] and un["aborted"] == 2
    ), info
    assert r.has("before_hanging_abort") and not r.has("survived_hanging_abort"), info
    assert 0.3 <= r.record("raised_while_aborting")["elapsed"] < 0.8, info  # not held by the abort
    assert r.returncode == 1, info
    assert "did not return within 0.5 s; ending the process" in r.stderr, info
    assert r.exited_at - r.record("before_hanging_abort")["wall"] < 3.0 + EXIT_SLACK, info


@pytest.mark.timeout(60)
def test_the_nccl_double_follows_torchs_contract_and_torch_ops_are_bounded() -> None:
    # What the first GPU run met (../shared/notes/gpu.md): isSuccess() raising failed every op,
    # a synchronous op's missing work crashed the process, an enqueue-time future let the
    # host go on. Each is part of the double, and the watched path copes with each.
    results = run_ranks(nccl_path_ranks.nccl_double_contract, 1)
    info = describe(results)
    r = results[0]
    d = r.record("double")
    assert d["sync_work"] is True and d["is_success"] == "WorkNCCL::isSuccess() is deprecated", info
    assert d["future_done_at_enqueue"] is True and d["completed_at_enqueue"] is False, info
    assert d["wait_returned"] is True and d["wait_seconds"] < 0.15, info  # no host wait
    aborted = r.record("double_aborted")
    assert aborted["completed"] is True and aborted["error"] is True, info  # completed, no error
    ops = r.record("torch_ops")
    # The synchronous op and the async one each ran 0.3 s on the "device" before returning.
    assert 0.6 <= ops["elapsed"] < 2.0 and ops["future_done_at_issue"] is False, info
    t = r.record("sync_timeout")
    assert 0.5 <= t["elapsed"] < 1.5, info
    assert "all_reduce #3 on group 'default' timed out on rank 0" in t["message"], info
    assert r.record("after_recovery")["ok"] is True and r.record("after_recovery")["error"] is True, info
    assert r.returncode == 0, info


@pytest.mark.timeout(90)
def test_an_op_issued_on_a_communicator_the_watchdog_aborted_between_ops_raises_fastdists_error() -> None:
    # As ProcessGroupNCCL: NCCLComm::getNcclComm throws DistBackendError on an aborted
    # communicator as the op is issued. Raw, it was torch's error, not fastdist's.
    results = run_ranks(nccl_path_ranks.comm_error_between_ops, 1, timeout=60)
    info = describe(results)
    r = results[0]
    assert r.returncode == 0, info
    failed = r.record("failed")
    assert failed["fastdist"] and failed["kind"] == "GroupAbortedError", info
    assert "NCCL communicator was aborted on rank 0" in failed["message"], info
    assert r.record("torch_error")["error"] == 2, info  # c10d::ErrorType::COMM_ERROR
    assert r.record("recovered")["value"] == 3.0, info


def test_an_op_torchs_own_watchdog_aborted_fails_and_recovery_does_not_wait_for_it() -> None:
    # ProcessGroupNCCL's watchdog (its timeout, 1 s) aborts the communicator before
    # fastdist's deadline (6 s): the error is set on the watchdog's copy of the work, the caller's
    # reads as completed with no error. Without fastdist asking the backend's getError(), the
    # all_reduce returned at ~1 s as a success, its result never computed.
    results = run_ranks(nccl_path_ranks.torch_side_abort, 1, timeout=80)
    info = describe(results)
    r = results[0]
    assert not r.has("taken_for_success"), info
    failed = r.record("failed")
    assert 0.9 <= failed["elapsed"] < 4.0, info  # at the watchdog's abort, not at the 6 s deadline
    assert "watchdog" in failed["message"], info
    # TIMEOUT (c10d::ErrorType 1), set by the double's watchdog; fastdist aborted nothing itself.
    assert r.record("torch_error")["error"] == 1, info
    rec = r.record("recovered")
    # The old backend's destructor waits out the watchdog's 20 s dump: recover() does not.
    assert rec["elapsed"] < 5.0 and rec["value"] == 3.0, info
    assert rec["timeout"] == 30.0, info  # the group's timeout, not what was left of recover()'s
    assert r.returncode == 0, info


def assert_stalled_step_redone(results: list, tolerance: float) -> None:
    """What nccl_path_ranks.train_with_a_stall must show (tests/gpu asserts the same on a GPU)."""
    info = describe(results)
    r0, r1 = results
    err = r0.record("error")
    # Raised inside the step at its deadline (1.5 s; rank 1's 4 s sleep is not waited out), before
    # opt.step() applied gradients that were never reduced.
    assert err["kind"] in ("CollectiveTimeoutError", "GroupAbortedError"), info
    assert 1.5 <= err["elapsed"] < 2.5, info
    assert (r0.record("at_error")["step"], r0.record("at_error")["applied"]) == (2, 2), info
    assert r1.has("error") and r1.record("at_error")["applied"] == 2, info
    for r in results:
        assert r.record("recovered")["same_group"] is True, info
        done = r.record("done")
        assert done["steps"] == 5 and done["applied"] == 5, info
        assert done["diff"] <= tolerance, info  # the undisturbed run's model: the step redone once
        assert r.returncode == 0, info


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_a_stalled_step_on_the_nccl_path_raises_in_time_and_is_redone_exactly(kind: str) -> None:
    scenario = nccl_path_ranks.nccl_double_ddp if kind == "ddp" else nccl_path_ranks.nccl_double_fsdp2
    assert_stalled_step_redone(run_ranks(scenario, 2, timeout=120), 1e-6)


@pytest.mark.timeout(60)
def test_missing_and_desynced_ranks_are_reported_on_the_nccl_path() -> None:
    results = run_ranks(nccl_path_ranks.fake_nccl_report, 3, absent=(2,))
    info = describe(results)
    for r in results:
        assert r.returncode == 0 and r.has("healthy"), info
    elapsed = []
    for r, other, its_op in ((results[0], 1, "barrier #3"), (results[1], 0, "all_reduce #3")):
        err = r.record("error")
        # Each rank raises with the first of the two to time out (the fault is rung to the
        # other): up to the skew of their starts before its own deadline.
        assert err["kind"] == "CollectiveTimeoutError" and 1.2 <= err["elapsed"] < 2.5, info
        elapsed.append(err["elapsed"])
        assert err["missing"] == [2] and err["desynced"] == {str(other): its_op}, info
        assert "rank 2 never arrived (last seen in barrier #2)" in err["message"], info
        assert r.has("refused"), info
    assert max(elapsed) >= 1.5, info  # the first to time out waited its whole deadline


def test_nccl_error_handling_mode_is_set_or_respected(monkeypatch) -> None:
    from fastdist.process_group import NCCL_ERROR_HANDLING, configure_nccl_error_handling

    monkeypatch.delenv(NCCL_ERROR_HANDLING, raising=False)
    configure_nccl_error_handling("gloo")
    import os

    assert NCCL_ERROR_HANDLING not in os.environ
    configure_nccl_error_handling("nccl")
    assert os.environ[NCCL_ERROR_HANDLING] == "2"
    monkeypatch.setenv(NCCL_ERROR_HANDLING, "3")
    with pytest.warns(
        RuntimeWarning, match="TORCH_NCCL_ASYNC_ERROR_HANDLING=3 was set explicitly and is kept"
    ):
        configure_nccl_error_handling(None)
    assert os.environ[NCCL_ERROR_HANDLING] == "3"
    monkeypatch.setenv(NCCL_ERROR_HANDLING, "2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        configure_nccl_error_handling("cpu:gloo,cuda:nccl")
