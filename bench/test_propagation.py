"""Fault propagation (issue 14): when rank 0's op on a group times out, how soon the other ranks
waiting in the same op with a 60 s deadline raise: from rank 0's deadline to each middle rank's
raise, over several timeout -> recover cycles, at 3 and 4 ranks. Goal: median <= 50 ms (issue
42: <= 2 ms at 4 ranks).

Its anchor, measured in the same run: a round trip through the store to a thread of another
process that waits in a queue pop, as a ring's push reaches a listener, back to back and after
the waiting thread idled 0.3 s (the listeners, waiters and store threads of a fault have waited
since the op began)."""

from __future__ import annotations

import datetime
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SMOKE

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
import ranks
from mp import describe, free_port, run_ranks

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("world_size", [3] if SMOKE else [3, 4])  # smoke: bench/ runs, cheaply
def test_propagation_latency(benchmark, world_size: int) -> None:
    cycles = 1 if SMOKE else 8
    results = run_ranks(
        ranks.bench_propagation, world_size, timeout=150, env={"FASTDIST_BENCH_CYCLES": str(cycles)}
    )
    info = describe(results)
    assert all(r.returncode == 0 for r in results), info
    deadlines = {x["cycle"]: x["deadline"] for x in results[0].records if x["event"] == "raised"}
    latencies = sorted(
        (x["at"] - deadlines[x["cycle"]]) * 1000
        for r in results[1 : world_size - 1]
        for x in r.records
        if x["event"] == "raised"
    )
    assert len(latencies) == cycles * (world_size - 2), info
    median = statistics.median(latencies)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    # What the fault costs each rank's CPU (every thread: the listener, the report, the error):
    # the failing call against a barrier that waited as long without a fault, in the same cycle.
    spent = [x for r in results[: world_size - 1] for x in r.records if "cpu" in x]
    cpu = statistics.median(x["cpu"] * 1000 for x in spent)
    idle = statistics.median(x["idle_cpu"] * 1000 for x in spent)
    extra = {
        "median_ms": median,
        "p99_ms": p99,
        "samples": len(latencies),
        "cpu_ms": cpu,
        "idle_cpu_ms": idle,
    }
    benchmark.extra_info.update(extra)
    print(
        f"\npropagation, {world_size} ranks: median {median:.1f} ms, p99 {p99:.1f} ms after rank 0's "
        f"deadline; CPU time of ranks 0-{world_size - 2}: {cpu:.2f} ms in the failing call, "
        f"{idle:.2f} ms in a healthy barrier that waited 0.5 s (median)"
    )
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


def test_store_round_trip_to_an_idle_thread(benchmark) -> None:
    """The anchor of the propagation figure: a push to another process's queue and the pop of its
    answer, back to back and after 0.3 s of idleness."""
    import torch.distributed as dist

    rounds = 3 if SMOKE else 30
    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    pong = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "pong.py"), str(port), str(2 * rounds)]
    )
    try:
        store.wait(["pong/ready"])
        times: dict[str, list[float]] = {"back to back": [], "after 0.3 s idle": []}
        for kind, pause in (("back to back", 0.0), ("after 0.3 s idle", 0.3)):
            for _ in range(rounds):
                time.sleep(pause)
                t = time.perf_counter()
                store.queue_push("ping", "x")
                store.queue_pop("pong")
                times[kind].append((time.perf_counter() - t) * 1000)
        assert pong.wait(timeout=30) == 0
    finally:
        if pong.poll() is None:
            pong.kill()
            pong.wait()
    medians = {k: statistics.median(v) for k, v in times.items()}
    benchmark.extra_info.update({f"{k} ms": m for k, m in medians.items()})
    print(
        "\nstore round trip through a waiting thread of another process: "
        + ", ".join(f"{k} {m:.3f} ms" for k, m in medians.items())
    )
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
