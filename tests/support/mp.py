"""Runs test scenarios on real processes: one Python process per rank, gloo, and a TCPStore on
127.0.0.1 hosted by the test process on a free port.

Each rank runs ``tests/support/rank_main.py FILE:FUNCTION RANK WORLD PORT``, which calls the rank code a
test passed (a function beside the test, or in the rank module named after its file, beside it: the
ranks of tests/diagnostics/test_faults.py are in tests/diagnostics/faults_ranks.py). Ranks report
what they saw as JSON records on stdout. The whole run has a hard deadline, and every child is
killed by PID in a ``finally``, so a bug cannot hang the suite. Ranks that play "absent" block on
the store key ``RELEASE_KEY``, which the harness sets once every other rank has exited, so an
absent rank never closes its connections early. Ranks listed as ``stuck`` (hung or SIGSTOPped by
the scenario) are killed at that point.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]  # the repository: every process the tests start runs there
RELEASE_KEY = "fastdist_test/release"
RECORD_PREFIX = "@@fastdist@@ "
# Added to every bound on how soon a rank's process ends after its last record: the interpreter's
# teardown and this parent's polling of exits are slow on a loaded 2-core machine running two
# pytest workers (measured: 2.9 s for a process whose shutdown itself took 1.5 s). The bounds
# still tell an exit that hangs (a dead group blocking it: tens of seconds) from one that does not.
EXIT_SLACK = 2.5


def _below_ephemeral() -> range:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(max(1024, low - 12000), low)


# Below the kernel's ephemeral range (ip_local_port_range), where bind(0) picks from and where every
# outgoing connection takes its local port: the hundreds that gloo and store clients make in
# parallel tests could take a port picked there between the check and the launcher's bind (one took
# 42453 once: "port 42453 (--master-port) is already in use").
_PORTS = _below_ephemeral()
_random = random.Random()  # (seeded from os.urandom: two pytest workers draw differently)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, outside the ephemeral range."""
    for _ in range(1000):
        port = _random.choice(_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PORTS}")


def run_session(
    cmd: list[str],
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: Path = ROOT,
    unset: tuple[str, ...] = (),
) -> tuple[int | None, str]:
    """Runs ``cmd`` (a launcher: fastdist run, torchrun, Lightning's) in a session of its own,
    its output in a file; at the end, whatever happened, every process of the session (the
    launcher's workers too) is SIGKILLed by its process group. Returns the exit code (None: it
    ran past ``timeout``) and the output. ``env``: added to this process's, less ``unset``."""
    child_env = {k: v for k, v in os.environ.items() if k not in unset}
    child_env.update(PYTHONUNBUFFERED="1", **(env or {}))
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=child_env,
            cwd=str(cwd),
            start_new_session=True,
        )
        code: int | None = None
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        out.seek(0)
        return code, out.read().decode(errors="replace")


