"""An etcd-backed ``torch.distributed.Store``: a rendezvous store the job does not host itself.

The default store of a job lives in one of its processes (rank 0's TCPStore, or torchrun's
agent): lose that process and the who-is-missing reports, :func:`fastdist.recover` and every new
group go with it. :class:`EtcdStore` keeps the same keys in etcd (one server, or a replicated
cluster), so losing any rank loses nothing:

    fastdist.init_process_group("gloo", "etcd://10.0.0.5:2379,10.0.0.6:2379/job-42", rank=r, world_size=n)

It speaks etcd's v3 API through ``etcd3gw`` (the OpenStack client of etcd's gRPC gateway: pure
Python over ``requests``, maintained, and with no gRPC or protobuf build to clash with torch's).

- Every key lives under ``/fastdist/JOB/``. Every key is attached to one lease of the job, which
  every process of the job keeps alive (one thread each, a refresh every ``ttl / 3`` seconds):
  when the last process ends, or is killed, the job's keys vanish ``ttl`` seconds later.
- ``wait`` (and ``get`` of a key not yet set) waits on an etcd watch from the revision it last
  read, so no put is missed and nothing polls; the watch is re-armed every
  ``WATCH_SLICE_SECONDS`` with one read, which is also when a lost member is noticed.
- A request that cannot reach an endpoint moves on to the next one; all of them unreachable is a
  ``torch.distributed.DistNetworkError`` naming each.
- ``queue_push`` / ``queue_pop`` (fastdist's fault bell) are keys ordered by creation revision;
  a pop deletes the oldest one in a transaction, so each item goes to exactly one popper.

Why one file of about 850 lines: one ``torch.distributed.Store`` (its twenty methods) and the lease,
watch, endpoint and TLS handling they share through one client and its connection state.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import threading
import time
import urllib.parse
import uuid
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch.distributed as dist

logger = logging.getLogger(__name__)

DEFAULT_PORT = 2379
DEFAULT_TTL = 60
# How long one watch runs before it is re-armed with a read (the read is also where a lost
# member is noticed and the next endpoint taken).
WATCH_SLICE_SECONDS = 2.0
# Per HTTP request: connect, then read. A watch stream outlives neither (see WATCH_SLICE_SECONDS).
CONNECT_SECONDS = 3.0
READ_SECONDS = 10.0
# Asking a server that closed a connection without a word which protocol it speaks (connect,
# then read): only on that failure, never on a working connection.
PROBE_SECONDS = 2.0
_FOREVER = 10.0 * 365 * 24 * 3600

T = TypeVar("T")

# Every store made, kept alive until close(): torch keeps only the C++ half of a Python store
# (through a PrefixStore, for instance), and once the Python half is collected every call from
# torch fails with "Tried to call pure virtual function". So a store handed to
# init_process_group and dropped by its maker must not die with the maker's reference.
_live: list[EtcdStore] = []
_live_lock = threading.Lock()


def parse_endpoints(endpoints: str | Sequence[str]) -> list[tuple[str, int]]:
    """``"h1:2379,h2:2379"`` (or a list of ``"host[:port]"``) as ``[(host, port), ...]``."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out = []
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"endpoints must be strings like 'HOST:PORT', got {item!r}")
        item = item.strip().removeprefix("http://").removeprefix("https://")
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, str(DEFAULT_PORT)
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"an etcd endpoint must look like HOST:PORT, got {item!r}")
        out.append((host, int(port)))
    if not out:
        raise ValueError(f"endpoints names no etcd endpoint: {endpoints!r}")
    return out


_QUERY = ("ttl", "tls", "ca", "cert", "key", "user", "password")


def _query(url: str) -> dict[str, str]:
    if not isinstance(url, str) or not url.startswith("etcd://"):
        raise ValueError(f"an etcd store URL starts with etcd://, got {url!r}")
    out: dict[str, str] = {}
    for part in filter(None, url.partition("?")[2].split("&")):
        name, _, value = part.partition("=")
        if name not in _QUERY:
            raise ValueError(
                f"an etcd store URL takes ?ttl=, tls=, ca=, cert=, key=, user= and password=; got {name!r} "
                f"in {redact(url)!r}"
            )
        out[name] = urllib.parse.unquote(value)
    return out


