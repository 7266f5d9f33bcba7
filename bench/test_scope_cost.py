"""What a deadline costs where there is nothing to wait for: fastdist.wait() on a torch Future
that already completed, against the Future's own wait(), and entering + leaving a fail_after
scope. Goals: wait adds <= 1.2 us; fail_after enter + exit <= 1 us."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

import fastdist
from conftest import SMOKE

pytestmark = pytest.mark.timeout(300)
ROUNDS = 5 if SMOKE else 200
INNER = 10 if SMOKE else 2000


def _per_call(fn) -> float:
    t0 = time.perf_counter()
    for _ in range(INNER):
        fn()
    return (time.perf_counter() - t0) / INNER


def test_wait_on_a_completed_future(benchmark) -> None:
    fut: torch.futures.Future[int] = torch.futures.Future()
    fut.set_result(1)
    raw, fd = [], []
    for i in range(ROUNDS):  # interleaved, order flipped every round
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            if which == 0:
                raw.append(_per_call(fut.wait))
            else:
                fd.append(_per_call(lambda: fastdist.wait(fut, timeout=10)))
    added = (statistics.median(fd) - statistics.median(raw)) * 1e6
    benchmark.extra_info.update({"raw_us": statistics.median(raw) * 1e6, "fastdist_us": statistics.median(fd) * 1e6,
                                 "added_us": added})
    print(f"\nfastdist.wait on a completed Future: raw {statistics.median(raw) * 1e6:.2f} us, "
          f"fastdist {statistics.median(fd) * 1e6:.2f} us, added {added:+.2f} us")
    benchmark.pedantic(lambda: fastdist.wait(fut, timeout=10), rounds=ROUNDS, iterations=1 if SMOKE else 100)


def test_fail_after_enter_exit(benchmark) -> None:
    def scope() -> None:
        with fastdist.fail_after(30):
            pass

    costs = [_per_call(scope) for _ in range(ROUNDS)]
    benchmark.extra_info["enter_exit_us"] = statistics.median(costs) * 1e6
    print(f"\nfail_after enter + exit: {statistics.median(costs) * 1e6:.2f} us")
    benchmark.pedantic(scope, rounds=ROUNDS, iterations=1 if SMOKE else 100)
