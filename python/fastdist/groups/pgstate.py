"""Process groups as fastdist sees them: resolving ``group=``, and the one record of each group
(:class:`GroupState`: its name, ranks, the store used for diagnostics, its GroupCtl with the op
numbers, history and dead state kept in C++, its recoveries, and its :class:`Lineage`, the part
that outlives a rebuild), and the record of groups that died.

A group whose collective timed out is dead: gloo closes its connections, and any later op on it
fails or hangs. fastdist remembers that and refuses every later call on it at once with
:class:`GroupAbortedError`. A dead group is also kept alive on purpose while its timed-out op is
still in flight: dropping the last reference to a gloo group with an op in flight blocks the
dropping thread in its destructor until the op ends, and that must never be a user's thread.
Once the op has ended, :func:`release_finished` lets the group go, so threads and sockets do not
pile up over many timeout/recover cycles.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _Backend

_world = dist.distributed_c10d._world

from .._native import _watched, hand_engine_over, watched_backends
from ..errors import GroupAbortedError, RecoveryError
from ..store import board, keys, ring
from . import native_report

logger = logging.getLogger(__name__)


# Backend names (as dist.get_backend() gives them) whose works complete their future at enqueue,
# so that completion must be polled (fastdist.groups.abort): NCCL. Another backend says so itself
# (stream_marker_of).
POLLED_BACKENDS = {"nccl"}


def stream_marker_of(backend: Any) -> Any | None:
    """The capsule by which a backend that is NCCL-like without being torch's ProcessGroupNCCL says
    so (csrc/watched/watched.h, ``StreamMarkerFn``: its ``_fastdist_stream_marker`` attribute), or
    None."""
    return getattr(backend, "_fastdist_stream_marker", None)


def backend_options(backend: Any) -> Any | None:
    """A backend's options (its ``options``), or None where it has none: from torch 2.14 the
    property raises for a backend without getBackendOptions()."""
    try:
        return getattr(backend, "options", None)
    except RuntimeError:
        return None


def _says_polled(pg: Any) -> bool:
    """Whether one of ``pg``'s backends is NCCL-like by its own word (a group torch made)."""
    for device in ("cpu", "cuda"):
        try:
            if stream_marker_of(pg._get_backend(torch.device(device))) is not None:
                return True
        except (RuntimeError, AttributeError, ValueError):
            continue
    return False


def backend_name(pg: Any) -> str:
    """``"gloo"``, ``"nccl"``, ...: the backend torch records for ``pg``, lower case."""
    try:
        return str(dist.get_backend(pg)).lower()
    except (RuntimeError, ValueError, AttributeError):
        name = getattr(pg, "name", None)
        return str(name() if callable(name) else name or "").lower()


class Lineage:
    """The part of a group's record that outlives one ProcessGroup object: a shrinking recovery
    makes a new group under the same name (the default group is "default" again), and its state
    goes on from the old one's. Shared by every :class:`GroupState` of the name."""

    __slots__ = ("generation", "gone", "pending", "posted", "rounds")

    def __init__(self) -> None:
        # How many times the group has been recovered in this process: a new state starts there.
        self.generation = 0
        # Global ranks, by generation, that closed their connections mid-op and did not answer
        # the report: a recovery allowed to shrink does not wait for them.
        self.gone: dict[int, set[int]] = {}
        # The statuses this process has posted to the group's boards (fastdist.store.board).
        self.posted = board.Posts()
        # This rank's (op count, optimizer updates) when a recovery began, kept until one
        # completes (fastdist.recovery.reconcile).
        self.pending: tuple[int, int] | None = None
        # The round in which each generation was agreed (0: the first), as this process saw it:
        # the keys of its failed rounds are deleted with the generation's.
        self.rounds: dict[int, int] = {}


class Turns:
    """Recoveries of one group in one process, one at a time: a thread that calls recover() while
    another thread's recovery of the group runs waits for it and shares its outcome (its group,
    or its error), rather than join the agreement a second time as the same rank."""

    __slots__ = ("cond", "finished", "outcome", "running", "waiting")

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.running = False
        self.finished = 0
        self.waiting = 0
        # Kept only while a thread waits for it: an error holds its frames, and they the groups.
        self.outcome: tuple[Any, BaseException | None] = (None, None)


