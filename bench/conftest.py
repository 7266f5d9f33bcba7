"""A 2-rank gloo job for the benchmarks: the pytest process is rank 0, a peer process is rank 1.

Rank 0 posts each step's plan (the exact sequence of calls) in the store before making those
calls; the peer makes the same calls, so every collective has its partner.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Callable

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# FASTDIST_BENCH_SMOKE=1 runs each benchmark a handful of times (the test suite does this so
# that no benchmark can rot); the real run is `make bench`.
SMOKE = os.environ.get("FASTDIST_BENCH_SMOKE") == "1"
# Calls of one kind in a row in the interleaved comparisons (Pair.interleaved).
BLOCK = 10


class Pair:
    def __init__(self, store, ops: dict[str, Callable[[], None]]) -> None:
        self.store = store
        self.ops = ops
        self.step = 0

    def post(self, names: list[str]) -> None:
        """Tells the peer the calls rank 0 is about to make."""
        self.store.set(f"plan/{self.step}", json.dumps(names))
        self.step += 1

    def run(self, names: list[str]) -> list[float]:
        """Makes the calls in order on both ranks; returns rank 0's time for each, in seconds."""
        self.post(names)
        times = []
        for name in names:
            op = self.ops[name]
            t0 = time.perf_counter()
            op()
            times.append(time.perf_counter() - t0)
        return times

    def interleaved(self, raw: str, fd: str, rounds: int, block: int = BLOCK) -> dict[str, float]:
        """Alternates raw and fastdist calls in blocks of ``block`` (order flipped every pair of
        blocks) and compares the medians, leaving out each block's first call. (One call of
        each in turn measured each op's cost mixed with the other's wake of gloo's threads: a
        1-element fastdist.all_reduce came out 2 to 13 us above raw depending on which ops it
        was interleaved with.)"""
        block = max(1, min(block, rounds))
        names: list[str] = []
        for i in range(max(1, rounds // block)):
            for name in (raw, fd) if i % 2 == 0 else (fd, raw):
                names += [name] * block
        times = self.run(names)
        raw_t, fd_t = [], []
        for i, (n, t) in enumerate(zip(names, times)):
            if i % block:
                (raw_t if n == raw else fd_t).append(t)
        raw_t = raw_t or [t for n, t in zip(names, times) if n == raw]
        fd_t = fd_t or [t for n, t in zip(names, times) if n == fd]
        raw_med, fd_med = statistics.median(raw_t), statistics.median(fd_t)
        return {
            "raw_median_us": raw_med * 1e6,
            "fastdist_median_us": fd_med * 1e6,
            "ratio_of_medians": fd_med / raw_med,
            "added_us": (fd_med - raw_med) * 1e6,
            "rounds": rounds,
        }


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The raw side of the comparisons is a plain torch group on purpose: fastdist's warning about
    # deadline scopes over such a group is expected here.
    expected = pytest.mark.filterwarnings("ignore:.*this deadline scope cannot bound:RuntimeWarning")
    for item in items:
        item.add_marker(expected)


@pytest.fixture(scope="session")
def pair() -> Iterator[Pair]:
    import torch.distributed as dist
    from ops import make_ops

    world_size = 2
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300)
    )
    peer = subprocess.Popen([sys.executable, str(HERE / "peer.py"), str(store.port), str(world_size)])
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=0, world_size=world_size)
        p = Pair(store, make_ops(world_size))
        p.run(["raw_barrier"] * 50 + ["fd_barrier"] * 50)  # warm up both paths
        yield p
        store.set(f"plan/{p.step}", json.dumps(None))
        peer.wait(timeout=30)
        dist.destroy_process_group()
    finally:
        if peer.poll() is None:
            os.kill(peer.pid, signal.SIGKILL)
            peer.wait()
