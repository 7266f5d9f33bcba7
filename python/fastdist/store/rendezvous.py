"""Getting the ranks together: store connection with retries and diagnosed failures, the version
and world-size check, and a rendezvous with join / close / timeout.

torch's own connect gives poor answers (facts file): a 3 s connect timeout that takes up to 8 s,
DNS failures reported as socket timeouts, a C++ stack dump on every failure, no cause. Here each
step is probed with plain sockets first, so the failures fastdist can explain never reach torch:

- the address is resolved first, in a thread bounded to 1 s: a name that does not resolve is
  named as such at once (``cause="unresolvable_address"``);
- rank 0 binds the port itself before starting the store: a port in use is named, with the
  process holding it when /proc tells (``"port_in_use"``);
- the others probe the port with a plain connect, retrying with exponential backoff and jitter,
  each attempt logged: nothing listening is ``"refused"``, no answer at all is
  ``"unreachable"`` (a firewall or a wrong network). The whole phase ends within
  ``connect_timeout`` plus 10%;
- once connected, every rank checks the record rank 0 published: different torch or fastdist
  versions are ``"version_mismatch"``, a different world size ``"world_size_mismatch"``.
"""

from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import random
import socket
import sys
import threading
import time
from typing import Any

import torch

from .._version import __version__
from ..deadlines import RendezvousTimeout, current_time, validate_seconds
from ..errors import RendezvousClosedError, RendezvousConnectionError, RendezvousTimeoutError
from . import keys, seal
from .etcd import EtcdAccessError, EtcdSecurity, EtcdStore

logger = logging.getLogger(__name__)

RESOLVE_TIMEOUT = 1.0
VERSION_KEY = keys.key("rdzv", "version")


def versions() -> dict[str, Any]:
    """This process's torch, fastdist and Python versions (every rank checks its own against rank
    0's record)."""
    return {"torch": torch.__version__, "fastdist": __version__, "python": sys.version.split()[0]}


# ---------------------------------------------------------------------------------------------
# Probes


def resolve(host: str, timeout: float = RESOLVE_TIMEOUT) -> str:
    """The IPv4 address of ``host``; raises OSError if it cannot be resolved within ``timeout``
    (getaddrinfo has no timeout of its own, so it runs in a thread)."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
        except OSError as exc:
            result.append(exc)

    th = threading.Thread(target=run, name="fastdist-resolve", daemon=True)
    th.start()
    th.join(timeout)
    if not result:
        raise OSError(f"resolving {host!r} took longer than {timeout:g} s")
    if isinstance(result[0], OSError):
        raise result[0]
    return str(result[0])


def port_holder(port: int) -> str | None:
    """``"pid N (cmdline)"`` of a local process listening on ``port``, when /proc tells."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if int(parts[1].rsplit(":", 1)[1], 16) == port and parts[3] == "0A":  # LISTEN
                        inodes.add(parts[9])
        except (OSError, ValueError, IndexError, StopIteration):
            continue
    if not inodes:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                    return f"pid {pid} ({cmd[:120]})"
        except OSError:
            continue
    return None


