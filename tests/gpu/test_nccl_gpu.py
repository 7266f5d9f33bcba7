"""NCCL on real GPUs. Skipped, with the reason, where CUDA or NCCL is absent (the CPU-only
development and CI machines): there tests/test_nccl_path.py checks the same logic against a
test double. scripts/gpu-check runs these on a GPU machine."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from mp import describe, run_ranks

from gpu import nccl_gpu_ranks

HAS_CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if HAS_CUDA else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA: this torch has no GPU"),
    pytest.mark.skipif(not dist.is_nccl_available(), reason="needs NCCL: this torch was built without it"),
]


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


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 or more GPUs, this machine has {GPUS}")
def test_rank_that_skips_the_collective_is_reported_missing() -> None:
    n = min(GPUS, 4)
    results = run_ranks(nccl_gpu_ranks.gpu_nccl_missing_rank, n, absent=(n - 1,), timeout=240)
    info = describe(results)
    for r in results[:-1]:
        assert r.returncode == 0, info
        t = r.record("timeout")
        assert t["missing"] == [n - 1] and 2.0 <= t["elapsed"] < 3.5, info


def test_torchrun_worker_survives_a_timeout_and_recovers(tmp_path) -> None:
    """torchrun injects TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (tear down); fastdist replaces that
    default with 2, so the rescued worker lives on and recovers."""
    from test_torchrun import _free_port, _torchrun

    code, recs, log = _torchrun(
        tmp_path, "gpu_stall", 1, ["--master-addr=127.0.0.1", f"--master-port={_free_port()}"], timeout=120
    )
    info = f"{recs}\n{log[-4000:]}"
    assert code == 0, info
    rec = recs["0-0"]
    assert rec["nccl_mode"] == "2" and 1.0 <= rec["detected"] < 1.5, info
    assert rec["alive_after_10s"] and rec["value"] == 2.0, info