class GroupState:
    """Everything fastdist tracks for one process group (held weakly: it dies with the group)."""

    __slots__ = (
        "__weakref__",
        "_generation",
        "backend",
        "began",
        "checks_seq",
        "ctl",
        "generation_lock",
        "global_ranks",
        "is_default",
        "lineage",
        "name",
        "op_base",
        "own",
        "owner",
        "polled",
        "rank",
        "reconciled",
        "ref",
        "retired",
        "size",
        "store",
        "turns",
        "watched",
    )

    def __init__(self, pg: Any) -> None:
        self.ref: Callable[[], Any] = weakref.ref(pg)
        self.name = name_of(pg)
        self.rank: int = pg.rank()
        self.size: int = pg.size()
        self.global_ranks: list[int] | None = _global_ranks(pg)
        # The store that diagnostics, checks and recovery use: the default store, which every
        # rank of every group shares. None for a hand-built backend outside any job.
        self.store: Any | None = _default_store() if self.global_ranks is not None else None
        self.backend = backend_name(pg)
        # NCCL-like: works must be polled for completion, and aborted at the deadline.
        self.watched = watched_backend(pg)
        self.polled = (
            self.watched.polled
            if self.watched is not None
            else self.backend in POLLED_BACKENDS or _says_polled(pg)
        )
        self.is_default = self.name == "default"
        # (self.watched: the watched backend (fastdist._watched) when the group is watched: it
        # numbers, bounds and reports every op itself.)
        # The group's op numbers, history and dead state, kept in C++ by the same rules for every
        # group: its watched backend's, or, for a group torch made, one of its own, which the
        # private WatchedBackends that fastdist's own ops on it go through share (``own``: one per
        # device type; torch's own calls on such a group stay unwatched).
        watched = self.watched
        self.own: dict[str, Any] = {}
        if watched is None:
            hand_engine_over()
            self.ctl: Any = _watched.GroupCtl(self.name, self.rank, self.size, self.polled)
            self.own = _own_backends(pg, self.ctl)
            _owners[self.ctl.id] = self.ref  # (state_of holds _lock)
        else:
            self.ctl = watched.ctl
        self._begin(_lineages.setdefault(self.name, Lineage()))  # (state_of holds _lock)

    def _begin(self, lineage: Lineage) -> None:
        """The part of the record that fastdist keeps, not torch's group."""
        self.lineage = lineage
        # Held while the generation changes, and by a peer's fault while it is applied: a fault
        # of the old generation read just before a recovery must not end the new one's ops.
        self.generation_lock = threading.RLock()
        self._generation = lineage.generation
        # When this generation began (time.time()): a death recorded before it is not news to it.
        self.began = time.time()
        # fastdist's cross-rank checks number a watched group's checked calls apart from its ops.
        self.checks_seq = 0
        # The thread in a blocking fastdist call on the group, if any (see collectives).
        self.owner: int | None = None
        # Its recoveries (fastdist.recovery): one at a time; the op count its members' state was
        # at when its numbering last started afresh; what the last one found (a Reconciliation).
        self.turns = Turns()
        self.op_base = 0
        self.reconciled: Any = None
        # Replaced by a new group in a shrinking recovery: never rebuilt in place again.
        self.retired = False
        _generation_began(self)

    @property
    def generation(self) -> int:
        """The group's generation: 0, then one more for each recovery that rebuilt it."""
        return self._generation

    @generation.setter
    def generation(self, value: int) -> None:
        with self.generation_lock:
            self._generation = value
            self.began = time.time()
        _generation_began(self)

    def begin(self, op: str) -> int:
        """Numbers the next op on this group (1, 2, ...): the same on every rank in step."""
        return int(self.ctl.begin(op))

    def prev_op_of(self, seq: int) -> str | None:
        """``"op #n"`` for the op issued just before ``seq``: the last one that every rank
        reached, when ``seq`` is the one that hung."""
        prev: str | None = self.ctl.prev_of(seq)
        return prev

    @property
    def dead_reason(self) -> str | None:
        """Why the group is dead, in fastdist's words (None: alive, or only C++'s own first
        reason so far, which a fault's report replaces; see :func:`mark_dead`)."""
        reason: str | None = self.ctl.settled_reason
        return reason

    def ctls(self) -> list[Any]:
        """Every GroupCtl of the group: one per watched backend (a group with a CPU and a CUDA
        backend has two), or its own."""
        pg = self.ref()
        if self.watched is None or pg is None:
            return [self.ctl]
        return [b.ctl for b in watched_backends(pg)]

    def history(self) -> list[dict[str, Any]]:
        """The op history of every GroupCtl of the group, by op number (fastdist.history)."""
        out: list[dict[str, Any]] = []
        for ctl in self.ctls():
            out.extend(ctl.history())
        return sorted(out, key=lambda r: int(r["seq"]))

    def mark_dead(
        self, reason: str, abandoned: Any | None = None, level: int = logging.WARNING, replace: bool = False
    ) -> None:
        """Records that the group is aborted. ``abandoned``: the token of its op still in flight,
        whose end releases the group (see :func:`release_finished`). ``replace``: a better reason
        than the first one recorded (logged only if it is the first)."""
        first = False
        for ctl in self.ctls():
            first = ctl.settle_dead(reason, replace) or first
        pg = self.ref()
        if abandoned is not None and pg is not None:
            with _lock:
                _held.setdefault(id(pg), (pg, []))[1].append(abandoned)
        if first:
            logger.log(level, "rank %d: group %r is aborted: %s", self.my_global_rank, self.name, reason)

    def presume_gone(self, ranks: list[int]) -> None:
        """``ranks`` (global) closed their connections mid-op and did not answer the report."""
        with _lock:
            gone = self.lineage.gone.setdefault(self.generation, set())
            gone.update(r for r in ranks if r != self.my_global_rank)

    def gone(self) -> set[int]:
        """The ranks of the current generation presumed gone (see presume_gone)."""
        with _lock:
            kept = self.lineage.gone
            for gen in [g for g in kept if g < self.generation]:
                del kept[gen]
            return set(kept.get(self.generation, ()))

    def aborted(self, op: str, reason: str | None = None) -> GroupAbortedError:
        """The error of ``op`` on this group, on this rank, ended with the group dead for
        ``reason`` (default: why the group is dead)."""
        why = reason or self.dead_reason or "aborted"
        return GroupAbortedError(op=op, group=self.name, rank=self.my_global_rank, reason=why)

    def recovery_error(
        self, generation: int, reason: str, missing: list[int] | None = None, retryable: bool = False
    ) -> RecoveryError:
        """The error of recovering this group as ``generation`` on this rank (``retryable``: a
        fault in the hand-over failed it: see RecoveryError)."""
        return RecoveryError(
            group=self.name,
            rank=self.my_global_rank,
            generation=generation,
            reason=reason,
            missing_ranks=missing,
            retryable=retryable,
        )

    def global_rank(self, group_rank: int) -> int:
        """The global rank of the group's rank ``group_rank`` (the same number when the group's
        global ranks are unknown: a backend outside any job)."""
        return self.global_ranks[group_rank] if self.global_ranks is not None else group_rank

    @property
    def my_global_rank(self) -> int:
        """This rank's global rank."""
        return self.global_rank(self.rank)

    def own_backend(self, args: tuple[Any, ...]) -> Any:
        """The private WatchedBackend of a group torch made for an op on ``args``: the one of the
        first tensor's device type (a group with one backend: that one)."""
        own = self.own
        if len(own) != 1:
            for a in args:
                t = a[0] if isinstance(a, (list, tuple)) and a else a
                if isinstance(t, torch.Tensor) and t.device.type in own:
                    return own[t.device.type]
        if not own:
            raise TypeError(f"group {self.name!r} has no backend fastdist can issue its ops on")
        return next(iter(own.values()))

    def ring_children(self, root: int, dead: frozenset[int] = frozenset()) -> list[int]:
        """This rank's children in the ring tree rooted at group rank ``root`` (see
        fastdist.store.ring), as global ranks; a child in ``dead`` (global ranks known dead) is
        skipped for its own children, so that its subtree is still rung."""
        return ring.children(self.rank, root, self.size, self.global_ranks, dead)

    def reporting_backends(self) -> list[Any]:
        """The backends that report this rank's timeouts in C++ (see native_report): the watched
        ones, or for a group torch made, fastdist's private ones."""
        pg = self.ref()
        if pg is None:
            return []
        return list(self.own.values()) if self.watched is None else watched_backends(pg)

    def waits(self) -> list[list[int]]:
        """This rank's last completed ops on the group as ``[seq, microseconds from issue to end]``
        pairs, from the watched backend's history ring: the straggler hint of a status record
        (fastdist.store.board.straggler)."""
        try:
            done = [r for r in self.history() if r["outcome"] == "ok" and r["end"] is not None]
            return [
                [int(r["seq"]), round((float(r["end"]) - float(r["start"])) * 1e6)]
                for r in done[-WAITS_KEPT:]
            ]
        except Exception as exc:  # noqa: BLE001 - a hint must never cost the report itself
            logger.debug("fastdist: no waits for the straggler hint: %r", exc)
            return []

    def seat(self, dead: frozenset[int] = frozenset()) -> board.Seat:
        """This rank's place on the group's board, now (fastdist.store.board): the generation,
        the ranks, the ring children (``dead``: global ranks known dead, rung past) and the waits
        of the status it posts."""
        return board.Seat(
            store=self.store,
            group=self.name,
            generation=self.generation,
            rank=self.rank,
            size=self.size,
            global_ranks=self.global_ranks,
            posted=self.lineage.posted,
            backends=self.reporting_backends(),
            children=self.ring_children(self.rank, dead),
            dead=dead,
            waits=self.waits(),
        )


