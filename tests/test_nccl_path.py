"""fastdist's NCCL code path (poll for device completion, deadline, abort, dead group, recover,
reaping) on the CPU, against tests/fake_nccl.py: a test double registered through torch's
third-party backend API, not a claim about NCCL. The real thing runs in tests/gpu."""

from __future__ import annotations

import warnings

import pytest

from mp import describe, run_ranks


@pytest.mark.timeout(60)
def test_nccl_path_logic_on_a_test_double() -> None:
    results = run_ranks("fake_nccl_logic", 1, env={"FASTDIST_ABORT_TIMEOUT": "0.5"})
    info = describe(results)
    r = results[0]
    assert 0.6 <= r.record("blocking")["elapsed"] < 2.0, info  # two ops, 0.3 s of "device" time each
    a = r.record("async")
    assert a["first"] is False and a["ok"] is True and 0.1 <= a["elapsed"] < 1.0 and a["reaped"] == 1, info
    t = r.record("timeout")
    assert 0.5 <= t["elapsed"] < 1.5 and t["aborted"] == 1, info
    assert "all_reduce #4 on group 'default' timed out after 0.5 s on rank 0" in t["message"], info
    assert r.has("refused"), info
    rec = r.record("recovered")
    assert rec["value"] == 3.0 and rec["dead"] is False, info
    un = r.record("unwaited")
    assert un["completed"] and un["error"] == "CollectiveTimeoutError" and un["dead"] and un["aborted"] == 2, info
    assert r.has("before_hanging_abort") and not r.has("survived_hanging_abort"), info
    assert r.returncode == 1, info
    assert "did not return within 0.5 s; ending the process" in r.stderr, info
    assert r.exited_at - r.record("before_hanging_abort")["wall"] < 3.0, info


def test_nccl_error_handling_mode_is_set_or_respected(monkeypatch) -> None:
    from fastdist.recovery import NCCL_ERROR_HANDLING, configure_nccl_error_handling

    monkeypatch.delenv(NCCL_ERROR_HANDLING, raising=False)
    configure_nccl_error_handling("gloo")
    import os

    assert NCCL_ERROR_HANDLING not in os.environ
    configure_nccl_error_handling("nccl")
    assert os.environ[NCCL_ERROR_HANDLING] == "2"
    monkeypatch.setenv(NCCL_ERROR_HANDLING, "3")
    with pytest.warns(RuntimeWarning, match="TORCH_NCCL_ASYNC_ERROR_HANDLING=3 was set explicitly and is kept"):
        configure_nccl_error_handling(None)
    assert os.environ[NCCL_ERROR_HANDLING] == "3"
    monkeypatch.setenv(NCCL_ERROR_HANDLING, "2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        configure_nccl_error_handling("cpu:gloo,cuda:nccl")
