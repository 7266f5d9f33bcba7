"""One deadline's cost, register + cancel, against the timers people use today: torchft's
future_timeout and context_timeout (torchft 0.2.0, the `bench` extra), threading.Timer, and
asyncio's call_later on a loop thread. Goal: fastdist at least 20x cheaper than torchft's."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta

import pytest
import torch
from conftest import SMOKE
from fastdist import _core

pytestmark = pytest.mark.timeout(300)
ROUNDS = 5 if SMOKE else 2000


def _run(benchmark, fn, iterations: int = 20) -> None:
    benchmark.group = "timer register + cancel"
    benchmark.pedantic(
        fn, rounds=ROUNDS, iterations=1 if SMOKE else iterations, warmup_rounds=0 if SMOKE else 10
    )


def test_fastdist_engine(benchmark) -> None:
    eng = _core.default_engine()
    deadline = eng.now() + 3600
    add = eng.add
    _run(benchmark, lambda: add(deadline).cancel())
    assert eng.stats()["pending"] == 0


def test_torchft_future_timeout(benchmark) -> None:
    from torchft.futures import future_timeout

    td = timedelta(seconds=3600)

    def once() -> None:
        fut: torch.futures.Future[int] = torch.futures.Future()
        future_timeout(fut, td)
        fut.set_result(1)  # completing the future cancels its timer

    _run(benchmark, once)


def test_torchft_context_timeout(benchmark) -> None:
    from torchft.futures import context_timeout

    td = timedelta(seconds=3600)

    def once() -> None:
        with context_timeout(lambda: None, td):
            pass

    _run(benchmark, once)


def test_threading_timer(benchmark) -> None:
    def once() -> None:
        t = threading.Timer(3600, lambda: None)
        t.start()
        t.cancel()
        t.join()

    _run(benchmark, once, iterations=5)


def test_asyncio_call_later_on_a_loop_thread(benchmark) -> None:
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    handles: list[asyncio.TimerHandle] = []

    def once() -> None:
        # From the caller's thread, as a deadline would be: schedule, then cancel, on the loop.
        loop.call_soon_threadsafe(lambda: handles.append(loop.call_later(3600, lambda: None)))
        loop.call_soon_threadsafe(lambda: handles.pop().cancel())

    try:
        _run(benchmark, once)
    finally:
        done = threading.Event()
        loop.call_soon_threadsafe(done.set)
        done.wait(10)
        loop.call_soon_threadsafe(loop.stop)
        th.join(10)
        loop.close()
