"""Time from a timeout to a working recovered group, for 2, 3 and 4 ranks, against starting the
ranks afresh (spawn the processes, import torch, init the group, first barrier). Goal: recovery at
least 5x faster than a restart.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest
from conftest import SMOKE

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
import ranks
from mp import describe, run_ranks

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("world_size", [2] if SMOKE else [2, 3, 4])  # smoke: bench/ runs, cheaply
def test_recovery_vs_restart(benchmark, world_size: int) -> None:
    cycles = 1 if SMOKE else 5
    results = run_ranks(
        ranks.bench_recovery, world_size, timeout=120, env={"FASTDIST_BENCH_CYCLES": str(cycles)}
    )
    info = describe(results)
    assert all(r.returncode == 0 for r in results), info
    # Recovery: per cycle, from the first rank's timeout (the error reaching the caller, report
    # included) to the last rank past its first barrier on the new group. Restart: from spawning
    # the processes to every rank past its first barrier on a fresh group.
    cycles_by_rank = [[x for x in r.records if x["event"] == "cycle"] for r in results]
    per_cycle = []
    for i in range(cycles):
        timed_out = min(c[i]["timed_out_at"] for c in cycles_by_rank if c[i]["timed_out_at"] is not None)
        per_cycle.append(max(c[i]["recovered_at"] for c in cycles_by_rank) - timed_out)
    restart = max(r.record("started")["seconds_since_spawn"] for r in results)
    recovery = statistics.median(per_cycle)
    benchmark.extra_info.update(
        {
            "recovery_s": recovery,
            "restart_s": restart,
            "speedup": restart / recovery,
            "world_size": world_size,
        }
    )
    print(
        f"\n{world_size} ranks: recovery {recovery * 1000:.0f} ms (median of {cycles}), restart "
        f"{restart * 1000:.0f} ms, {restart / recovery:.1f}x"
    )
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
