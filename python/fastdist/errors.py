"""fastdist's exceptions.

Every error carries the fields a person needs to act on it and builds its message from them.
All of them pickle (they cross process boundaries in multi-process tools and in RPC), and every
timeout error is also a builtin :class:`TimeoutError`, so ``except TimeoutError`` catches it.
"""

from __future__ import annotations

import copy
import errno
import time
from collections.abc import Sequence
from typing import Any, ClassVar

from typing_extensions import dataclass_transform  # a dependency of torch

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "FastdistError",
    "GroupAbortedError",
    "MetricsPortError",
    "RecoveryError",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousTimeoutError",
    "RpcTimeoutError",
]


def _rebuild(cls: type[FastdistError], fields: dict[str, Any]) -> FastdistError:
    return cls(**fields)


def _fmt_seconds(value: float | None) -> str:
    if value is None:
        return "?"
    return f"{value:.3g} s" if value < 10 else f"{value:.1f} s"


def _fmt_ranks(ranks: Sequence[int]) -> str:
    ranks = list(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


@dataclass_transform(kw_only_default=True)
class FastdistError(Exception):
    """Base of every error fastdist raises on its own account.

    Subclasses list their fields in ``_fields`` and annotate them; the constructor takes them as
    keyword arguments (type checkers see a typed constructor made from the annotations, as for a
    dataclass), stores them as attributes, and the message comes from ``_message()``.
    """

    _fields: ClassVar[tuple[str, ...]] = ("message",)

    def __init__(self, message: str = "", **fields: Any) -> None:
        if type(self)._fields == ("message",):
            fields["message"] = message
        elif message:
            raise TypeError(f"{type(self).__name__} builds its message from its fields; pass them by keyword")
        unknown = set(fields) - set(self._fields)
        if unknown:
            raise TypeError(f"{type(self).__name__} got unknown fields: {sorted(unknown)}")
        for name in self._fields:
            setattr(self, name, fields.get(name))
        super().__init__(self._message())

    def _message(self) -> str:
        return str(getattr(self, "message", "") or "")

    def _field_values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._fields}

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self._field_values()))


