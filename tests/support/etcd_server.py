"""Real etcd servers for the tests: one, or a 3-member cluster, on loopback with free ports and
their own data directories, stopped (killed by PID) when the test ends.

The binary comes from the machine (`etcd` on PATH: Debian's etcd-server, which .ci/run installs,
or $FASTDIST_ETCD); without one the tests that need it skip, saying why.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from mp import free_port


def etcd_binary() -> str | None:
    return os.environ.get("FASTDIST_ETCD") or shutil.which("etcd")


NEEDS_ETCD = pytest.mark.skipif(
    etcd_binary() is None,
    reason="no etcd binary (apt-get install etcd-server, or set FASTDIST_ETCD); .ci/run installs it",
)


def _free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


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


# -- TLS and authentication ------------------------------------------------------------------


@dataclass
class Secure:
    """One etcd member on https with client-certificate authentication and etcd's own
    authentication enabled; the files a client needs, and users: ``trainer`` (read-write on
    /fastdist/), ``guest`` (no permission), ``root``."""

    member: Member
    ca: Path
    cert: Path
    key: Path
    other_ca: Path  # a CA that did not sign the server's certificate

    @property
    def endpoint(self) -> str:
        return f"https://127.0.0.1:{self.member.client_port}"

    def stop(self) -> None:
        self.member.stop()


PASSWORDS = {"root": "root-pw-1", "trainer": "s3cret-pw-2", "guest": "guest-pw-3"}


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(tmp: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate it signed, and a second
    CA that signed nothing of the server's (openssl, valid one day)."""
    for name in ("ca", "other-ca"):
        subject = f"/CN=fastdist-{name}"
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", subject,
                 "-keyout", f"{name}.key", "-out", f"{name}.crt", cwd=tmp)  # fmt: skip
    for name, ext in (
        (
            "server",
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth",
        ),  # (its gateway dials itself)
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        (tmp / f"{name}.ext").write_text(ext + "\n")
        # No CommonName: etcd 3.4 refuses a request its gateway forwards with a certificate
        # that has one ("CommonName of client sending a request against gateway will be ignored").
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/O=fastdist-{name}", "-keyout",
                 f"{name}.key", "-out", f"{name}.csr", cwd=tmp)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=tmp)  # fmt: skip
    return {
        n: tmp / n for n in ("ca.crt", "other-ca.crt", "server.crt", "server.key", "client.crt", "client.key")
    }


def start_secure(tmp: Path, timeout: float = 20.0) -> Secure:
    """etcd on https (its certificate signed by a CA made here), requiring client certificates,
    with authentication enabled and the users of PASSWORDS made through its HTTP API."""
    import base64
    import json
    import ssl

    binary = etcd_binary()
    assert binary is not None
    files = make_certificates(tmp)
    client_port, peer_port = _free_ports(2)
    m = Member("secure", client_port, peer_port)
    log = open(tmp / "etcd-secure.log", "wb")  # noqa: SIM115 - the child writes to it
    m.proc = subprocess.Popen(
        [
            binary,
            "--name", m.name,
            "--data-dir", str(tmp / "etcd-secure"),
            "--listen-client-urls", f"https://127.0.0.1:{client_port}",
            "--advertise-client-urls", f"https://127.0.0.1:{client_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"{m.name}=http://127.0.0.1:{peer_port}",
            "--cert-file", str(files["server.crt"]),
            "--key-file", str(files["server.key"]),
            "--trusted-ca-file", str(files["ca.crt"]),
            "--client-cert-auth",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    log.close()
    ctx = ssl.create_default_context(cafile=str(files["ca.crt"]))
    ctx.load_cert_chain(str(files["client.crt"]), str(files["client.key"]))
    base = f"https://127.0.0.1:{client_port}"

    def call(path: str, body: dict[str, object]) -> None:
        req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST")
        for _ in range(100):  # 503 while the new member settles (its first election)
            try:
                with urllib.request.urlopen(req, context=ctx, timeout=5) as r:
                    r.read()
                return
            except urllib.error.HTTPError as exc:
                if exc.code != 503:
                    raise RuntimeError(f"etcd {path}: HTTP {exc.code}: {exc.read()[:300]!r}") from None
                time.sleep(0.1)
        raise RuntimeError(f"etcd {path}: still unavailable")

    try:
        end = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(base + "/health", context=ctx, timeout=1) as r:
                    if b'"true"' in r.read():
                        break
            except OSError:
                pass
            if time.monotonic() > end or m.proc.poll() is not None:
                raise RuntimeError(
                    f"secure etcd did not become healthy:\n{(tmp / 'etcd-secure.log').read_text()[-1500:]}"
                )
            time.sleep(0.05)

        def b64(text: str) -> str:
            return base64.b64encode(text.encode()).decode()

        for user, password in PASSWORDS.items():
            call("/v3/auth/user/add", {"name": user, "password": password})
        call("/v3/auth/role/add", {"name": "root"})
        call("/v3/auth/user/grant", {"user": "root", "role": "root"})
        call("/v3/auth/role/add", {"name": "jobs"})
        perm = {"permType": "READWRITE", "key": b64("/fastdist/"), "range_end": b64("/fastdist0")}
        call("/v3/auth/role/grant", {"name": "jobs", "perm": perm})
        call("/v3/auth/user/grant", {"user": "trainer", "role": "jobs"})
        call("/v3/auth/enable", {})
    except BaseException:
        m.stop()
        raise
    return Secure(m, files["ca.crt"], files["client.crt"], files["client.key"], files["other-ca.crt"])
