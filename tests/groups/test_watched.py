"""Watched groups: collectives that torch issues itself (DDP's backward, FSDP2, DeviceMesh,
torch.distributed.*) are bounded by fastdist scopes or the group's timeout, raise
CollectiveTimeoutError naming the missing rank, and recover in place under the same objects.

Timing: a step's scope is 2 s (watched_ranks.STEP); the error must come after it and within
the report window plus slack for a loaded 2-core machine."""

from __future__ import annotations

import pytest
import watched_ranks
from mp import EXIT_SLACK, describe, run_ranks

pytestmark = pytest.mark.timeout(150)
STEP = 2.0


def _check_training(results, info, world_size=3):
    for r in results[:2]:
        err = r.record("error")
        assert err["kind"] == "CollectiveTimeoutError" and err["missing"] == [2], info
        assert STEP <= err["seconds"] < STEP + 1.0, info
    # The stopped rank finds, on waking, that its deadline passed and the others gave up.
    assert results[2].record("error")["kind"] in ("CollectiveTimeoutError", "GroupAbortedError"), info
    for r in results:
        assert r.returncode == 0, info
        rec = r.record("recovered")
        assert rec["same_group"] and rec["world_size"] == world_size, info
    finals = [r.record("final")["params"] for r in results]
    assert finals[0] == finals[1] == finals[2], info


def test_ddp_step_in_fail_after_names_the_stopped_rank_and_trains_on_after_recover() -> None:
    results = run_ranks(watched_ranks.watched_ddp, 3, timeout=120)
    _check_training(results, describe(results))


def test_ddp_on_the_polled_path_the_nccl_logic_on_gloo() -> None:
    """The same DDP run on the CPU double of NCCL (FASTDIST_TEST_BACKEND=nccl_double: completion
    polled, not taken from the future): the deadline, report and recovery hold there too."""
    results = run_ranks(
        watched_ranks.watched_ddp, 3, timeout=120, env={"FASTDIST_TEST_BACKEND": "nccl_double"}
    )
    _check_training(results, describe(results))


def test_fsdp2_step_in_fail_after_names_the_stopped_rank_and_trains_on_after_recover() -> None:
    results = run_ranks(watched_ranks.watched_fsdp2, 3, timeout=120)
    _check_training(results, describe(results))


def test_torch_distributed_calls_scopes_group_timeout_subgroups_and_device_mesh() -> None:
    results = run_ranks(watched_ranks.watched_dist_ops, 4, timeout=120)
    info = describe(results)
    phases = ["all_reduce", "barrier", "sub_default", "mesh"]
    bounds = {"all_reduce": 1.0, "barrier": 1.0, "sub_default": 1.5, "mesh": 1.0}
    for r in results:
        assert r.returncode == 0, info
        healthy = r.record("healthy")
        assert healthy["value"] == [4.0, 4.0] and healthy["tp_size"] == 2, info
        assert healthy["gathered"] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0], info
        assert [rec["phase"] for rec in r.records if rec["event"] == "recovered"] == phases, info
        assert all(rec["same"] for rec in r.records if rec["event"] == "recovered"), info
        after = r.record("after")
        assert after["value"] == 10.0 and after["mesh_value"] == (3.0 if r.rank < 2 else 7.0), info
    for r in results[:3]:
        got = {rec["phase"]: rec for rec in r.records if rec["event"] == "timeout"}
        expected = phases if r.rank == 2 else phases[:3]
        assert sorted(got) == sorted(expected) and not r.has("no_error"), info
        for name, rec in got.items():
            assert rec["missing"] == [3], info
            # With the first rank to time out, up to the skew of their starts before its own.
            assert bounds[name] - 0.1 <= rec["seconds"] < bounds[name] + 1.0, info


def test_ctrl_c_before_ddp_issues_its_all_reduce_is_raised_when_it_does() -> None:
    """Ctrl-C while the main thread computes a gradient in C++ and no op is in flight: the
    all_reduce DDP issues next raises the KeyboardInterrupt at once."""
    results = run_ranks(watched_ranks.ctrl_c_before_the_op, 2, absent=(1,), timeout=60)
    info = describe(results)
    r0 = results[0]
    assert r0.returncode == 0, info
    assert r0.record("interrupted")["after"] < 15.0, info  # not the group's 60 s
    assert r0.record("dead")["default"] is True, info


def test_ctrl_c_inside_ddp_backward_and_recv_then_a_prompt_exit() -> None:
    results = run_ranks(watched_ranks.watched_ctrl_c, 2, absent=(1,), timeout=60)
    info = describe(results)
    r0 = results[0]
    assert r0.returncode == 0, info
    got = {rec["where"]: rec["after"] for rec in r0.records if rec["event"] == "interrupted"}
    assert set(got) == {"ddp_backward", "recv"}, info
    assert all(0 <= after < 0.5 for after in got.values()), info
    assert r0.record("dead") == {**r0.record("dead"), "default": True, "sub": True}, info
    assert "terminate called" not in r0.stderr and "Fatal Python error" not in r0.stderr, info
    # A prompt exit: after Ctrl-C fastdist does not wait for the interrupted ops still in gloo's
    # hands (they wait for a peer that is not coming): 1.1-1.2 s measured here (3.4-3.6 s before;
    # most of what is left is torch's teardown of DDP and two groups), the bound wide for a
    # loaded 2-core machine.
    assert r0.exited_at - r0.record("ending")["wall"] < 2.5 + EXIT_SLACK, info


def test_ctrl_c_on_one_rank_is_told_to_its_peers_at_once() -> None:
    results = run_ranks(watched_ranks.ctrl_c_rings_peers, 3, absent=(2,), timeout=60)
    info = describe(results)
    assert results[0].returncode == 0 and results[1].returncode == 0, info
    assert results[0].record("interrupted")["after"] < 1.5, info
    peer = results[1].record("peer")
    assert peer["type"] == "GroupAbortedError", info
    assert "rank 0 was interrupted (KeyboardInterrupt) in all_reduce #2" in peer["message"], info
    assert peer["after"] < 2.5, info  # 1 s to the interrupt, then the ring: not the 60 s deadline
