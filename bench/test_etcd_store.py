"""The etcd store against TCPStore, same run: store operation latency (set, get, add, wait on a
key that is there, and wait woken by another client's set), and recover() time on a 3-rank job
(rank 2 skips a barrier, ranks 0 and 1 time out at 0.5 s, everyone recovers: from the first
timeout to the last rank past a barrier on the new group)."""

from __future__ import annotations

import statistics
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import SMOKE

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
import etcd_server
import ranks
from mp import describe, run_ranks

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        etcd_server.etcd_binary() is None, reason="no etcd binary (apt-get install etcd-server)"
    ),
]


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    cluster = etcd_server.start(tmp_path_factory.mktemp("etcd"), size=1)
    try:
        yield cluster
    finally:
        cluster.stop()


def _op_latencies(store, n: int) -> dict[str, float]:
    """Median microseconds of each operation over ``n`` calls."""
    store.set("there", "1")
    ops = {
        "set": lambda i: store.set(f"k{i % 8}", "v" * 64),
        "get": lambda i: store.get("there"),
        "add": lambda i: store.add("counter", 1),
        "wait": lambda i: store.wait(["there"], timedelta(seconds=10)),
    }
    out = {}
    for name, op in ops.items():
        times = []
        for i in range(n):
            t0 = time.perf_counter()
            op(i)
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1e6
    # A wait that another client's set ends: from the set to the waiter's return.
    woken = []
    other = store.clone()
    for i in range(max(3, n // 20)):
        key = f"later{i}"
        done = threading.Event()

        def waiter(key: str = key, done: threading.Event = done) -> None:
            store.wait([key], timedelta(seconds=10))
            woken.append(time.perf_counter())
            done.set()

        th = threading.Thread(target=waiter)
        th.start()
        time.sleep(0.05)  # the waiter is waiting
        t0 = time.perf_counter()
        other.set(key, "1")
        done.wait(10)
        th.join(10)
        woken[-1] -= t0
    out["wake"] = statistics.median(woken) * 1e6
    return out


def test_store_op_latency_etcd_vs_tcpstore(benchmark, etcd) -> None:
    import torch.distributed as dist
    from fastdist import EtcdStore

    n = 10 if SMOKE else 300
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timedelta(seconds=30))
    tcp = _op_latencies(client, n)
    store = EtcdStore(etcd.endpoints, f"bench-{uuid.uuid4().hex[:8]}", timeout=30, ttl=5)
    try:
        on_etcd = _op_latencies(store, n)
    finally:
        store.delete_all()
        store.close()
    for name in tcp:
        print(
            f"\nstore {name}: TCPStore {tcp[name]:.0f} us, etcd {on_etcd[name]:.0f} us, "
            f"etcd/TCPStore {on_etcd[name] / tcp[name]:.1f}x"
        )
    benchmark.extra_info.update({"tcpstore_us": tcp, "etcd_us": on_etcd})
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


def _recovery_seconds(env: dict[str, str], cycles: int) -> float:
    results = run_ranks(
        ranks.bench_recovery, 3, timeout=120, env=dict(env, FASTDIST_BENCH_CYCLES=str(cycles))
    )
    info = describe(results)
    assert all(r.returncode == 0 for r in results), info
    by_rank = [[x for x in r.records if x["event"] == "cycle"] for r in results]
    per_cycle = []
    for i in range(cycles):
        first = min(c[i]["timed_out_at"] for c in by_rank if c[i]["timed_out_at"] is not None)
        per_cycle.append(max(c[i]["recovered_at"] for c in by_rank) - first)
    return statistics.median(per_cycle)


def test_recover_time_etcd_vs_tcpstore(benchmark, etcd) -> None:
    cycles = 1 if SMOKE else 5
    tcp = _recovery_seconds({}, cycles)
    on_etcd = _recovery_seconds(
        {"FASTDIST_TEST_ETCD_URL": etcd.url(f"bench-{uuid.uuid4().hex[:8]}") + "?ttl=5"}, cycles
    )
    print(
        f"\nrecover() on 3 ranks (median of {cycles}): TCPStore {tcp * 1000:.0f} ms, etcd "
        f"{on_etcd * 1000:.0f} ms, etcd/TCPStore {on_etcd / tcp:.1f}x"
    )
    benchmark.extra_info.update({"tcpstore_s": tcp, "etcd_s": on_etcd})
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
