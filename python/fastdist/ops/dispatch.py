"""Where fastdist's own functions issue their op: one path for every group.

A public function (fastdist.collectives) checks its arguments, computes its deadline and hands an
``issue(pg, options, *args)`` function to :func:`run`. On a watched group (every group made by or after
``fastdist.init_process_group``) that is thin: the deadline, torch's op on the group, then the
wait; the watched backend (fastdist._watched, chosen per group when the group was made: a future's
completion, a polled completion query for NCCL, or a posted op with no future for gloo's
send/recv) numbers, bounds and reports the op. A group torch made (before or without
``fastdist.init_process_group``, or a raw backend) takes the same path through a private
WatchedBackend around its own backend: one op path.
"""

from __future__ import annotations

import datetime
import math
import threading
from typing import Any, Callable, NoReturn

import torch.distributed as dist

from .._native import _core, _watched
from ..deadlines import TimeoutLike, current_time, effective_deadline
from ..errors import FastdistError
from ..groups import checks, pgstate
from ..settings import SETTINGS
from . import watching
from .work import NO_TIMEOUT, Work, backend_options, options_cache

_world = dist.distributed_c10d._world
_ProcessGroup = dist.ProcessGroup
_monotonic = _core.monotonic
_get_ident = threading.get_ident
_WAIT_RAN_OUT = "Operation timed out!"
_set_next_deadline = _watched.set_next_deadline
_clear_next_deadline = _watched.clear_next_deadline


def run(
    op: str,
    group: Any,
    start: float,
    deadline: float,
    issue: Callable[..., Any],
    args: tuple[Any, ...],
    kind: type | None,
    signature: Callable[..., str],
    async_op: bool = False,
    fields: tuple[tuple[str, Any], ...] = (),
) -> Any:
    """Issues one op through ``issue(pg, options, *args)`` and waits for it until ``deadline``
    (or returns a :class:`~fastdist.Work` for ``async_op``). Returns what ``issue``'s work
    produced, or None for a process that is not in the group. ``kind``: the op's options class
    (its per-call timeout and ``fields`` are set here), or None when ``issue`` builds its own.
    ``signature(*args)``: the call's arguments as text, for the cross-rank checks."""
    # Every collective's hot path: few Python calls and no objects made per call (``issue`` and
    # ``signature`` are module-level functions). Each microsecond of Python before the op costs
    # several in a collective's latency when ranks share cores (measured: 1.2 us of Python
    # before each 2-rank all_reduce made it 5-8 us slower).
    if group is None:
        pg = _world.default_pg
    elif type(group) is _ProcessGroup:
        pg = group
    else:
        pg = pgstate.resolve(group)  # checks what group= is
    if pg is None:
        if group is None:
            pgstate.resolve(None)  # raises: the default group is not initialized
        return None
    st = pgstate.state_of(pg)
    # The deadline, the op, then the wait. The watched backend numbers the op, enforces the
    # deadline, gives gloo its per-call timeout, and raises the typed error (with the report)
    # from the wait; see fastdist.ops.watching and fastdist.ops.fault. On a watched group the op
    # goes through torch's ProcessGroup to it; on a group torch made, to the private
    # WatchedBackend around the group's own backend (torch's own calls there stay unwatched).
    if st.watched is None:
        target = st.own_backend(args)
        watching.install()
    else:
        target = pg
    if SETTINGS.checks:
        # Checked calls are numbered apart from the backend's ops: a call refused for a mismatch
        # issues no op, on every rank.
        st.checks_seq += 1
        if not checks.verify(st, op, st.checks_seq, f"{op}({signature(*args)})", deadline):
            deadline = min(deadline, _monotonic())  # the backend reports the timeout, with the report
    me = _get_ident()
    owner = st.owner
    if owner is not None and owner != me and not async_op:
        _concurrent_use(st, op, owner, me)
    opts = None
    if kind is not None:
        try:
            opts = options_cache[kind, NO_TIMEOUT, fields]
        except (KeyError, TypeError):  # not made yet, or a field that cannot be hashed
            opts = backend_options(kind, math.inf, 0.0, fields)
    _set_next_deadline(deadline, start)
    try:
        work = issue(target, opts, *args)
    finally:
        _clear_next_deadline()  # an issue that failed before reaching the backend
    if async_op:
        return WatchedHandle(op, work, deadline)
    st.owner = me
    try:
        work.wait()
    except BaseException:
        # The error's traceback holds this frame: it must not hold the op too (see _fail).
        work = None
        raise
    finally:
        st.owner = None
    return work