def parse_url(url: str) -> tuple[list[tuple[str, int]], str, int]:
    """``etcd://HOST:PORT[,HOST:PORT...]/JOB_ID[?ttl=SECONDS&...]`` as (endpoints, job id, ttl).
    TLS and credentials in the query: :func:`security_of`."""
    query = _query(url)
    rest = url[len("etcd://") :].partition("?")[0]
    hosts, _, job = rest.partition("/")
    job = job.strip("/")
    if not job:
        raise ValueError(f"an etcd store URL must name the job: etcd://HOST:PORT/JOB_ID, got {redact(url)!r}")
    ttl = DEFAULT_TTL
    if "ttl" in query:
        value = query["ttl"]
        if not value.isdigit() or int(value) < 2:
            raise ValueError(f"an etcd store URL's ttl= is a number of seconds (2 or more), got {value!r}")
        ttl = int(value)
    return parse_endpoints(hosts), job, ttl


def redact(url: str) -> str:
    """``url`` with a password in its query replaced by ``***`` (for messages and logs)."""
    head, sep, query = url.partition("?")
    if not sep:
        return url
    parts = [("password=***" if p.startswith("password=") else p) for p in query.split("&")]
    return head + "?" + "&".join(parts)


@dataclass(frozen=True)
class EtcdSecurity:
    """TLS and authentication for an etcd cluster that requires them (as production ones do).

    ``tls``: https (on when ``ca`` is given, or when an endpoint is written ``https://...``);
    ``ca``: the CA file that signed the server's certificate (else the system's CAs); ``cert``
    and ``key``: a client certificate and its key (etcd's ``--client-cert-auth``); ``user`` and
    ``password``: etcd's authentication (``etcdctl auth enable``); the password is never logged
    nor shown in ``repr``.

    From ``etcd://`` URLs: ``?tls=1&ca=PATH&cert=PATH&key=PATH&user=NAME`` (``password=`` too,
    though a URL is easily logged by others); each also from the environment:
    ``FASTDIST_ETCD_CA``, ``FASTDIST_ETCD_CERT``, ``FASTDIST_ETCD_KEY``, ``FASTDIST_ETCD_USER``,
    ``FASTDIST_ETCD_PASSWORD`` (the URL wins).
    """

    tls: bool = False
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("ca", "cert", "key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"etcd {name}= names no readable file: {path!r}")
        if (self.cert is None) != (self.key is None):
            raise ValueError("etcd cert= and key= go together (a client certificate and its key)")
        if (self.user is None) != (self.password is None):
            missing = "password (FASTDIST_ETCD_PASSWORD)" if self.password is None else "user"
            raise ValueError(f"etcd authentication needs a user and a password: the {missing} is missing")
        if (self.ca is not None or self.cert is not None) and not self.tls:
            object.__setattr__(self, "tls", True)

    @property
    def scheme(self) -> str:
        """``"https"`` when ``tls`` is on, else ``"http"``."""
        return "https" if self.tls else "http"


def _flag(value: str, name: str) -> bool:
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no", ""):
        return False
    raise ValueError(f"etcd {name}= is 1 or 0, got {value!r}")


def _https(endpoints: Any) -> bool:
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints or [])
    return any(isinstance(e, str) and e.strip().startswith("https://") for e in items)


def security_of(url: str | None = None, endpoints: Any = None) -> EtcdSecurity:
    """The TLS and credentials for an etcd store: the ``etcd://`` URL's query, else the
    environment (see :class:`EtcdSecurity`); https also when an endpoint says ``https://``."""
    query = _query(url) if url is not None else {}
    env = {
        "ca": "FASTDIST_ETCD_CA",
        "cert": "FASTDIST_ETCD_CERT",
        "key": "FASTDIST_ETCD_KEY",
        "user": "FASTDIST_ETCD_USER",
        "password": "FASTDIST_ETCD_PASSWORD",
    }
    given = {k: query.get(k) or os.environ.get(v) or None for k, v in env.items()}
    tls = _flag(query.get("tls", "0"), "tls") or _https(endpoints)
    return EtcdSecurity(tls=tls, **given)


class EtcdAccessError(PermissionError):
    """etcd refused this client: ``part`` says which part failed: ``"certificate"`` (the server's
    is not trusted, or the client's was refused), ``"password"`` (wrong user or password), or
    ``"permission"`` (the user may not use the job's keys)."""

    def __init__(self, part: str, message: str) -> None:
        super().__init__(message)
        self.part = part