class CollectiveTimeoutError(FastdistError, TimeoutError):
    """A collective did not finish before its deadline.

    Fields: ``op`` (e.g. ``"all_reduce"``), ``seq`` (its sequence number on the group: the
    n-th fastdist collective on it), ``rank`` (this process's global rank), ``world_size`` (the
    group's size), ``group`` (its name, ``"default"`` for the default group), ``timeout`` (the
    budget in seconds the call had), ``elapsed`` (seconds it waited), ``missing_ranks`` (global
    ranks that never reached this collective; ``None`` when no report could be made),
    ``desynced`` (global rank -> what it is doing instead, e.g. ``"barrier #57"``, for ranks that
    are alive but in another collective), ``last_seen`` (the collective every rank last completed
    together), ``cause`` (what the backend said, if the backend noticed first) and ``stacks``
    (global rank -> its innermost Python frames, ``"file:line in function"``, for each rank that
    was elsewhere and answered; a missing rank absent from it did not answer) and ``straggler``
    (a line naming the rank that arrived last in most of the group's recent ops, if one did).
    """

    _fields = (
        "op",
        "seq",
        "rank",
        "world_size",
        "group",
        "timeout",
        "elapsed",
        "missing_ranks",
        "desynced",
        "last_seen",
        "cause",
        "stacks",
        "straggler",
    )

    op: str
    seq: int | None
    rank: int
    world_size: int
    group: str
    timeout: float
    elapsed: float
    missing_ranks: list[int] | None
    desynced: dict[int, str] | None
    last_seen: str | None
    cause: str | None
    stacks: dict[int, list[str]] | None = None
    straggler: str | None = None

    def _message(self) -> str:
        what = self.op if self.seq is None else f"{self.op} #{self.seq}"
        if self.timeout is not None and self.timeout <= 0:
            # The call came after its deadline (a scope's budget spent by earlier work): it was
            # not issued on this rank.
            text = (
                f"{what} on group {self.group!r} was not issued on rank {self.rank}: its deadline had passed "
                f"{_fmt_seconds(-self.timeout)} before the call"
            )
        else:
            text = (
                f"{what} on group {self.group!r} timed out on rank {self.rank} after a timeout of "
                f"{_fmt_seconds(self.timeout)}"
            )
        parts = []
        if self.missing_ranks:
            seen = f" (last seen in {self.last_seen})" if self.last_seen else ""
            parts.append(f"{_fmt_ranks(self.missing_ranks)} never arrived{seen}")
        for r, doing in sorted((self.desynced or {}).items()):
            parts.append(f"rank {r} is in {doing}")
        if self.missing_ranks is not None and not parts and (self.timeout is None or self.timeout > 0):
            parts.append("every rank arrived, but the collective did not finish in time")
        if parts:
            text += ": " + "; ".join(parts)
        if self.cause:
            text += f" [{self.cause}]"
        return text + self._where()

    def _where(self) -> str:
        """One line per rank that was not in this op: where it is, or that it did not answer."""
        if self.stacks is None:
            return ""
        lines = []
        for r in sorted(set(self.missing_ranks or []) | set(self.desynced or {})):
            frames = self.stacks.get(r)
            where = " <- ".join(frames) if frames else ""
            if r in (self.desynced or {}):
                lines.append(f"rank {r} is in {(self.desynced or {})[r]}" + (f": {where}" if where else ""))
            elif frames:
                lines.append(f"rank {r} is not in a collective: {where}")
            else:
                lines.append(f"rank {r} did not answer (stopped, dead, or holding the GIL in a long C call)")
        if self.straggler:
            lines.append(self.straggler)
        return "".join(f"\n  {line}" for line in lines)


class CollectiveMismatchError(FastdistError, ValueError):
    """With checks on (``FASTDIST_CHECK=1`` or :func:`fastdist.set_checks`), ranks called
    different collectives, or the same one with different dtypes or shapes.

    Fields: ``op``, ``seq``, ``group``, ``rank``, ``expected`` (the signature most ranks used),
    ``differing`` (global rank -> its signature, for each rank that differs). Every rank raises
    the same error; nothing was sent, and the group stays usable.
    """

    _fields = ("op", "seq", "group", "rank", "expected", "differing")

    op: str
    seq: int
    group: str
    rank: int
    expected: str
    differing: dict[int, str]

    def _message(self) -> str:
        diffs = "; ".join(f"rank {r} called {sig}" for r, sig in sorted(self.differing.items()))
        return (
            f"{self.op} #{self.seq} on group {self.group!r} does not match across ranks: expected "
            f"{self.expected}; {diffs}"
        )


class RpcTimeoutError(FastdistError, TimeoutError):
    """An RPC did not return before its deadline. Fields: ``to`` (the callee), ``func`` (the
    function's name), ``timeout`` (the budget in seconds), ``elapsed``. The callee may still be
    running the function; its result is dropped."""

    _fields = ("to", "func", "timeout", "elapsed")

    to: str
    func: str
    timeout: float
    elapsed: float

    def _message(self) -> str:
        return (
            f"RPC {self.func} to {self.to!r} timed out after {_fmt_seconds(self.timeout)} "
            f"(waited {_fmt_seconds(self.elapsed)}); the callee may still be running it"
        )