def run_processes(cmds: list[list[str]], timeout: float) -> list[int | None]:
    """Starts every command of ``cmds`` at once (the ranks of a hand-launched job), each in a
    session of its own, output inherited; waits up to ``timeout`` in all and SIGKILLs whatever is
    left, by process group, whatever happened. Their exit codes (None: killed at the timeout)."""
    end = time.monotonic() + timeout
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for cmd in cmds:
            procs.append(
                subprocess.Popen(
                    cmd,
                    env=dict(os.environ, PYTHONUNBUFFERED="1"),
                    cwd=str(ROOT),
                    start_new_session=True,
                )
            )
        codes: list[int | None] = []
        for p in procs:
            try:
                codes.append(p.wait(max(0.0, end - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes
    finally:
        kill_sessions(procs)


def kill_sessions(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILLs every process of each of ``procs``' sessions (each started with
    ``start_new_session=True``), whatever state they are in, and reaps them."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


class _Zygote:
    """This pytest worker's tests/support/zygote.py: forks ranks from an interpreter that has imported
    torch. Started on first use; ends with this process (its socket closes)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(HERE / "zygote.py"), str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            cwd=str(ROOT),
        )
        theirs.close()
        self.sock = ours
        self.buf = b""
        self.codes: dict[int, int] = {}
        self.sock.settimeout(60)
        if "ready" not in self._read():
            raise RuntimeError("tests/support/zygote.py did not start")

    def _read(self) -> dict[str, Any]:
        while b"\n" not in self.buf:
            data = self.sock.recv(65536)
            if not data:
                raise RuntimeError("tests/support/zygote.py ended")
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        msg: dict[str, Any] = json.loads(line)
        if "exit" in msg:
            self.codes[msg["exit"]] = msg["code"]
        return msg

    def pump(self) -> None:
        """Reads every exit the zygote has said so far, without waiting."""
        self.sock.setblocking(False)
        try:
            while True:
                try:
                    data = self.sock.recv(65536)
                except BlockingIOError:
                    break
                if not data:
                    break
                self.buf += data
        finally:
            self.sock.settimeout(60)
        while b"\n" in self.buf:
            self._read()

    def spawn(self, cmd: list[str], out: Any, err: Any, env: dict[str, str], cwd: str) -> _Forked:
        body = json.dumps({"argv": cmd, "env": env, "cwd": cwd}).encode()
        socket.send_fds(self.sock, [body], [out.fileno(), err.fileno()])
        while True:
            msg = self._read()
            if "pid" in msg:
                return _Forked(self, msg["pid"])


class _Forked:
    """A rank forked by the zygote, as much of ``subprocess.Popen`` as run_ranks uses."""

    def __init__(self, zygote: _Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.zygote.pump()
            self.returncode = self.zygote.codes.pop(self.pid, None)
        return self.returncode

    def wait(self, timeout: float = 60.0) -> int:
        end = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > end:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode


_zygote: list[_Zygote] = []


def _spawn_rank(cmd: list[str], out: Any, err: Any, env: dict[str, str]) -> Any:
    """A rank's process: forked from this worker's zygote (torch imported once), or its own
    interpreter with ``FASTDIST_TEST_SPAWN=exec``."""
    if os.environ.get("FASTDIST_TEST_SPAWN") == "exec":
        return subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=str(ROOT))
    if not _zygote or _zygote[0].proc.poll() is not None:
        _zygote[:] = [_Zygote()]
    return _zygote[0].spawn(cmd, out, err, dict(env), str(ROOT))


@dataclass
class RankResult:
    rank: int
    returncode: int | None
    stdout: str
    stderr: str
    exited_at: float | None  # time.time() when the harness saw the process end
    records: list[dict[str, Any]] = field(default_factory=list)

    def record(self, event: str) -> dict[str, Any]:
        for r in self.records:
            if r.get("event") == event:
                return r
        raise AssertionError(
            f"rank {self.rank} recorded no {event!r}; records={self.records}\nstderr:\n{self.stderr[-3000:]}"
        )

    def has(self, event: str) -> bool:
        return any(r.get("event") == event for r in self.records)


def run_ranks(
    scenario: Callable[[Any], None],
    world_size: int,
    *,
    absent: tuple[int, ...] = (),
    stuck: tuple[int, ...] = (),
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> list[RankResult]:
    from torch.distributed import TCPStore

    store = TCPStore(
        "127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    child_env = dict(os.environ)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    child_env.update(env or {})
    procs: list[Any] = []  # subprocess.Popen or _Forked
    outs: list[tuple[Any, Any]] = []
    exited_at: dict[int, float] = {}
    released = False
    overran = False
    try:
        for rank in range(world_size):
            out = tempfile.TemporaryFile()  # noqa: SIM115 - the child writes to it; closed after reading below
            err = tempfile.TemporaryFile()  # noqa: SIM115 - the child writes to it; closed after reading below
            outs.append((out, err))
            cmd = [
                sys.executable,
                str(HERE / "rank_main.py"),
                f"{inspect.getfile(scenario)}:{scenario.__name__}",
                str(rank),
                str(world_size),
                str(store.port),
            ]
            child_env["FASTDIST_SPAWNED_AT"] = repr(time.time())
            procs.append(_spawn_rank(cmd, out, err, child_env))
        hard_deadline = time.monotonic() + timeout
        while len(exited_at) < world_size:
            for rank, p in enumerate(procs):
                if rank not in exited_at and p.poll() is not None:
                    exited_at[rank] = time.time()
            present = [r for r in range(world_size) if r not in absent and r not in stuck]
            if not released and all(r in exited_at for r in present):
                store.set(RELEASE_KEY, "1")
                released = True
                for r in stuck:  # hung or stopped on purpose: nothing else will end them
                    if r not in exited_at:
                        os.kill(procs[r].pid, signal.SIGKILL)
            if time.monotonic() > hard_deadline:
                overran = True
                break
            time.sleep(0.01)
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
        del store
    results = []
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
        out.close()
        err.close()
        records = [
            json.loads(line[len(RECORD_PREFIX) :])
            for line in stdout.splitlines()
            if line.startswith(RECORD_PREFIX)
        ]
        results.append(RankResult(rank, p.returncode, stdout, stderr, exited_at.get(rank), records))
    if overran:
        raise AssertionError(
            f"scenario {scenario.__name__!r} did not finish within {timeout} s; exited: "
            f"{sorted(exited_at)}\n{describe(results)}"
        )
    return results


def describe(results: list[RankResult]) -> str:
    parts = []
    for r in results:
        parts.append(f"--- rank {r.rank} rc={r.returncode} records={r.records}\n{r.stderr[-2000:]}")
    return "\n".join(parts)