def _encode_value(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, list):  # std::vector<uint8_t> from torch
        return bytes(value)
    raise TypeError(f"a store value must be bytes or str, got {type(value).__name__}")


def _b64(data: str | bytes) -> str:
    from etcd3gw.utils import _encode

    return _encode(data)


def _unb64(data: str) -> bytes:
    from etcd3gw.utils import _decode

    return _decode(data)


def _range_end(prefix: str) -> str:
    from etcd3gw.utils import _increment_last_byte

    return _increment_last_byte(prefix)


def _seconds(timeout: Any, name: str = "timeout") -> float:
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{name} must be seconds or a timedelta, got {type(timeout).__name__}: {timeout!r}")
    if not timeout > 0:
        raise ValueError(f"{name} must be positive, got {timeout!r}")
    return float(timeout)


# Every lease keepalive thread started in this process: the exit stops them (stop_keepalives).
_keepalives: list[_Keepalive] = []


def stop_keepalives() -> None:
    """At exit (fastdist.shutdown): every lease keepalive stops renewing; the lease then expires
    with its TTL, as when the process dies."""
    for keepalive in _keepalives:
        keepalive.stopped.set()


class _Keepalive(threading.Thread):
    """Refreshes the job's lease every ttl / 3 seconds while this process uses the store."""

    def __init__(self, store: EtcdStore, lease_id: int, ttl: int) -> None:
        super().__init__(name="fastdist-etcd-lease", daemon=True)
        self.store_ref = weakref.ref(store)
        self.lease_id = lease_id
        self.ttl = ttl
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.ttl / 3.0):
            store = self.store_ref()
            if store is None:
                return
            try:
                left = store._lease_refresh(self.lease_id)
            except Exception as exc:  # noqa: BLE001 - etcd unreachable for now: the next refresh may do
                logger.warning("fastdist: could not refresh the job's etcd lease: %s", exc)
                continue
            if left <= 0:
                logger.error(
                    "fastdist: the job's etcd lease expired (all its processes were away for %d s): "
                    "its keys are gone",
                    self.ttl,
                )
                return
            del store