def port_in_use(addr: str, port: int) -> bool:
    """Whether ``port`` on ``addr`` is taken (binding it fails with EADDRINUSE); any other error of
    the bind is raised."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def probe(addr: str, port: int, timeout: float) -> tuple[str | None, float]:
    """One plain TCP connect: (None, seconds) if something accepted, else (cause, seconds) with
    cause ``"refused"`` or ``"unreachable"``."""
    t0 = time.monotonic()
    try:
        with socket.create_connection((addr, port), timeout=max(timeout, 0.001)):
            return None, time.monotonic() - t0
    except ConnectionRefusedError:
        return "refused", time.monotonic() - t0
    except (socket.timeout, TimeoutError):
        return "unreachable", time.monotonic() - t0
    except OSError as exc:
        if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return "unreachable", time.monotonic() - t0
        return "refused", time.monotonic() - t0


# ---------------------------------------------------------------------------------------------
# Connecting


def connect_store(
    host: str,
    port: int,
    *,
    is_master: bool,
    world_size: int | None = None,
    connect_timeout: float = 60.0,
    retries: int | None = 3,
    backoff: float = 0.5,
    store_timeout: float = 300.0,
) -> Any:
    """A TCPStore at ``host:port``: rank 0 serves it (``is_master``), the others connect, retrying
    ``retries`` times (None: until ``connect_timeout``) with exponential backoff from ``backoff``
    seconds and jitter. Raises :class:`RendezvousConnectionError` naming the cause."""
    from torch.distributed import TCPStore

    budget = validate_seconds(connect_timeout, "connect_timeout")
    if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int) or retries < 0):
        raise ValueError(f"retries must be a non-negative int or None, got {retries!r}")
    backoff = validate_seconds(backoff, "backoff")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port must be an int in 1..65535, got {port!r}")
    start = time.monotonic()
    deadline = start + budget

    def fail(cause: str, attempts: int, detail: str | None = None) -> RendezvousConnectionError:
        return RendezvousConnectionError(
            cause=cause,
            address=host,
            port=port,
            attempts=attempts,
            elapsed=time.monotonic() - start,
            detail=detail,
        )

    try:
        addr = resolve(host, min(RESOLVE_TIMEOUT, budget))
    except OSError as exc:
        raise fail("unresolvable_address", 1, str(exc)) from None
    td = datetime.timedelta(seconds=store_timeout)
    if is_master:
        if port_in_use(addr, port):
            raise fail("port_in_use", 1, port_holder(port))
        store = TCPStore(addr, port, world_size, True, td, wait_for_workers=False)
        return store

    attempt = 0
    while True:
        attempt += 1
        left = deadline - time.monotonic()
        cause, took = probe(addr, port, min(left, 5.0))
        if cause is None:
            return TCPStore(addr, port, world_size, False, td)
        logger.info(
            "rendezvous: attempt %d to reach %s:%d: %s after %.3f s", attempt, host, port, cause, took
        )
        left = deadline - time.monotonic()
        if left <= 0 or (retries is not None and attempt > retries):
            raise fail(cause, attempt)
        pause = min(backoff * 2 ** (attempt - 1) * random.uniform(0.5, 1.5), left)
        time.sleep(pause)


def connect_etcd(
    endpoints: list[tuple[str, int]],
    job: str,
    *,
    ttl: int = 60,
    connect_timeout: float = 60.0,
    retries: int | None = 3,
    backoff: float = 0.5,
    store_timeout: float = 300.0,
    security: EtcdSecurity | None = None,
) -> Any:
    """A :class:`fastdist.EtcdStore` for ``job`` on the first of ``endpoints`` that answers,
    probing each as :func:`connect_store` does (resolve, then a plain connect) and retrying
    ``retries`` times with backoff. Raises :class:`RendezvousConnectionError` naming every
    endpoint's cause (``cause``: the first endpoint's); a refusal of this client's certificate,
    password or permissions is :class:`EtcdAccessError` at once (retrying cannot help)."""
    budget = validate_seconds(connect_timeout, "connect_timeout")
    if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int) or retries < 0):
        raise ValueError(f"retries must be a non-negative int or None, got {retries!r}")
    backoff = validate_seconds(backoff, "backoff")
    start = time.monotonic()
    deadline = start + budget
    attempt = 0
    while True:
        attempt += 1
        causes: list[tuple[str, str, int, str]] = []
        for host, port in endpoints:
            try:
                addr = resolve(host, min(RESOLVE_TIMEOUT, max(deadline - time.monotonic(), 0.001)))
            except OSError as exc:
                causes.append(("unresolvable_address", host, port, str(exc)))
                continue
            cause, took = probe(addr, port, min(max(deadline - time.monotonic(), 0.001), 5.0))
            if cause is None:
                try:
                    hosts = [f"{h}:{p}" for h, p in endpoints]
                    return EtcdStore(hosts, job, timeout=store_timeout, ttl=ttl, security=security)
                except (EtcdAccessError, ValueError, TypeError):  # refused, or a setting: no retry helps
                    raise
                except Exception as exc:  # noqa: BLE001 - it accepted a connection but is no etcd
                    causes.append(("refused", host, port, f"not an etcd server, or not healthy: {exc}"))
                    continue
            causes.append((cause, host, port, f"after {took:.3f} s"))
        for cause, host, port, detail in causes:
            logger.info(
                "rendezvous: attempt %d to reach etcd at %s:%d: %s (%s)", attempt, host, port, cause, detail
            )
        left = deadline - time.monotonic()
        unresolvable = all(c[0] == "unresolvable_address" for c in causes)
        if left <= 0 or unresolvable or (retries is not None and attempt > retries):
            first = causes[0]
            raise RendezvousConnectionError(
                cause=first[0],
                address=first[1],
                port=first[2],
                attempts=attempt,
                elapsed=time.monotonic() - start,
                detail="etcd endpoints: " + "; ".join(f"{h}:{p} {c} ({d})" for c, h, p, d in causes),
            )
        time.sleep(min(backoff * 2 ** (attempt - 1) * random.uniform(0.5, 1.5), left))


# What the version record must hold (rank 0 writes it; every other rank checks it).
VERSION_FIELDS: dict[str, type | tuple[type, ...]] = {"torch": str, "fastdist": str, "world_size": int}


def check_versions(store: Any, rank: int, world_size: int, host: str, port: int, timeout: float) -> None:
    """Rank 0 publishes its versions and world size; the others compare theirs."""
    mine = dict(versions(), world_size=world_size)
    if rank == 0:
        store.set(VERSION_KEY, seal.seal_json(mine))
        return
    t0 = time.monotonic()

    def refuse(cause: str, detail: str) -> RendezvousConnectionError:
        return RendezvousConnectionError(
            cause=cause, address=host, port=port, attempts=1, elapsed=time.monotonic() - t0, detail=detail
        )

    store.wait([VERSION_KEY], datetime.timedelta(seconds=timeout))
    theirs = keys.parse_record(store.get(VERSION_KEY), VERSION_FIELDS, "version record")
    if theirs is None:
        raise refuse("invalid_record", f"the version record at {VERSION_KEY!r} is not fastdist's")
    for key in ("torch", "fastdist"):
        if theirs.get(key) != mine[key]:
            raise refuse(
                "version_mismatch", f"rank 0 runs {key} {theirs.get(key)}, rank {rank} runs {mine[key]}"
            )
    if theirs.get("world_size") != world_size:
        raise refuse(
            "world_size_mismatch",
            f"rank 0 was started with world size {theirs.get('world_size')}, rank {rank} with {world_size}",
        )


# ---------------------------------------------------------------------------------------------
# The rendezvous


def rendezvous(
    store: Any,
    rank: int,
    world_size: int,
    rdzv: RendezvousTimeout,
    prefix: str = keys.key("rdzv"),
    hosts_store: bool = False,
) -> None:
    """Every rank announces itself in ``store`` and waits for the others, within ``rdzv``:

    - the call closes ``rdzv`` if it is open, which starts its countdown of ``rdzv.timeout``
      seconds; a rank waits that long, plus ``rdzv.last_call``, for the others;
    - ranks may join until ``rdzv.join`` seconds after this rank started (default: until the
      countdown ends); then the rendezvous is closed and a rank that turns up after that gets
      :class:`RendezvousClosedError` at once;
    - if ranks are still missing when joining ends, every waiting rank raises
      :class:`RendezvousTimeoutError` naming how many of how many joined and which are missing.

    ``rdzv.heartbeat`` is how often a waiting rank looks at the store (default 10 ms). The rank
    that serves the store (``hosts_store``) waits, briefly, until the others have read the
    outcome before it raises: its exit would take the store away from them.
    """
    try:
        _rendezvous(store, rank, world_size, rdzv, prefix, hosts_store)
    except (RendezvousTimeoutError, RendezvousClosedError):
        raise
    except Exception as exc:  # the store went away: its host (rank 0) exited or crashed
        if (
            hosts_store
            or "DistNetworkError" not in type(exc).__name__
            and "DistError" not in type(exc).__name__
        ):
            raise
        raise RendezvousConnectionError(
            cause="refused",
            address="the store",
            port=0,
            attempts=1,
            elapsed=0.0,
            detail=f"rank 0's store went away during the rendezvous ({str(exc).strip().splitlines()[0]})",
        ) from None


def _rendezvous(
    store: Any, rank: int, world_size: int, rdzv: RendezvousTimeout, prefix: str, hosts_store: bool
) -> None:
    start = current_time()
    ends = rdzv.close() + (rdzv.last_call or 0.0)
    join_end = min(start + rdzv.join, ends) if rdzv.join is not None else ends
    poll = rdzv.heartbeat or 0.01
    count_key, closed_key = f"{prefix}/count", f"{prefix}/closed"
    if store.check([closed_key]):
        raise RendezvousClosedError(rank=rank, joined=int(store.add(count_key, 0)), world_size=world_size)
    store.set(f"{prefix}/rank/{rank}", "1")
    count = store.add(count_key, 1)
    while count < world_size:
        if current_time() >= join_end or store.check([f"{prefix}/outcome"]):
            store.set(closed_key, "1")  # nobody can join any more: whoever is missing now stays out
            count = store.add(count_key, 0)
            if count >= world_size:
                break
            missing = [r for r in range(world_size) if not store.check([f"{prefix}/rank/{r}"])]
            # The first rank to decide writes the outcome; everyone reports that one.
            try:
                outcome = json.loads(store.compare_set(f"{prefix}/outcome", "", json.dumps(missing)))
            except ValueError:
                outcome = None
            if isinstance(outcome, list) and all(
                isinstance(r, int) and not isinstance(r, bool) for r in outcome
            ):
                missing = outcome
            else:  # not a rendezvous of fastdist's wrote it: say what this rank saw itself
                logger.warning(
                    "rank %d: the rendezvous outcome in the store is not fastdist's; ignoring it", rank
                )
            read = store.add(f"{prefix}/read", 1)
            joined = world_size - len(missing)
            if hosts_store:
                end = current_time() + 2.0
                while read < joined and current_time() < end:
                    time.sleep(poll)
                    read = store.add(f"{prefix}/read", 0)
            raise RendezvousTimeoutError(
                rank=rank,
                joined=joined,
                world_size=world_size,
                missing_ranks=missing,
                elapsed=current_time() - start,
            )
        time.sleep(poll)
        count = store.add(count_key, 0)
    store.set(closed_key, "1")
