"""Issue 16: the job's store on etcd (fastdist.EtcdStore, etcd://): real etcd servers on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta

import etcd_ranks
import etcd_server
import pytest
import torch.distributed as dist
from mp import describe, free_port, run_ranks

pytestmark = [
    pytest.mark.timeout(150),
    etcd_server.NEEDS_ETCD,
]


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    cluster = etcd_server.start(tmp_path_factory.mktemp("etcd"), size=1)
    try:
        yield cluster
    finally:
        cluster.stop()


def _job_keys(endpoint: str, job: str) -> list[bytes]:
    from etcd3gw.client import Etcd3Client

    host, port = endpoint.rsplit(":", 1)
    return [kv["key"] for _v, kv in Etcd3Client(host=host, port=int(port)).get_prefix(f"/fastdist/{job}/")]


def _wait_gone(endpoint: str, job: str, within: float) -> float:
    t0 = time.monotonic()
    while _job_keys(endpoint, job):
        assert time.monotonic() - t0 < within, f"keys of {job} left: {_job_keys(endpoint, job)}"
        time.sleep(0.2)
    return time.monotonic() - t0


def test_the_store_does_what_torch_and_fastdist_use_and_leaves_nothing(etcd) -> None:
    from fastdist import EtcdStore

    job = f"unit-{uuid.uuid4().hex[:8]}"
    s = EtcdStore(etcd.endpoints, job, timeout=5, ttl=2)
    try:
        s.set("a", b"x")
        assert s.get("a") == b"x"
        assert (s.add("n", 2), s.add("n", 3), s.add("n", 0)) == (2, 5, 5)
        assert s.check(["a", "n"]) and not s.check(["a", "zz"])
        # compare_set as TCPStore: unset + "" sets; a wrong expectation returns what is there.
        assert s.compare_set("c", "", "v1") == b"v1"
        assert s.compare_set("c", "nope", "v2") == b"v1"
        assert s.compare_set("c", "v1", "v2") == b"v2"
        assert s.compare_set("unset", "x", "y") == b"x" and not s.check(["unset"])
        s.append("ap", "12")
        s.append("ap", b"34")
        assert s.get("ap") == b"1234"
        assert s.delete_key("a") and not s.delete_key("a")
        assert s.num_keys() == 4  # n, c, ap and the job's lease record ("a" is gone)
        # wait and get on a key set later: a watch, not a poll; a timeout names the key.
        threading.Timer(0.3, lambda: s.set("late", "1")).start()
        t0 = time.monotonic()
        assert s.get("late") == b"1"
        assert 0.2 < time.monotonic() - t0 < 2.0
        t0 = time.monotonic()
        with pytest.raises(dist.DistStoreError, match="wait timeout after 500ms, keys: never"):
            s.wait(["never"], timedelta(seconds=0.5))
        assert time.monotonic() - t0 < 2.0
        # Through torch's PrefixStore (what init_process_group wraps it in), clone included.
        p = dist.PrefixStore("pre/", s)
        p.set("k", "v")
        assert p.get("k") == b"v" and p.clone().get("k") == b"v" and p.add("k2", 7) == 7
        # Queues (fastdist's fault bell): first in, first out; a blocked pop wakes on a push.
        s.queue_push("q", "one")
        s.queue_push("q", "two")
        assert s.queue_len("q") == 2 and s.queue_pop("q") == b"one" and s.queue_pop("q") == b"two"
        threading.Timer(0.3, lambda: s.queue_push("q", "three")).start()
        assert s.queue_pop("q") == b"three"
        with pytest.raises(dist.DistStoreError, match="empty"):
            s.queue_pop("q", block=False)
        # Bad input: clear errors at the edge.
        with pytest.raises(ValueError, match="prefix"):
            EtcdStore(etcd.endpoints, "")
        with pytest.raises(ValueError, match="ttl"):
            EtcdStore(etcd.endpoints, job, ttl=1)
        with pytest.raises(ValueError, match="HOST:PORT"):
            EtcdStore("127.0.0.1:notaport", job)
        with pytest.raises(TypeError, match="timeout"):
            EtcdStore(etcd.endpoints, job, timeout="5")
        from fastdist.store.etcd import parse_url

        with pytest.raises(ValueError, match="must name the job"):
            parse_url("etcd://127.0.0.1:2379")
        with pytest.raises(ValueError, match="ttl"):
            parse_url("etcd://127.0.0.1:2379/job?ttl=x")
        assert parse_url("etcd://a:1,b/job?ttl=5") == ([("a", 1), ("b", 2379)], "job", 5)
        assert _job_keys(etcd.members[0].endpoint, job)
    finally:
        s.close()
    # Every key is on the job's lease: nobody refreshes it now, so all are gone within the ttl.
    assert _wait_gone(etcd.members[0].endpoint, job, within=6.0) >= 0


def test_three_ranks_on_etcd_time_out_recover_and_survive_losing_rank_0(etcd) -> None:
    job = f"job-{uuid.uuid4().hex[:8]}"
    results = run_ranks(
        etcd_ranks.etcd_job, 3, timeout=100, env={"FASTDIST_TEST_ETCD_URL": etcd.url(job) + "?ttl=3"}
    )
    info = describe(results)
    assert results[0].returncode == -9, info  # rank 0 killed itself mid all_reduce
    for r in results:
        assert r.record("store")["kind"] == "EtcdStore", info
        assert r.record("healthy")["sum"] == 6.0, info
        assert r.record("objects")["objs"] == [0, 1, 2], info
        assert r.record("recovered_a")["sum"] == 6.0, info
    for r in results[:2]:
        a = r.record("a")
        assert a["missing"] == [2] and "rank 2 is not in a collective" in a["message"], info
        assert a["elapsed"] < 4.0, info
    for r in results[1:]:
        b = r.record("b")
        assert b["type"] in ("GroupAbortedError", "CollectiveTimeoutError"), info
        assert b["elapsed"] < 10.5, info
        after = r.record("recovered_b")
        assert after["world_size"] == 2 and after["sum"] == 3.0, info
        assert r.returncode == 0, info
    # The job is over: its lease (ttl=3 s) lapses and nothing of it is left in etcd.
    _wait_gone(etcd.members[0].endpoint, job, within=10.0)


def test_a_three_member_cluster_loses_the_member_every_rank_talks_to_and_the_job_goes_on(tmp_path) -> None:
    cluster = etcd_server.start(tmp_path, size=3)
    try:
        first = cluster.members[0]
        assert first.proc is not None
        job = f"cluster-{uuid.uuid4().hex[:8]}"
        results = run_ranks(
            etcd_ranks.etcd_member_lost,
            3,
            timeout=120,
            env={
                "FASTDIST_TEST_ETCD_URL": cluster.url(job),
                "FASTDIST_TEST_ETCD_KILL_PID": str(first.proc.pid),
            },
        )
        info = describe(results)
        assert first.proc.poll() is not None, info  # the member really died
        for r in results:
            assert r.returncode == 0, info
            assert r.record("after_loss")["sum"] == 6.0, info
            assert r.record("recovered")["sum"] == 6.0, info
        for r in results[:2]:
            assert r.record("m")["missing"] == [2], info
            assert r.record("subgroup")["sum"] == 2.0, info
    finally:
        cluster.stop()


def test_refused_unresolvable_and_unreachable_endpoints_are_named() -> None:
    import fastdist
    from fastdist.store.rendezvous import connect_etcd

    refused = free_port()
    t0 = time.monotonic()
    with pytest.raises(fastdist.RendezvousConnectionError) as info:
        fastdist.init_process_group(
            "gloo", f"etcd://127.0.0.1:{refused}/j", rank=0, world_size=1, retries=2, backoff=0.05
        )
    err = info.value
    assert err.cause == "refused" and err.port == refused and err.attempts == 3, err
    assert f"127.0.0.1:{refused} refused" in str(err) and time.monotonic() - t0 < 5
    assert not dist.is_initialized()

    with pytest.raises(fastdist.RendezvousConnectionError) as info:
        connect_etcd([("no-such-host.invalid", 2379)], "j", connect_timeout=5)
    assert info.value.cause == "unresolvable_address" and info.value.address == "no-such-host.invalid"
    assert info.value.attempts == 1  # a name that does not resolve is not retried

    # A listener with a full backlog drops new SYNs: on loopback, an endpoint that never answers.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        port = server.getsockname()[1]
        filler = socket.create_connection(("127.0.0.1", port))
        try:
            t0 = time.monotonic()
            with pytest.raises(fastdist.RendezvousConnectionError) as info:
                connect_etcd(
                    [("127.0.0.1", port), ("127.0.0.1", refused)], "j", connect_timeout=1.0, retries=None
                )
            took = time.monotonic() - t0
        finally:
            filler.close()
    err = info.value
    assert err.cause == "unreachable" and err.port == port, err
    assert f"127.0.0.1:{refused} refused" in str(err), err  # every endpoint is named
    assert took < 2.5, took

    doctor = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastdist",
            "doctor",
            "--store",
            f"etcd://127.0.0.1:{refused}/j",
            "--timeout",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
        check=False,
    )
    assert doctor.returncode == 1 and "nothing is listening" in doctor.stdout, doctor.stdout + doctor.stderr