# How many of a rank's last completed ops its status carries (as [seq, microseconds waited]),
# for the straggler hint: 16 pairs are about 200 bytes.
WAITS_KEPT = 16


def set_owner(ctl_id: int, pg: Any) -> None:
    """``pg``'s backends share the GroupCtl ``ctl_id`` (a watched backend's:
    fastdist.groups.registry.enroll). (One dict store: no lock, so that no lock order binds the
    registry's lock to this module's.)"""
    _owners[ctl_id] = weakref.ref(pg)


def owner_of(ctl_id: int) -> Any | None:
    """The live group whose backends share the GroupCtl ``ctl_id``, or None: the one answer to
    "which group owns this ctl" (a watched group's, or a group torch made, whose own ctl the
    private backends of fastdist's own ops on it share)."""
    ref = _owners.get(ctl_id)
    return None if ref is None else ref()


def _own_backends(pg: Any, ctl: Any) -> dict[str, Any]:
    """A WatchedBackend around each of ``pg``'s own backends (one per device type), sharing
    ``ctl``; a raw backend passed as ``group=`` gets one around itself."""
    if isinstance(pg, _Backend):
        return {"": _watched.WatchedBackend(pg, ctl, stream_marker_of(pg))}
    try:
        types = list(pg._device_types) or [torch.device("cpu")]
    except (AttributeError, RuntimeError):
        return {}
    out: dict[str, Any] = {}
    for device in types:
        if device.type in out:
            continue
        try:
            backend = pg._get_backend(device)
            out[device.type] = _watched.WatchedBackend(backend, ctl, stream_marker_of(backend))
        except (RuntimeError, TypeError) as exc:  # no backend for it, or one C++ cannot hold
            logger.debug("fastdist: group %r: no private backend for %s: %r", ctl.id, device, exc)
    return out


