"""NCCL on real GPUs. Skipped, with the reason, where CUDA or NCCL is absent (the CPU-only
development and CI machines): there tests/groups/test_nccl_path.py runs the same scenarios on the CPU
double of ProcessGroupNCCL. scripts/gpu-check runs these on a GPU machine; the two-rank ones run
on a single GPU too (each rank a host of its own to NCCL: nccl_gpu_ranks.SHARED_GPU_ENV)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "groups"))  # the CPU double's test: the same scenarios' checks

import nccl_gpu_ranks
from mp import describe, free_port, run_ranks
from test_nccl_path import assert_stalled_step_redone

HAS_CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if HAS_CUDA else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA: this torch has no GPU"),
    pytest.mark.skipif(not dist.is_nccl_available(), reason="needs NCCL: this torch was built without it"),
]


SHARED = nccl_gpu_ranks.SHARED_GPU_ENV


def _save(name: str, data: object) -> None:
    out = os.environ.get("FASTDIST_GPU_RESULTS")
    if out:
        with open(os.path.join(out, name), "w") as f:
            json.dump(data, f, indent=2)


def test_single_gpu_timeout_abort_and_recover() -> None:
    results = run_ranks(nccl_gpu_ranks.gpu_nccl_timeout_and_recover, 1, timeout=240)
    info = describe(results)
    r = results[0]
    assert r.returncode == 0, info
    assert r.record("env")["mode"] == "2", info
    assert r.record("healthy")["value"] == 1.0, info
    runs = r.record("timeouts")["results"]
    _save(
        "gpu_timeouts.json",
        {"sync_all_reduce": runs, "stalled": [rec for rec in r.records if rec.get("event") == "stalled"]},
    )
    for run in runs:
        # CollectiveTimeoutError within 1.5 s of the call for a 1 s timeout (the bound).
        assert 1.0 <= run["detected"] < 1.5, info
        assert run["value"] == 2.0, info
        assert "all_reduce" in run["message"] and "after a timeout of 1 s" in run["message"], info
    stalled = {rec["kind"]: rec for rec in r.records if rec.get("event") == "stalled"}
    assert set(stalled) == {"async_all_reduce", "barrier"}, info
    for rec in stalled.values():
        assert 1.0 <= rec["detected"] < 1.5, info
    assert r.record("alive_after")["ok"] is True, info


def test_a_rank_that_skips_the_collective_is_named_missing_by_the_deadline() -> None:
    results = run_ranks(nccl_gpu_ranks.gpu_missing_rank, 2, absent=(1,), env=SHARED, timeout=120)
    info = describe(results)
    r = results[0]
    t = r.record("timeout")
    _save("gpu_missing.json", {"timeout": t, "aborted": r.record("aborted")})
    assert t["missing"] == [1] and 2.0 <= t["elapsed"] < 2.5, info  # named within deadline + 0.5 s
    assert r.returncode == 0, info


def test_a_rank_killed_mid_collective_leaves_its_peer_alive_and_working() -> None:
    results = run_ranks(nccl_gpu_ranks.gpu_killed_rank, 2, env=SHARED, timeout=120)
    info = describe(results)
    r = results[0]
    err = r.record("error")
    _save("gpu_killed.json", err)
    assert err["kind"] in ("CollectiveTimeoutError", "GroupAbortedError") and err["elapsed"] < 5.5, info
    alone = r.record("alone")
    assert alone["world"] == 1 and alone["value"] == 3.0 and r.returncode == 0, info


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_a_stalled_step_raises_in_time_and_is_redone_exactly_on_nccl(kind: str) -> None:
    scenario = nccl_gpu_ranks.gpu_train_ddp if kind == "ddp" else nccl_gpu_ranks.gpu_train_fsdp2
    results = run_ranks(scenario, 2, env=SHARED, timeout=180)
    _save(f"gpu_{kind}_stall.json", [r.records for r in results])
    # The same arithmetic on the same GPU: only the reduction's order can differ from the
    # one-process reference.
    assert_stalled_step_redone(results, 1e-5)


def test_a_graph_captured_collective_works_or_is_refused_clearly() -> None:
    results = run_ranks(nccl_gpu_ranks.gpu_graph_capture, 1, env=SHARED, timeout=120)
    info = describe(results)
    r = results[0]
    _save("gpu_graph.json", r.records)
    if r.has("captured"):
        assert r.record("captured")["value"] == 1.0, info  # world 1: the sum is the tensor
    else:
        assert "graph" in r.record("refused")["message"].lower(), info
    assert r.record("after")["value"] == 1.0 and r.returncode == 0, info


def test_torchrun_worker_survives_a_timeout_and_recovers(tmp_path) -> None:
    """torchrun injects TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (tear down); fastdist replaces that
    default with 2, so the rescued worker lives on and recovers."""
    from test_torchrun import _torchrun

    code, recs, log = _torchrun(
        tmp_path, "gpu_stall", 1, ["--master-addr=127.0.0.1", f"--master-port={free_port()}"], timeout=120
    )
    info = f"{recs}\n{log[-4000:]}"
    assert code == 0, info
    rec = recs["0-0"]
    assert rec["nccl_mode"] == "2" and 1.0 <= rec["detected"] < 1.5, info
    assert rec["alive_after_10s"] and rec["value"] == 2.0, info


def test_fastdist_run_replaces_a_dead_gpu_worker(tmp_path) -> None:
    """The example DDP script on NCCL under fastdist run, 2 workers on the GPUs there are: rank 1
    SIGKILLed in its backward at step 5 is replaced, and the model equals an undisturbed run's."""
    from fastdist.examples.train_ddp import compare
    from mp import run_session

    def launch(out, *script: str) -> str:
        out.mkdir()
        cmd = [
            sys.executable,
            "-m",
            "fastdist.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            str(HERE / "shared_gpu_train.py"),
            "--steps",
            "12",
            "--out",
            str(out),
            *script,
        ]
        code, log = run_session(cmd, 150, env=SHARED)
        assert code == 0, log[-6000:]
        return log

    launch(tmp_path / "ref")
    log = launch(tmp_path / "killed", "--kill-rank", "1", "--kill-step", "5")
    assert "rank 1: joined the running job at step 5" in log, log[-6000:]
    diff = compare(str(tmp_path / "ref"), str(tmp_path / "killed"), 2)
    _save("gpu_replace.json", {"diff": diff})
    assert diff <= 1e-5, log[-6000:]


def test_device_id_with_new_group_and_a_2d_mesh() -> None:
    results = run_ranks(nccl_gpu_ranks.gpu_device_id_subgroups, 2, env=SHARED, timeout=120)
    info = describe(results)
    for r in results:
        s = r.record("subgroups")
        assert s["new_group"] == 2.0 and s["mesh"] == 2.0, info
        assert r.returncode == 0, info


def test_an_op_torchs_watchdog_aborted_fails_on_nccl() -> None:
    results = run_ranks(nccl_gpu_ranks.gpu_torch_watchdog_abort, 2, absent=(1,), env=SHARED, timeout=120)
    info = describe(results)
    r = results[0]
    _save(
        "gpu_torch_watchdog.json",
        [rec for rec in r.records if rec.get("event") in ("failed", "taken_for_success")],
    )
    assert not r.has("taken_for_success"), info
    assert r.record("failed")["elapsed"] < 8.0, info  # torch's watchdog (2 s) acted first