# The same causes when the job's store is etcd (etcd://HOST:PORT/JOB): no MASTER_ADDR, no rank 0.
_ETCD_ADVICE = {
    "unresolvable_address": "an etcd endpoint's name does not resolve: check the etcd:// URL, and DNS here",
    "refused": "nothing (or no healthy etcd) answers there: is the etcd cluster up, on the URL's ports?",
    "unreachable": (
        "no answer from etcd at all: a firewall or a wrong network; check each endpoint is reachable "
        "from here (nc -vz HOST PORT)"
    ),
}
_CONNECT_ADVICE = {
    "unresolvable_address": (
        "the name does not resolve: check MASTER_ADDR for typos, and DNS or /etc/hosts on this machine"
    ),
    "port_in_use": "the port is already taken here: pick another MASTER_PORT, or stop the process holding it",
    "refused": "nothing is listening there: is rank 0 running, on that machine, with the same MASTER_PORT?",
    "unreachable": (
        "no answer at all: a firewall or a wrong network; "
        "check the address is reachable from here (nc -vz HOST PORT)"
    ),
    "version_mismatch": "the ranks run different versions: install the same torch and fastdist everywhere",
    "world_size_mismatch": (
        "the ranks were started with different world sizes: check WORLD_SIZE / --nnodes / --nproc-per-node"
    ),
    "invalid_record": (
        "something other than this job's rank 0 wrote fastdist's keys in the store: is another job (or "
        "anyone else) using MASTER_PORT? Run each job on its own port, on a private network"
    ),
}


class RendezvousConnectionError(FastdistError, ConnectionError):
    """The ranks could not get together. Fields: ``cause`` (one of ``"unresolvable_address"``,
    ``"port_in_use"``, ``"refused"``, ``"unreachable"``, ``"version_mismatch"``,
    ``"world_size_mismatch"``, ``"invalid_record"``), ``address``, ``port``, ``attempts``,
    ``elapsed`` and ``detail`` (e.g. the process holding the port). The message says what to check."""

    _fields = ("cause", "address", "port", "attempts", "elapsed", "detail")

    cause: str
    address: str
    port: int
    attempts: int
    elapsed: float
    detail: str | None

    def _message(self) -> str:
        text = f"rendezvous with {self.address}:{self.port} failed ({self.cause}"
        text += (
            f", {self.attempts} attempt{'s' if self.attempts != 1 else ''} in {_fmt_seconds(self.elapsed)})"
        )
        if self.detail:
            text += f": {self.detail}"
        etcd = (self.detail or "").startswith("etcd endpoints:")
        advice = (_ETCD_ADVICE if etcd else _CONNECT_ADVICE).get(self.cause)
        return f"{text}. {advice[0].upper() + advice[1:]}." if advice else text


class RendezvousClosedError(FastdistError):
    """This rank turned up after the rendezvous closed. Fields: ``rank``, ``joined``,
    ``world_size``."""

    _fields = ("rank", "joined", "world_size")

    rank: int
    joined: int
    world_size: int

    def _message(self) -> str:
        return (
            f"rank {self.rank} arrived after the rendezvous closed ({self.joined} of {self.world_size} "
            "ranks had joined)"
        )


class RendezvousTimeoutError(FastdistError, TimeoutError):
    """Ranks were missing when the rendezvous countdown ended. Fields: ``rank``, ``joined``,
    ``world_size``, ``missing_ranks``, ``elapsed``."""

    _fields = ("rank", "joined", "world_size", "missing_ranks", "elapsed")

    rank: int
    joined: int
    world_size: int
    missing_ranks: list[int]
    elapsed: float

    def _message(self) -> str:
        return (
            f"rendezvous timed out on rank {self.rank} after {_fmt_seconds(self.elapsed)}: {self.joined} of "
            f"{self.world_size} ranks joined; missing: {_fmt_ranks(self.missing_ranks)}"
        )


