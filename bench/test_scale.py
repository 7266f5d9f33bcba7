"""The engine at scale: register + cancel cost and memory per pending deadline at 1, 1,000 and
100,000 pending (goals: flat cost, <= 256 bytes each), and timer-thread wake-ups per second while
idle with deadlines pending (goal: 0)."""

from __future__ import annotations

import gc
import time

import pytest
from conftest import SMOKE
from fastdist import _core

pytestmark = pytest.mark.timeout(300)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("pending", [1, 1000, 100_000])
def test_register_cancel_with_pending(benchmark, pending: int) -> None:
    benchmark.group = "register + cancel with N pending"
    eng = _core.Engine()
    base = eng.now() + 3600
    n = min(pending, 1000) if SMOKE else pending
    gc.collect()
    before = _rss()
    held = [eng.add(base + i * 1e-6) for i in range(n)]  # distinct deadlines, all pending
    per_token = (_rss() - before) / n
    deadline = base + 0.5e-6 * n  # lands in the middle of the heap
    add = eng.add
    benchmark.pedantic(
        lambda: add(deadline).cancel(), rounds=5 if SMOKE else 2000, iterations=1 if SMOKE else 50
    )
    benchmark.extra_info.update({"pending": n, "bytes_per_pending": per_token})
    print(f"\n{n} pending: {per_token:.0f} bytes each (RSS, Python handle included)")
    assert eng.stats()["pending"] == n
    del held
    eng.shutdown()


def test_idle_wakeups_per_second(benchmark) -> None:
    benchmark.group = "idle"
    eng = _core.Engine()
    held = [eng.add(eng.now() + 3600 + i) for i in range(1000)]
    time.sleep(0.05)
    w0 = eng.stats()["timer_wakeups"]
    seconds = 0.2 if SMOKE else 3.0
    time.sleep(seconds)
    rate = (eng.stats()["timer_wakeups"] - w0) / seconds
    benchmark.extra_info.update({"idle_wakeups_per_second": rate, "pending": len(held)})
    print(f"\nidle timer wake-ups: {rate:.2f}/s with {len(held)} deadlines pending")
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    eng.shutdown()
