"""Timeout-bounded collectives.

Each wrapper takes the same arguments as its ``torch.distributed`` namesake plus ``timeout=``,
and either returns what torch returns or raises :class:`CollectiveTimeoutError` by the deadline.
The deadline is enforced twice: by fastdist's engine, which wakes the caller at the deadline,
and by the backend's own per-call timeout (set a little later), which frees gloo's worker thread
so that the dead group never holds a thread or blocks process exit for long.
"""

from __future__ import annotations

import datetime
import math
from typing import Any, Callable, Optional

import torch
from torch.distributed.distributed_c10d import AllgatherOptions, BarrierOptions

from . import _groups
from ._timeouts import TimeoutLike, current_time, effective_deadline, run_timeout_handler
from ._work import wait_until
from .errors import CollectiveTimeoutError, GroupAbortedError

__all__ = ["barrier", "all_gather"]

# What gloo says when its own per-call timeout fires, and when a peer closed the group.
_BACKEND_TIMEOUT_MARKERS = ("Timed out", "timed out", "Timeout")
_PEER_CLOSED_MARKERS = ("Connection closed by peer", "Connection reset by peer", "pair closure", "Broken pipe")


def backend_grace(budget: float) -> float:
    """How long after fastdist's deadline the backend's own timeout fires.

    fastdist's engine must see the deadline first, on every rank, so that each waiting rank
    raises CollectiveTimeoutError rather than the connection error a peer's backend timeout
    would cause; the grace absorbs the skew between ranks' deadlines. It is also the longest a
    dead group's worker thread stays busy after the deadline (and so the longest process exit
    can wait on it), hence the cap.
    """
    return min(1.0, max(0.1, 0.1 * budget))


# Options objects are copied by the backend when an op is issued, so one object per distinct
# backend timeout can be shared by every call. Timeouts are rounded up to 10 ms so that calls
# with the same timeout= share one; the cache is bounded.
_OPTIONS_STEP_MS = 10
_options_cache: dict[tuple[type, int], Any] = {}


def _options(kind: type, deadline: float, now: float) -> Any:
    """A ``kind`` (e.g. ``AllgatherOptions``) whose timeout makes the backend give up
    ``backend_grace`` after ``deadline``; for no deadline, the group's own default applies."""
    if deadline == math.inf:
        key = -1
    else:
        budget = max(0.0, deadline - now)
        key = math.ceil((budget + backend_grace(budget)) * 1000 / _OPTIONS_STEP_MS)
    opts = _options_cache.get((kind, key))
    if opts is None:
        opts = kind()
        if key >= 0:
            opts.timeout = datetime.timedelta(milliseconds=key * _OPTIONS_STEP_MS)
        if len(_options_cache) < 1024:
            _options_cache[(kind, key)] = opts
    return opts


def _run(
    op: str,
    pg: Any,
    start: float,
    deadline: float,
    issue: Callable[[Any], Any],
    options: type,
) -> bool:
    """Issues one collective through ``issue(options)`` and waits for it until
    ``deadline``. Returns True on success; on timeout marks the group dead, runs the timeout
    handler and raises (the caller turns that into ``False`` when asked to)."""
    now = current_time()
    if now >= deadline:
        # Nothing was issued, so the group is still consistent here: do not mark it dead.
        _raise_timeout(op, pg, start, deadline, now, cause="the deadline had passed before the call")
    work = issue(_options(options, deadline, now))
    try:
        finished = wait_until(work, deadline)
    except BaseException:
        # Interrupted (Ctrl-C): the op is still in flight and this rank no longer in step.
        _groups.mark_dead(pg, f"{op} was interrupted on rank {pg.rank()}")
        raise
    if finished:
        try:
            work.wait()
            return True
        except RuntimeError as exc:
            _raise_backend_error(op, pg, start, deadline, exc)
    _groups.mark_dead(pg, f"{op} timed out on rank {pg.rank()}")
    _raise_timeout(op, pg, start, deadline, current_time())
    raise AssertionError("unreachable")


