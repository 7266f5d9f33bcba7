"""The NCCL path with a GPU: a watched group's ops against plain NCCL's, and the abort with a
kernel in flight. (The Python reaper of unwatched NCCL works, whose cost was measured here, is
gone: every group's works are polled in C++.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
import ranks
from mp import describe, run_ranks

pytestmark = pytest.mark.timeout(300)


def _gpu_record(benchmark, scenario, event: str, world: int = 1, **kwargs) -> dict:
    """Runs a GPU benchmark scenario; its record, kept in the benchmark's JSON."""
    results = run_ranks(scenario, world, **kwargs)
    assert results[0].returncode == 0, describe(results)
    rec = results[0].record(event)
    benchmark.extra_info.update(rec)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    return rec


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_all_reduce_overhead(benchmark) -> None:
    rec = _gpu_record(benchmark, ranks.gpu_bench, "gpu_bench", timeout=240)
    for k in ("1", "1mb"):
        print(
            f"\nNCCL all_reduce {k}: raw+sync {rec[k]['raw_sync_us']:.1f} us, fastdist "
            f"{rec[k]['fastdist_us']:.1f} us, ratio {rec[k]['ratio']:.3f}"
        )
    a = rec["async_issue"]
    print(
        f"\nNCCL async all_reduce, issue cost: raw {a['raw_us']:.1f} us, "
        f"fastdist {a['fastdist_us']:.1f} us, ratio {a['ratio']:.3f}"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_torch_ops_on_a_watched_group(benchmark) -> None:
    rec = _gpu_record(benchmark, ranks.gpu_torch_ops_bench, "gpu_torch_ops", timeout=280)
    for k, v in rec.items():
        if isinstance(v, dict):
            print(f"\nwatched/plain NCCL {k}: {v}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_abort_with_a_kernel_in_flight(benchmark) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gpu"))
    from nccl_gpu_ranks import SHARED_GPU_ENV

    rec = _gpu_record(
        benchmark, ranks.gpu_abort_bench, "abort", world=2, absent=(1,), env=SHARED_GPU_ENV, timeout=120
    )
    print(f"\nNCCL abort with a kernel in flight: {rec}")
