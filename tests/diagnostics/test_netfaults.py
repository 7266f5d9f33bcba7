"""Issue 17: network faults, not only process faults. Each rank and the job's store run in their
own Linux network namespace (tests/diagnostics/netns.py), joined by a bridge; faults are packets that vanish
(nftables), loss, and link state. Skips, saying why, where namespaces cannot be made."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import netfaults_ranks
import netns
import pytest
from mp import RECORD_PREFIX, RankResult, describe

HERE = Path(__file__).resolve().parent
WHY = netns.unavailable()
pytestmark = [
    pytest.mark.timeout(150),
    pytest.mark.skipif(WHY is not None, reason=f"no network namespaces: {WHY}"),
]

STORE_PORT = 29400


@pytest.fixture(scope="module")
def net():
    netns.sweep_stale()
    n = netns.Net(["store", "r0", "r1", "r2"])
    try:
        yield n
    finally:
        n.teardown()


def _run(
    net: netns.Net, scenario: Callable[[Any], None], world_size: int, timeout: float
) -> list[RankResult]:
    import json

    ctrl = tempfile.mkdtemp(prefix="fdnet-ctrl-")
    env = dict(os.environ, PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="eth0", FDNET_CTRL=ctrl, **net.env())
    env.update(
        MASTER_ADDR=net.ip("store"),
        MASTER_PORT=str(STORE_PORT),
        WORLD_SIZE=str(world_size),
        TORCHELASTIC_USE_AGENT_STORE="True",  # the store is hosted elsewhere, as by torchrun's agent
    )
    store_code = (
        "import datetime, time, torch.distributed as d\n"
        f"s = d.TCPStore('0.0.0.0', {STORE_PORT}, None, True, datetime.timedelta(seconds=300),\n"
        "                wait_for_workers=False)\n"
        "print('ready', flush=True)\n"
        "time.sleep(3600)\n"
    )
    procs: list[subprocess.Popen[bytes]] = []
    files = []
    try:
        store = subprocess.Popen(
            net.command("store", [sys.executable, "-c", store_code]), stdout=subprocess.PIPE, env=env
        )
        procs.append(store)
        assert store.stdout is not None and store.stdout.readline().strip() == b"ready"
        for rank in range(world_size):
            out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # noqa: SIM115 - read below
            files.append((out, err))
            cmd = net.command(
                f"r{rank}",
                [sys.executable, str(HERE / "netns_rank.py"), scenario.__name__, str(rank), str(world_size)],
            )
            procs.append(
                subprocess.Popen(
                    cmd, stdout=out, stderr=err, env=dict(env, RANK=str(rank)), cwd=str(HERE.parents[2])
                )
            )
        end = time.monotonic() + timeout
        while any(p.poll() is None for p in procs[1:]) and time.monotonic() < end:
            time.sleep(0.05)
        overran = any(p.poll() is None for p in procs[1:])
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
            if p.stdout is not None:
                p.stdout.close()
        for name in ("store", "r0", "r1", "r2"):
            net.heal(name)
    results = []
    for rank, ((out, err), p) in enumerate(zip(files, procs[1:])):
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
        out.close()
        err.close()
        records = [
            json.loads(line[len(RECORD_PREFIX) :])
            for line in stdout.splitlines()
            if line.startswith(RECORD_PREFIX)
        ]
        results.append(RankResult(rank, p.returncode, stdout, stderr, None, records))
    assert not overran, f"the scenario did not finish within {timeout} s\n{describe(results)}"
    return results


def test_partitions_loss_and_a_flapping_link(net) -> None:
    results = _run(net, netfaults_ranks.net_faults, 3, timeout=120)
    info = describe(results)
    for r in results:
        assert r.returncode == 0, info
        # 10% loss (30 s deadline) and a 2 s link flap (10 s deadline): no false timeouts.
        assert r.record("loss")["errors"] == 0, info
        assert r.record("flap")["errors"] == 0, info
    for r in results[:2]:
        # The partitioned rank is named, within the deadline (3 s) plus the report window.
        p = r.record("p")
        assert p["type"] == "CollectiveTimeoutError" and p["missing"] == [2], info
        assert "rank 2 did not answer" in p["message"], info
        assert p["elapsed"] < 3.0 + 0.31 + 0.7, info
        assert r.record("shrunk") == {**r.record("shrunk"), "world": 2, "sum": 3.0}, info
        assert r.record("after_store")["sum"] == 2.0, info
    # Cut off, rank 2's doctor says unreachable within its timeout, and so does a connect.
    r2 = results[2]
    doctor = r2.record("doctor")
    assert doctor["rc"] == 1 and any(c["name"] == "reach" and c["ok"] is False for c in doctor["checks"]), (
        info
    )
    assert r2.record("connect")["cause"] == "unreachable" and r2.record("connect")["seconds"] < 2.5, info
    # Back on the network: a typed error at once, and recover() says it was left out.
    assert r2.record("p_next")["elapsed"] < 1.0 and r2.record("p_next")["type"] == "GroupAbortedError", info
    assert (
        r2.record("p_recover")["type"] == "RecoveryError"
        and "without this rank" in r2.record("p_recover")["message"]
    ), info
    # The store's host cut off: the diagnosed error, within bounds, not a hang.
    s = results[0].record("s")
    assert "store" in s["message"] and s["elapsed"] < 10, info
    s_rec = results[0].record("s_recover")
    assert "store" in s_rec["message"] and s_rec["elapsed"] < 10, info