def _raise_timeout(op: str, pg: Any, start: float, deadline: float, now: float, cause: Optional[str] = None) -> None:
    error = CollectiveTimeoutError(
        op=op,
        rank=pg.rank(),
        world_size=pg.size(),
        group=_groups.name_of(pg),
        timeout=deadline - start,
        elapsed=now - start,
        missing_ranks=None,
        cause=cause,
    )
    run_timeout_handler(error)
    raise error


def _raise_backend_error(op: str, pg: Any, start: float, deadline: float, exc: RuntimeError) -> None:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if any(m in text for m in _BACKEND_TIMEOUT_MARKERS):
        # The backend's timeout beat the engine (possible on a loaded machine): same outcome.
        _groups.mark_dead(pg, f"{op} timed out on rank {pg.rank()}")
        try:
            _raise_timeout(op, pg, start, deadline, current_time(), cause=text)
        except CollectiveTimeoutError as error:
            raise error from exc
    if any(m in text for m in _PEER_CLOSED_MARKERS):
        reason = f"a peer closed its connection during {op} (it timed out or exited): {text}"
        _groups.mark_dead(pg, reason)
        raise GroupAbortedError(op=op, group=_groups.name_of(pg), rank=pg.rank(), reason=reason) from exc
    raise exc


def _check_bool(value: object, name: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}: {value!r}")


def _check_tensor(value: object, name: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _check_tensor_list(value: object, name: str) -> None:
    if not isinstance(value, list) or not all(isinstance(t, torch.Tensor) for t in value):
        raise TypeError(f"{name} must be a list of torch.Tensor, got {type(value).__name__}")


# ---------------------------------------------------------------------------------------------


def barrier(group: Any = None, *, timeout: TimeoutLike = None, raise_on_timeout: bool = True) -> bool:
    """Waits until every rank of ``group`` (default: the default group) called ``barrier``.

    Returns True once all arrived. At the deadline raises :class:`CollectiveTimeoutError` on
    every rank that waited, or returns False when ``raise_on_timeout=False``::

        if not fastdist.barrier(timeout=10, raise_on_timeout=False):
            ...  # someone is missing; the group is now aborted

    ``timeout``: seconds, a ``timedelta``, ``math.inf``, a :class:`RendezvousTimeout` or an open
    scope; ``None`` means :func:`get_default_timeout`. After a timeout the group is aborted and
    every later fastdist call on it raises :class:`GroupAbortedError` at once.
    """
    start = current_time()
    deadline = effective_deadline(timeout, start)
    _check_bool(raise_on_timeout, "raise_on_timeout")
    pg = _groups.resolve(group)
    if pg is None:
        return True
    _groups.check_alive(pg, "barrier")

    if raise_on_timeout:
        return _run("barrier", pg, start, deadline, pg.barrier, BarrierOptions)
    try:
        return _run("barrier", pg, start, deadline, pg.barrier, BarrierOptions)
    except CollectiveTimeoutError:
        return False


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: Any = None,
    *,
    timeout: TimeoutLike = None,
) -> None:
    """``torch.distributed.all_gather`` with a deadline: fills ``tensor_list`` (one tensor per
    rank, in rank order) with every rank's ``tensor``, or raises
    :class:`CollectiveTimeoutError` at the deadline.

    After a timeout the tensors in ``tensor_list`` may still be written by the backend until
    its own timeout fires, :func:`backend_grace` later; do not reuse them before that.
    """
    start = current_time()
    deadline = effective_deadline(timeout, start)
    _check_tensor_list(tensor_list, "tensor_list")
    _check_tensor(tensor, "tensor")
    pg = _groups.resolve(group)
    if pg is None:
        return None
    _groups.check_alive(pg, "all_gather")
    if len(tensor_list) != pg.size():
        raise ValueError(
            f"tensor_list must hold one tensor per rank of the group ({pg.size()}), got {len(tensor_list)}"
        )
    dtype = tensor.dtype
    for t in tensor_list:
        if t.dtype != dtype:
            raise ValueError(f"tensor_list must hold tensors of tensor's dtype ({dtype}), got {t.dtype}")
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
        tensor_list = [torch.view_as_real(t) for t in tensor_list]

    def issue(opts: Any) -> Any:
        return pg.allgather([tensor_list], [tensor], opts)

    _run("all_gather", pg, start, deadline, issue, AllgatherOptions)
    return None
