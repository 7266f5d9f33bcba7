"""fastdist.rpc on 2 real processes (TensorPipe on 127.0.0.1)."""

from __future__ import annotations

import pytest
import rpc_ranks
from mp import EXIT_SLACK, describe, free_port, run_ranks


@pytest.mark.timeout(120)
def test_rpc_timeouts_are_typed_bounded_and_the_agent_keeps_working() -> None:
    port = free_port()
    results = run_ranks(rpc_ranks.rpc_timeouts, 2, env={"FASTDIST_RPC_PORT": str(port)}, timeout=100)
    info = describe(results)
    r0, r1 = results
    assert r0.returncode == 0 and r1.returncode == 0, info
    assert not r0.has("no_timeout"), info
    sync = r0.record("sync_timeout")
    assert 1.0 <= sync["elapsed"] < 1.5, info
    assert (sync["to"], sync["func"], sync["is_timeout"], sync["handler"]) == (
        "w1",
        "rpc_sleep",
        True,
        True,
    ), info
    assert sync["message"].startswith("RPC rpc_sleep to 'w1' timed out after 1 s"), info
    assert r0.record("fast_after")["value"] == 5, info
    assert 0.5 <= r0.record("async_timeout")["elapsed"] < 1.0, info
    assert r0.record("async_ok")["value"] == [2.0, 2.0], info
    scope = r0.record("scope_timeout")
    assert 1.2 <= scope["elapsed"] < 1.7 and scope["budget"] < 0.3, info
    assert 0.5 <= r0.record("to_here_timeout")["elapsed"] < 1.0, info
    assert r0.record("remote_ok")["value"] == 2, info
    assert r0.record("bad_args")["errors"] == [
        "ValueError: timeout must be positive, got 0.0",
        (
            "TypeError: timeout must be a number of seconds, a datetime.timedelta, math.inf, a "
            "RendezvousTimeout or an open fail_after/fail_at scope; got str: '5'"
        ),
        "TypeError: func must be callable, got str: 'rpc_add'",
        "TypeError: args must be a tuple or None, got list",
        "TypeError: to must be a worker name, rank or WorkerInfo, got float: 3.5",
    ], info
    # The callee is still running a call whose caller timed out: shutdown is bounded all the
    # same, and the process still exits cleanly (exit waits once more, bounded, for the call).
    assert r1.record("shutdown")["done"] is False, info
    for r in results:
        assert r.record("shutdown")["seconds"] < 2.0, info
        assert r.exited_at - r.record("ending")["wall"] < 2.5 + EXIT_SLACK, info