def _generation_began(st: GroupState) -> None:
    """A group's state was made, or its generation changed: its watched backends' native report
    (or its private ones', for a group torch made) gets this generation's keys."""
    if st.size <= 1:
        return
    backends = st.reporting_backends()
    if not backends:
        return
    inboxes = [keys.inbox(child) for child in st.ring_children(st.rank)]
    try:
        native_report.arm(backends, st.store, st.name, st.generation, st.rank, st.my_global_rank, inboxes)
    except Exception as exc:  # noqa: BLE001 - the report's arming must not fail the group
        logger.warning("fastdist: arming the native report failed on group %r: %r", st.name, exc)


_lock = threading.Lock()
_states: dict[int, GroupState] = {}
# Each group name's lineage (see Lineage).
_lineages: dict[str, Lineage] = {}
# GroupCtl id -> the group (weakly) whose backends share it (owner_of). A ctl id is the C++
# object's address: a freed one's address again replaces its entry.
_owners: dict[int, Any] = {}
# Dead groups held until their in-flight op ends: id -> (group, tokens of abandoned work).
_held: dict[int, tuple[Any, list[Any]]] = {}


def resolve(group: Any) -> Any | None:
    """The ProcessGroup for ``group=`` (``None`` = the default group), or ``None`` when this
    process is not a member of it. Raises for anything that is not a group."""
    if group is None:
        pg = _world.default_pg
        if pg is not None:
            return pg
        if not dist.is_initialized():
            raise RuntimeError(
                "the default process group is not initialized: call "
                "fastdist.init_process_group() (or torch.distributed.init_process_group()) first, "
                "or pass group="
            )
        return dist.distributed_c10d._get_default_group()
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return None
    # A raw backend (e.g. a ProcessGroupGloo built by hand) has the same per-call API.
    if not isinstance(group, (dist.ProcessGroup, _Backend)):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}: {group!r}"
        )
    return group