class EtcdStore(dist.Store):
    """A ``torch.distributed.Store`` on etcd's v3 API (see the module's docstring).

    ``endpoints``: ``"HOST:PORT[,HOST:PORT...]"`` or a list of them (the members of one cluster);
    ``prefix``: the job's id (keys live under ``/fastdist/PREFIX/``); ``timeout``: how long
    ``get`` and ``wait`` wait for a key by default (seconds or ``timedelta``); ``ttl``: seconds
    the job's keys outlive its last process.

    Each instance is one HTTP connection pool; :meth:`clone` makes another (blocking waits use
    their own). Safe to share between threads.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        prefix: str,
        timeout: Any = 300.0,
        ttl: int = DEFAULT_TTL,
        *,
        security: EtcdSecurity | None = None,
        _lease: tuple[int, _Keepalive] | None = None,
    ) -> None:
        super().__init__()
        if security is None:
            security = security_of(None, endpoints)
        elif not isinstance(security, EtcdSecurity):
            raise TypeError(f"security must be a fastdist.EtcdSecurity, got {type(security).__name__}")
        elif _https(endpoints) and not security.tls:
            security = replace(security, tls=True)
        self._security = security
        if not isinstance(prefix, str) or not prefix.strip("/"):
            raise ValueError(f"prefix must be a non-empty string (the job's id), got {prefix!r}")
        if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 2:
            raise ValueError(f"ttl must be an int of at least 2 seconds, got {ttl!r}")
        self._endpoints = parse_endpoints(endpoints)
        self._job = prefix.strip("/")
        self._root = f"/fastdist/{self._job}/"
        self._ttl = ttl
        self._timeout = _seconds(timeout)
        super().set_timeout(datetime.timedelta(seconds=self._timeout))
        self._current = 0
        self._clients = [self._client(h, p) for h, p in self._endpoints]
        self._clones: list[EtcdStore] = []  # kept alive with this one (see _live)
        if _lease is None:
            lease_id = self._join_lease()
            keepalive = _Keepalive(self, lease_id, ttl)
            keepalive.start()
            _keepalives.append(keepalive)  # stopped at exit (fastdist.shutdown)
            _lease = (lease_id, keepalive)
            with _live_lock:
                _live.append(self)
        self._lease_id, self._keepalive = _lease

    # -- plumbing ---------------------------------------------------------------------------

    def _client(self, host: str, port: int) -> Any:
        return make_client(host, port, self._security)

    def _call(self, fn: Callable[[Any], T]) -> T:
        """``fn(client)`` on the current endpoint, moving on to the next ones while they cannot
        be reached; raises DistNetworkError naming each when none can."""
        from etcd3gw import exceptions as ex

        failures = []
        tls_failures = []
        for i in range(len(self._clients)):
            idx = (self._current + i) % len(self._clients)
            host, port = self._endpoints[idx]
            try:
                out = fn(self._clients[idx])
            except (ex.ConnectionFailedError, ex.ConnectionTimeoutError, ex.InternalServerError) as exc:
                tls = tls_failure(_text(exc), self._security, (host, port))
                if tls is not None:
                    tls_failures.append(f"{host}:{port}: {tls}")
                failures.append(f"{host}:{port}: {_short(exc)}")
                continue
            except ex.Etcd3Exception as exc:
                raise_refusal(exc, f"etcd {host}:{port}", self._security, self._job)
                raise
            if idx != self._current:
                logger.info("fastdist: etcd endpoint %s:%d answers; using it", *self._endpoints[idx])
                self._current = idx
            return out
        if tls_failures and len(tls_failures) == len(failures):
            raise EtcdAccessError("certificate", f"TLS with etcd failed: {'; '.join(tls_failures)}")
        raise dist.DistNetworkError(
            f"no etcd endpoint of job {self._job!r} can be reached: {'; '.join(failures)}"
        )

    def _txn(self, compare: list[Any], success: list[Any], failure: list[Any] | None = None) -> Any:
        body = {"compare": compare, "success": success, "failure": failure or []}
        return self._call(lambda c: c.transaction(body))

    def _key(self, key: str) -> str:
        if not isinstance(key, str):
            raise TypeError(f"a store key must be a str, got {type(key).__name__}")
        return self._root + key

    def _put(self, key: str, value: bytes) -> dict[str, Any]:
        return {"request_put": {"key": _b64(key), "value": _b64(value), "lease": self._lease_id}}

    @staticmethod
    def _range(key: str, **extra: Any) -> dict[str, Any]:
        return {"request_range": {"key": _b64(key), **extra}}

    def _read(self, keys: Iterable[str]) -> tuple[int, dict[str, tuple[bytes, int]]]:
        """One consistent read of ``keys`` (full etcd keys): (revision, {key: (value, mod_revision)})."""
        keys = list(keys)
        resp = self._txn([], [self._range(k) for k in keys])
        found: dict[str, tuple[bytes, int]] = {}
        for r in resp.get("responses", []):
            for kv in r.get("response_range", {}).get("kvs", []):
                found[_unb64(kv["key"]).decode()] = (_unb64(kv.get("value", "")), int(kv["mod_revision"]))
        return int(resp["header"]["revision"]), found

    def _watch_put(self, key: str, revision: int, seconds: float, prefix: bool = False) -> None:
        """Returns at the first put to ``key`` (or under it, ``prefix``) after ``revision``, or
        after ``seconds``."""
        from etcd3gw import exceptions as ex

        def watch(c: Any) -> None:
            kwargs: dict[str, Any] = {"start_revision": revision + 1, "filters": ["NODELETE"]}
            if prefix:
                kwargs["range_end"] = _range_end(key)
            try:
                c.watch_once(key, timeout=seconds, **kwargs)
            except ex.WatchTimedOut:
                pass

        self._call(watch)

    def _join_lease(self) -> int:
        """The job's lease: made by the first process (and recorded under the job's root,
        attached to itself), joined by the others."""
        key = self._root + "__lease__"
        for _ in range(10):
            lease = self._call(lambda c: c.lease(self._ttl))
            resp = self._txn(
                [{"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
                [{"request_put": {"key": _b64(key), "value": _b64(str(lease.id)), "lease": lease.id}}],
                [self._range(key)],
            )
            if resp.get("succeeded"):
                return int(lease.id)
            lost = int(lease.id)  # another process made the job's lease first: ours goes

            def revoke(c: Any, lost: int = lost) -> Any:
                return c.post(c.get_url("/kv/lease/revoke"), json={"ID": lost})

            self._call(revoke)
            kvs = resp["responses"][0]["response_range"].get("kvs", [])
            if kvs:
                return int(_unb64(kvs[0]["value"]))
        raise dist.DistStoreError(f"could not make or join the etcd lease of job {self._job!r}")

    def _lease_refresh(self, lease_id: int) -> int:
        resp = self._call(lambda c: c.post(c.get_url("/lease/keepalive"), json={"ID": lease_id}))
        return int(resp.get("result", resp).get("TTL", 0))

    def _timeout_error(self, keys: Sequence[str], seconds: float) -> Exception:
        return dist.DistStoreError(f"wait timeout after {round(seconds * 1000)}ms, keys: {', '.join(keys)}")

    # -- torch's Store ------------------------------------------------------------------------

    def set(self, key: str, value: Any) -> None:
        """Sets ``key`` to ``value`` (bytes or str); the key lives as long as the job's lease."""
        self._txn([], [self._put(self._key(key), _encode_value(value))])

    def get(self, key: str) -> bytes:
        """The value of ``key``; when it is unset, waits for it as :meth:`wait` does (up to the
        store's timeout)."""
        full = self._key(key)
        _, found = self._read([full])
        if full not in found:
            self.wait([key])
            _, found = self._read([full])
        return found[full][0]

    def check(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` is set (one consistent read)."""
        full = [self._key(k) for k in keys]
        _, found = self._read(full)
        return all(k in found for k in full)

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        """Blocks until every one of ``keys`` is set, watching etcd rather than polling; raises
        ``DistStoreError`` after ``timeout`` (seconds or a ``timedelta``; default: the store's)."""
        seconds = self._timeout if timeout is None else _seconds(timeout)
        deadline = time.monotonic() + seconds
        full = [self._key(k) for k in keys]
        while True:
            revision, found = self._read(full)
            missing = [k for k in full if k not in found]
            if not missing:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timeout_error(list(keys), seconds)
            self._watch_put(missing[0], revision, min(left, WATCH_SLICE_SECONDS))

    @staticmethod
    def _unchanged_since(full: str, old: tuple[bytes, int] | None) -> dict[str, Any]:
        """The transaction's condition: ``full`` is still unset (``old`` None), or unwritten
        since the read that gave ``old``."""
        if old is None:
            return {"key": _b64(full), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
        return {"key": _b64(full), "result": "EQUAL", "target": "MOD", "mod_revision": old[1]}

    def _update(self, key: str, change: Callable[[bytes | None], bytes | None]) -> bytes:
        """Read-modify-write of one key, retried until no one wrote it in between. ``change``
        gets the value (None: unset) and returns the new one, or None to write nothing; the
        result is what was written, or the value read when nothing was (b"" when unset)."""
        full = self._key(key)
        while True:
            _, found = self._read([full])
            old = found.get(full)
            new = change(None if old is None else old[0])
            if new is None:
                return b"" if old is None else old[0]
            if self._txn([self._unchanged_since(full, old)], [self._put(full, new)]).get("succeeded"):
                return new

    def add(self, key: str, amount: int) -> int:
        """Adds ``amount`` to the integer in ``key`` (0 when unset), atomically; returns the new
        value."""
        return int(self._update(key, lambda old: str(int(old or b"0") + int(amount)).encode()))

    def append(self, key: str, value: Any) -> None:
        """Appends ``value`` (bytes or str) to the value of ``key`` (unset: empty), atomically."""
        tail = _encode_value(value)
        self._update(key, lambda old: (old or b"") + tail)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        """As TCPStore: sets ``desired`` if the key holds ``expected`` (or is unset and
        ``expected`` is empty) and returns it; else returns the current value (or ``expected``
        when the key is unset)."""
        want, new = _encode_value(expected), _encode_value(desired)
        if not want:
            return self._update(key, lambda old: new if not old else None)
        got = self._update(key, lambda old: new if old == want else None)
        # b"": the key is unset (then TCPStore answers ``expected``) or holds b"".
        return got if got or self.check([key]) else want

    def delete_key(self, key: str) -> bool:
        """Deletes ``key``; True when it was set."""
        full = self._key(key)
        resp = self._txn([], [{"request_delete_range": {"key": _b64(full)}}])
        return bool(int(resp["responses"][0]["response_delete_range"].get("deleted", 0)))

    def num_keys(self) -> int:
        """How many keys the job holds (its lease record included)."""
        resp = self._txn(
            [], [self._range(self._root, range_end=_b64(_range_end(self._root)), count_only=True)]
        )
        return int(resp["responses"][0]["response_range"].get("count", 0))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys``, in order, each read as :meth:`get` reads it."""
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        """Sets each of ``keys`` to the value in ``values`` at its place, in one transaction."""
        self._txn([], [self._put(self._key(k), _encode_value(v)) for k, v in zip(keys, values)])

    def set_timeout(self, timeout: Any) -> None:
        """Sets how long :meth:`get`, :meth:`wait` and :meth:`queue_pop` wait by default
        (``timeout``: seconds or a ``timedelta``)."""
        self._timeout = _seconds(timeout)
        super().set_timeout(datetime.timedelta(seconds=min(self._timeout, _FOREVER)))

    def clone(self) -> EtcdStore:
        """Another connection pool to the same job (same lease, same keys)."""
        twin = EtcdStore(
            [f"{h}:{p}" for h, p in self._endpoints],
            self._job,
            timeout=min(self._timeout, _FOREVER),
            ttl=self._ttl,
            security=self._security,
            _lease=(self._lease_id, self._keepalive),
        )
        self._clones.append(twin)
        return twin

    # -- queues (torch does not forward these from a PrefixStore to a Python store) ------------

    def _queue(self, key: str) -> str:
        return self._root + "__queue__/" + key + "/"

    def queue_push(self, key: str, value: Any) -> None:
        """Adds ``value`` (bytes or str) to queue ``key`` (popped oldest first)."""
        self._txn([], [self._put(self._queue(key) + uuid.uuid4().hex, _encode_value(value))])

    def queue_len(self, key: str) -> int:
        """How many items queue ``key`` holds."""
        q = self._queue(key)
        resp = self._txn([], [self._range(q, range_end=_b64(_range_end(q)), count_only=True)])
        return int(resp["responses"][0]["response_range"].get("count", 0))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """The oldest item of queue ``key``, removed; waits for one up to the store's timeout
        (``block``), else raises at once when the queue is empty."""
        q = self._queue(key)
        seconds = self._timeout
        deadline = time.monotonic() + seconds
        while True:
            resp = self._txn(
                [],
                [self._range(q, range_end=_b64(_range_end(q)), sort_order=1, sort_target=2, limit=1)],
            )  # sort_order 1 = ascending, sort_target 2 = creation revision
            kvs = resp["responses"][0]["response_range"].get("kvs", [])
            if kvs:
                kv = kvs[0]
                taken = self._txn(
                    [
                        {
                            "key": kv["key"],
                            "result": "EQUAL",
                            "target": "MOD",
                            "mod_revision": int(kv["mod_revision"]),
                        }
                    ],
                    [{"request_delete_range": {"key": kv["key"]}}],
                )
                if taken.get("succeeded"):
                    return _unb64(kv.get("value", ""))
                continue  # another popper took it
            if not block:
                raise dist.DistStoreError(f"queue {key!r} is empty")
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timeout_error([key], seconds)
            self._watch_put(q, int(resp["header"]["revision"]), min(left, WATCH_SLICE_SECONDS), prefix=True)

    # -- the job's end --------------------------------------------------------------------------

    def close(self) -> None:
        """Stops this process's lease refresh: the job's keys vanish ``ttl`` seconds after the
        last process stopped refreshing (or exited). The store must not be used by torch after."""
        self._keepalive.stopped.set()
        with _live_lock:
            if self in _live:
                _live.remove(self)

    def delete_all(self) -> None:
        """Deletes every key of the job now (for a job that is over on every rank)."""
        self._txn(
            [],
            [{"request_delete_range": {"key": _b64(self._root), "range_end": _b64(_range_end(self._root))}}],
        )

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        """The cluster's endpoints, as (host, port)."""
        return list(self._endpoints)

    @property
    def job(self) -> str:
        """The job's id (``prefix`` without its slashes): its keys live under ``/fastdist/JOB/``."""
        return self._job

    def __repr__(self) -> str:
        hosts = ",".join(f"{h}:{p}" for h, p in self._endpoints)
        return f"EtcdStore('{hosts}', job={self._job!r})"


def make_client(host: str, port: int, sec: EtcdSecurity, timeout: Any = None) -> Any:
    """An etcd3gw client of one endpoint: TLS and authentication from ``sec``; every request
    bounded (``timeout``: (connect, read) seconds, default CONNECT_SECONDS, READ_SECONDS)."""
    import requests
    from etcd3gw.client import Etcd3Client

    where = f"etcd {host}:{port}"

    class _Session(requests.Session):
        """Every request bounded; with a user, each carries the token, taken (again, when
        etcd says it expired) from /v3/auth/authenticate."""

        token: str | None = None

        def request(self, method: Any, url: Any, *args: Any, **kwargs: Any) -> Any:
            # (per request: requests lets REQUESTS_CA_BUNDLE override the session's own verify)
            kwargs.setdefault("verify", self.verify)
            kwargs.setdefault("timeout", (CONNECT_SECONDS, READ_SECONDS))
            if kwargs["timeout"] is None:
                kwargs["timeout"] = (CONNECT_SECONDS, READ_SECONDS)
            if sec.user is None or str(url).endswith("/auth/authenticate"):
                return super().request(method, url, *args, **kwargs)
            for attempt in (0, 1):
                if self.token is None or attempt:
                    self.token = _authenticate(self, str(url), sec, where)
                kwargs["headers"] = {**(kwargs.get("headers") or {}), "Authorization": self.token}
                resp = super().request(method, url, *args, **kwargs)
                if resp.status_code != 401:
                    break
            return resp

    session = _Session()
    session.verify = sec.ca if sec.ca is not None else True
    if sec.cert is not None and sec.key is not None:
        session.cert = (sec.cert, sec.key)
    # (requests takes a (connect, read) pair where etcd3gw's annotation says a number)
    if timeout is None:
        timeout = (CONNECT_SECONDS, READ_SECONDS)
    return Etcd3Client(host=host, port=port, protocol=sec.scheme, timeout=timeout, session=session)


def _authenticate(session: Any, url: str, sec: EtcdSecurity, where: str) -> str:
    """A token for ``sec.user`` from the server ``url`` is on (etcd's /v3/auth/authenticate)."""
    parts = urllib.parse.urlsplit(url)
    base = f"{parts.scheme}://{parts.netloc}"
    resp = session.request(
        "POST",
        base + "/v3/auth/authenticate",
        json={"name": sec.user, "password": sec.password},
        timeout=(CONNECT_SECONDS, READ_SECONDS),
    )
    if resp.status_code == 200 and resp.json().get("token"):
        return str(resp.json()["token"])
    text = resp.text[:300]
    if "authentication is not enabled" in text:
        raise EtcdAccessError(
            "password", f"{where}: a user was given but authentication is not enabled there"
        )
    if "invalid user ID or password" in text or "authentication failed" in text:
        raise EtcdAccessError(
            "password", f"{where}: user {sec.user!r} could not log in: wrong user or password"
        )
    raise EtcdAccessError(
        "password", f"{where}: logging in as {sec.user!r} failed: HTTP {resp.status_code} {text}"
    )


_MISMATCH = re.compile(r"(?:Hostname|IP address) mismatch, certificate is not valid for '([^']*)'")
# What a client sees when the server closed the connection without a word: a TLS server does
# that to a plain request, and a plain server (etcd's) to a TLS handshake.
_CLOSED = ("EOF occurred in violation of protocol", "SSLEOFError", "Connection aborted", "Connection reset")


def tls_failure(text: str, sec: EtcdSecurity, endpoint: tuple[str, int] | None = None) -> str | None:
    """What a connection failure says about TLS, in words (None: nothing about TLS). Given the
    ``endpoint``, a connection the server closed without a word is settled by asking the server
    once what it speaks (:func:`server_protocol`)."""
    if "CERTIFICATE_VERIFY_FAILED" in text:
        # (OpenSSL checks the name only once the chain is trusted)
        mismatch = _MISMATCH.search(text)
        if mismatch:
            return (
                f"the server's certificate is trusted but not issued for {mismatch.group(1)!r}: connect by "
                "a name or address the certificate lists (its subjectAltName)"
            )
        if "certificate has expired" in text:
            return "the server's certificate has expired"
        ca = f"the CA file {sec.ca!r}" if sec.ca else "the system's CAs (give ca=)"
        return f"the server's certificate is not trusted by {ca}"
    if "WRONG_VERSION_NUMBER" in text or "wrong version number" in text:
        return "the server does not speak TLS here: use http (no tls=, ca=)"
    refused = "certificate required" in text or "bad certificate" in text or "unknown ca" in text
    spoken = None
    if not refused and any(words in text for words in _CLOSED) and endpoint is not None:
        spoken = server_protocol(*endpoint)
    if not sec.tls:
        if spoken is not None and spoken != "http":
            return (
                "the server speaks TLS (https), and closed this plain http connection: use https (tls=1, ca=)"
            )
        return None
    if spoken == "http":
        return (
            "the server does not speak TLS (it answers plain http, and closed the TLS handshake): use "
            "http (no tls=, ca=)"
        )
    if refused or spoken == "tls-client-cert":
        if sec.cert is None:
            return (
                "the server asks for a client certificate (it refused this client, which has none): give "
                "cert=, key="
            )
        return "the server asks for a client certificate and refused this client's (cert=, key=)"
    if "EOF occurred in violation of protocol" in text or "SSLEOFError" in text:
        return "the server ended the TLS handshake without saying why"
    if "SSL" in text:
        return "TLS failed: " + text[:160]
    return None


def server_protocol(host: str, port: int, timeout: float = PROBE_SECONDS) -> str | None:
    """What the server at ``host:port`` speaks, asked once: ``"http"`` (plain), ``"tls"``,
    ``"tls-client-cert"`` (TLS, and it refuses a client without a certificate), or None (no
    clear answer). A TLS handshake and a request first (no certificate is checked or sent: only
    the answer counts), then a plain request."""
    import socket
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    request = f"GET /version HTTP/1.0\r\nHost: {host}\r\n\r\n".encode()
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw:
            try:
                with ctx.wrap_socket(raw, server_hostname=host) as tls:
                    # (TLS 1.3: a server that wants a certificate says so after the handshake)
                    tls.sendall(request)
                    tls.recv(256)
                    return "tls"
            except ssl.SSLError as exc:
                words = str(exc).lower()
                if "certificate required" in words or "bad certificate" in words:
                    return "tls-client-cert"
                if "alert" in words:
                    return "tls"
            except OSError:
                pass  # closed or reset: not TLS, or not answering at all
        with socket.create_connection((host, port), timeout=timeout) as raw:
            raw.sendall(request)
            reply = raw.recv(256)
    except OSError:
        return None
    if reply.startswith(b"HTTP/"):  # (a TLS server may answer a plain request so, in words)
        return "tls" if b"HTTPS server" in reply else "http"
    return None


def raise_refusal(exc: Any, where: str, sec: EtcdSecurity, job: str) -> None:
    """An etcd answer that refuses this client, as EtcdAccessError (else nothing)."""
    text = _text(exc)
    if "permission denied" in text:
        who = f"user {sec.user!r}" if sec.user else "this client (no user given)"
        raise EtcdAccessError(
            "permission",
            f"{where}: permission denied: {who} may not use the keys of job {job!r} (/fastdist/{job}/)",
        ) from None
    if "user name is empty" in text or "invalid auth token" in text or "Unauthenticated" in text:
        raise EtcdAccessError(
            "password",
            f"{where}: authentication is enabled there: give a user and a password (user=, "
            "FASTDIST_ETCD_PASSWORD)",
        ) from None
    if "HTTP request to an HTTPS server" in text:
        raise EtcdAccessError(
            "certificate", f"{where}: the server speaks TLS: use https (tls=1, ca=)"
        ) from None


def _text(exc: BaseException) -> str:
    """What an exception says (etcd3gw's keep it in ``detail_text``, not in their args)."""
    return str(getattr(exc, "detail_text", None) or exc)


def _short(exc: BaseException) -> str:
    text = _text(exc).strip().splitlines()[0] if _text(exc).strip() else type(exc).__name__
    return text[:200]


def queues_of(store: Any) -> Any:
    """The store that holds fastdist's queues: the :class:`EtcdStore` under torch's
    PrefixStores (torch does not forward queue calls to a Python store), else ``store``."""
    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    return inner if isinstance(inner, EtcdStore) else store
