"""Real etcd servers for the tests: one, or a 3-member cluster, on loopback with free ports and
their own data directories, stopped (killed by PID) when the test ends.

The binary comes from the machine (`etcd` on PATH: Debian's etcd-server, which .ci/run installs,
or $FASTDIST_ETCD); without one the tests that need it skip, saying why.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def etcd_binary() -> str | None:
    return os.environ.get("FASTDIST_ETCD") or shutil.which("etcd")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@dataclass
class Cluster:
    members: list[Member] = field(default_factory=list)

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def url(self, job: str) -> str:
        return f"etcd://{self.endpoints}/{job}"

    def stop(self) -> None:
        for m in self.members:
            m.stop()


def start(tmp: Path, size: int = 1, timeout: float = 20.0) -> Cluster:
    """Starts ``size`` etcd members forming one cluster; returns once each says it is healthy."""
    binary = etcd_binary()
    assert binary is not None
    ports = _free_ports(2 * size)
    members = [Member(f"m{i}", ports[2 * i], ports[2 * i + 1]) for i in range(size)]
    initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in members)
    cluster = Cluster(members)
    try:
        for m in members:
            log = open(tmp / f"etcd-{m.name}.log", "wb")  # noqa: SIM115 - the child writes to it
            m.proc = subprocess.Popen(
                [
                    binary,
                    "--name", m.name,
                    "--data-dir", str(tmp / f"etcd-{m.name}"),
                    "--listen-client-urls", f"http://127.0.0.1:{m.client_port}",
                    "--advertise-client-urls", f"http://127.0.0.1:{m.client_port}",
                    "--listen-peer-urls", f"http://127.0.0.1:{m.peer_port}",
                    "--initial-advertise-peer-urls", f"http://127.0.0.1:{m.peer_port}",
                    "--initial-cluster", initial,
                    "--initial-cluster-token", f"fastdist-test-{os.getpid()}",
                    "--heartbeat-interval", "50",
                    "--election-timeout", "500",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
            log.close()
        end = time.monotonic() + timeout
        for m in members:
            while True:
                try:
                    with urllib.request.urlopen(f"http://{m.endpoint}/health", timeout=1) as r:
                        if b'"true"' in r.read():
                            break
                except OSError:
                    pass
                if time.monotonic() > end or (m.proc is not None and m.proc.poll() is not None):
                    logs = "".join((tmp / f"etcd-{x.name}.log").read_text()[-1500:] for x in members)
                    raise RuntimeError(f"etcd member {m.name} did not become healthy:\n{logs}")
                time.sleep(0.05)
    except BaseException:
        cluster.stop()
        raise
    return cluster