class RecoveryError(FastdistError):
    """:func:`fastdist.recover` could not rebuild the group. Fields: ``group``, ``rank``,
    ``generation`` (the one being built), ``reason``, ``missing_ranks``, and ``retryable``: True
    when a fault during the hand-over of the state failed it (a joiner or the rank sending the
    state died or stalled mid-way): every live rank may call ``recover()`` again, and a new
    replacement takes the dead rank's place (``run_step`` and ``fastdist.accelerate.step`` do,
    and a replacement's ``sync_state`` joins that next recovery)."""

    _fields = ("group", "rank", "generation", "reason", "missing_ranks", "retryable")

    group: str
    rank: int
    generation: int
    reason: str
    missing_ranks: list[int] | None
    retryable: bool | None

    def _message(self) -> str:
        text = (
            f"recovering group {self.group!r} (generation {self.generation}) failed on rank {self.rank}: "
            f"{self.reason}"
        )
        if self.missing_ranks:
            text += f" ({_fmt_ranks(self.missing_ranks)} did not turn up)"
        return text


def _next_step(reason: str) -> str:
    """What a rank whose group is aborted should do: recover, unless the job's store is gone
    (then nothing in the job can agree on anything)."""
    if "the job's store" in reason and "cannot be reached" in reason:
        return "restart the job (recovery needs the store)"
    return "call fastdist.recover() on every live rank"


class GroupAbortedError(FastdistError):
    """A call on a process group that is no longer usable.

    Raised at once by any fastdist call on a group after a collective on it timed out (gloo
    closes the group's connections then, and every later op would fail or hang), or when the
    backend reported that a peer closed the group mid-collective (it exited or was killed).
    Fields: ``op`` (the call that was refused or failed), ``group``, ``rank`` and ``reason``
    (what killed the group: the original timeout's message, or the backend's words). Every live
    rank can then call :func:`fastdist.recover`.
    """

    _fields = ("op", "group", "rank", "reason")

    op: str
    group: str
    rank: int
    reason: str

    def _message(self) -> str:
        return (
            f"{self.op} on group {self.group!r} on rank {self.rank}: the group is aborted "
            f"({self.reason}); {_next_step(self.reason)}"
        )


class MetricsPortError(FastdistError, OSError):
    """fastdist's metrics could not listen where they were asked to. Fields: ``address``,
    ``port``, ``code`` (the system's errno, also in ``errno``: ``errno.EADDRINUSE`` for a port
    already in use) and ``reason`` (the system's words). An ``OSError``, as the bind's own error
    was, so that ``except OSError`` and errno checks written for it keep working."""

    _fields = ("address", "port", "code", "reason")

    address: str
    port: int
    code: int | None
    reason: str

    def __init__(self, message: str = "", **fields: Any) -> None:
        super().__init__(message, **fields)
        self.errno = self.code

    def _message(self) -> str:
        text = f"fastdist metrics cannot listen on {self.address}:{self.port}: {self.reason}"
        if self.code == errno.EADDRINUSE:
            text += (
                f" (port {self.port} is taken, by another job's metrics or another process: set "
                "FASTDIST_METRICS_PORT to a free port, or call serve_metrics(0) to have one picked)"
            )
        return text


# ---------------------------------------------------------------------------------------------
# The most recent faults, (time.monotonic(), error): torch re-wraps some errors on their way up
# (autograd) into a plain RuntimeError; a deadline scope gives back the typed one.

_recent: list[tuple[float, BaseException]] = []
_RECENT_KEPT = 8


def remember(err: BaseException) -> None:
    """Records a fault's error as raised to its waiters (a copy: the raised one gets a traceback,
    and with it the frames of the failed call, which would live on here)."""
    _recent.append((time.monotonic(), err))
    del _recent[:-_RECENT_KEPT]


def typed_error_for(exc: BaseException, since: float) -> BaseException | None:
    """The fastdist error behind ``exc`` (a RuntimeError torch made of it on its way up), if a
    fault was delivered since ``since`` (a time.monotonic() value)."""
    if isinstance(exc, FastdistError):
        return None
    for t, err in reversed(_recent):
        if t >= since and str(err) in str(exc):
            return copy.copy(err)
    for t, err in reversed(_recent):
        if t >= since:
            return copy.copy(err)
    return None