def _concurrent_use(st: pgstate.GroupState, op: str, owner: int, me: int) -> NoReturn:
    # Two threads in blocking calls on one group at once interleave their ops differently on
    # each rank: gloo then pairs the wrong ops and the results are silently wrong (or the process
    # aborts). Collectives torch issues on its own threads (autograd, DDP, FSDP2) do not come here.
    names = {t.ident: t.name for t in threading.enumerate()}
    raise RuntimeError(
        f"{op} on group {st.name!r}: thread {names.get(me, me)!r} called it while thread "
        f"{names.get(owner, owner)!r} is still in a blocking fastdist call on the same group; "
        "ops on one group must come from one thread at a time, in the same order on every rank "
        "(use one group per thread)"
    )


class WatchedHandle(Work):
    """fastdist's handle for an op issued with ``async_op=True`` on a watched group: the op's
    deadline was fixed at issue, and the op is watched whether or not anyone waits. ``wait()``
    returns True once the op is done, or raises :class:`CollectiveTimeoutError` (or
    :class:`GroupAbortedError`) at that deadline; ``wait(timeout)`` waits at most ``timeout`` more
    seconds and raises a plain :class:`TimeoutError` if that ends first (the op is still watched)."""

    __slots__ = ("_deadline", "_work", "op")

    def __init__(self, op: str, work: Any, deadline: float) -> None:
        self.op = op
        self._work = work
        self._deadline = deadline

    @property
    def deadline(self) -> float:
        """The op's absolute deadline on :func:`fastdist.current_time`'s clock."""
        return self._deadline

    def wait(self, timeout: TimeoutLike = None) -> bool:
        """True once the op is done; raises its error (a timeout included) at the op's deadline.
        With ``timeout`` (seconds, a ``timedelta`` or a deadline object), waits at most that long,
        and raises a plain :class:`TimeoutError` if it ends before the op's deadline (the op is
        still watched)."""
        if timeout is None:
            return bool(self._work.wait())
        now = current_time()
        limit = min(self._deadline, effective_deadline(timeout, now))
        if limit >= self._deadline:
            return bool(self._work.wait())
        try:
            return bool(self._work.wait(datetime.timedelta(seconds=max(0.001, limit - now))))
        except RuntimeError as exc:
            # The watched work's bounded wait ran out (its own words, in csrc/watched/work.cpp); the op's
            # own errors are fastdist's typed ones.
            if isinstance(exc, FastdistError) or _WAIT_RAN_OUT not in str(exc):
                raise
        raise self._gave_up(None, limit - now)

    def is_completed(self) -> bool:
        """True once the op finished, successfully or not (its deadline passing included)."""
        return bool(self._work.is_completed())

    def exception(self) -> BaseException | None:
        """The error the op ended with (a timeout included), or None; None while in flight."""
        if not self._work.is_completed():
            return None
        try:
            self._work.wait()
        except BaseException as exc:  # noqa: BLE001 - the op's own error, returned
            return exc
        return None

    def get_future(self) -> Any:
        """The underlying work's ``torch.futures.Future``."""
        return self._work.get_future()

    def _source_rank(self) -> int:
        return int(self._work._source_rank())

    def __repr__(self) -> str:
        state = "completed" if self._work.is_completed() else "pending"
        return (
            f"<fastdist.WatchedHandle {self.op} {state}, deadline in {self._deadline - current_time():.3f} s>"
        )