def state_of(pg: Any) -> GroupState:
    """The state of ``pg``, created on first use."""
    st = _states.get(id(pg))
    if st is not None and st.ref() is pg:
        return st
    with _lock:
        # Two threads may both have missed: the second one uses the state the first one made.
        st = _states.get(id(pg))
        if st is not None and st.ref() is pg:
            return st
        st = GroupState(pg)
        _states[id(pg)] = st
        key = id(pg)
        weakref.finalize(pg, _forget, key, weakref.ref(st))
    return st


def peek(pg: Any) -> GroupState | None:
    """The state of ``pg`` if it has one already (none is made)."""
    st = _states.get(id(pg))
    return st if st is not None and st.ref() is pg else None


def _forget(key: int, st_ref: Any) -> None:
    with _lock:
        if _states.get(key) is st_ref():
            del _states[key]


def name_of(pg: Any) -> str:
    """``"default"`` for the default group, else the group's torch name."""
    if dist.is_initialized() and pg is dist.distributed_c10d._get_default_group():
        return "default"
    name = getattr(pg, "group_name", None)
    if not name:
        name = (
            dist.distributed_c10d._world.pg_names.get(pg, None) if isinstance(pg, dist.ProcessGroup) else None
        )
    return str(name or f"backend-{id(pg):x}")


def watched_backend(pg: Any) -> Any | None:
    """The (first) WatchedBackend registered in ``pg`` (fastdist._watched), or None: a group
    fastdist does not watch."""
    backends = watched_backends(pg)
    return backends[0] if backends else None


def _global_ranks(pg: Any) -> list[int] | None:
    if not isinstance(pg, dist.ProcessGroup) or not dist.is_initialized():
        return None
    try:
        return list(dist.get_process_group_ranks(pg))
    except (RuntimeError, ValueError, KeyError):
        return None


def known_groups() -> Any:
    """The groups torch has finished making (it records their ranks last)."""
    return _world.pg_group_ranks


def _default_store() -> Any | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def check_alive(st: GroupState, op: str) -> None:
    """Raises GroupAbortedError at once if the group died earlier."""
    if st.dead_reason is not None:
        raise st.aborted(op)


def hold(pg: Any) -> None:
    """Keeps ``pg`` alive until its abandoned ops (if any) have ended; see release_finished."""
    with _lock:
        _held.setdefault(id(pg), (pg, []))


def release_finished() -> int:
    """Drops fastdist's references to dead groups whose in-flight ops have all ended, so their
    destructors (run here, quickly: the backend's threads are idle) free threads and sockets.
    Returns how many are still held."""
    with _lock:
        done = [key for key, (_pg, tokens) in _held.items() if all(t.work_done for t in tokens)]
        released = [_held.pop(key) for key in done]
    del released  # destructors run here, outside the lock
    return len(_held)


def is_dead(group: Any = None) -> bool:
    """Whether fastdist considers ``group`` (default: the default group) aborted."""
    pg = resolve(group)
    if pg is None:
        return False
    return any(ctl.dead for ctl in state_of(pg).ctls())


def revive(st: GroupState) -> None:
    """Records that the group of ``st`` works again (recovery rebuilt it in place; a watched
    backend's swap_inner revives its own)."""
    if st.watched is None:
        st.ctl.revive()


def set_generation(name: str, generation: int) -> None:
    """The generation the next state of group ``name`` starts at (a process that joined by a
    growth takes the live ranks')."""
    with _lock:
        _lineages.setdefault(name, Lineage()).generation = generation


def next_generation(name: str) -> int:
    """Counts one more generation of group ``name`` in this process (a recovery used one up), and
    returns it: the generation the group's next state starts at."""
    with _lock:
        lineage = _lineages.setdefault(name, Lineage())
        lineage.generation += 1
        return lineage.generation
