"""Timeouts and deadlines: validation, the default timeout, deadline scopes, RendezvousTimeout.

A relative ``timeout=`` (seconds or a ``timedelta``) becomes an absolute deadline once, when a
call starts; from then on only deadlines are compared. ``math.inf`` means no deadline. Deadline
objects (an open :func:`fail_after` / :func:`fail_at` scope, a :class:`RendezvousTimeout`) let
several calls share one deadline. The effective deadline of a call is the sooner of its own and
that of every enclosing scope.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import logging
import math
import numbers
import os
import sys
import threading
import time
import types
import warnings
from typing import Any, Callable, Union

from torch.distributed import distributed_c10d as _c10d

from ._native import _core, _watched, watched_backends
from .errors import typed_error_for
from .settings import SETTINGS

__all__ = [
    "DeadlineScope",
    "RendezvousTimeout",
    "TimeoutLike",
    "current_time",
    "fail_after",
    "fail_at",
    "get_default_timeout",
    "get_timeout_handler",
    "set_default_timeout",
    "set_timeout_handler",
]

_DEFAULT_TIMEOUT_FALLBACK = 600.0


def current_time() -> float:
    """Seconds on fastdist's monotonic clock, the clock every deadline is expressed in."""
    return _core.monotonic()


# ---------------------------------------------------------------------------------------------
# The engine, created on first use so that `import fastdist` starts no thread.

_engine_lock = threading.Lock()
_engine: _core.Engine | None = None


def engine() -> _core.Engine:
    global _engine
    eng = _engine
    if eng is None:
        with _engine_lock:
            if _engine is None:
                _engine = _core.default_engine()
            eng = _engine
    return eng


def flush_engine(seconds: float) -> None:
    """At exit: runs the engine's actions due by now, bounded by ``seconds`` (an action that runs
    while the interpreter finalizes is killed inside C++ when it needs the GIL)."""
    if _engine is not None:
        _engine.flush(seconds)


# ---------------------------------------------------------------------------------------------
# Validation


def _check_seconds(value: float, name: str) -> float:
    if math.isnan(value):
        raise ValueError(f"{name} must not be NaN, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return float(value)


def is_real(value: object) -> bool:
    """Any real number (numpy's too), not a bool."""
    kind = type(value)
    if kind is float or kind is int:
        return True
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _as_float(value: Any) -> float:
    """``float(value)``; an integer too large for a float is infinitely far (no deadline)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def validate_seconds(value: object, name: str = "timeout", *, deadline_objects: bool = False) -> float:
    """A relative timeout in seconds (any real number or a timedelta, ``math.inf`` allowed), or an
    error naming the argument and the value."""
    if isinstance(value, datetime.timedelta):
        return _check_seconds(value.total_seconds(), name)
    if not is_real(value):
        kinds = "a number of seconds, a datetime.timedelta, math.inf"
        kinds += ", a RendezvousTimeout or an open fail_after/fail_at scope" if deadline_objects else ""
        raise TypeError(f"{name} must be {kinds}; got {type(value).__name__}: {value!r}")
    return _check_seconds(_as_float(value), name)


# ---------------------------------------------------------------------------------------------
# Default timeout


def set_default_timeout(timeout: float | datetime.timedelta | None) -> None:
    """Sets the timeout used when a call gets ``timeout=None``. ``None`` restores the default:
    ``FASTDIST_TIMEOUT`` (seconds) from the environment, else 600 s."""
    SETTINGS.default_timeout = None if timeout is None else validate_seconds(timeout, "timeout")


def get_default_timeout() -> float:
    """The timeout in seconds that ``timeout=None`` stands for."""
    if SETTINGS.default_timeout is not None:
        return SETTINGS.default_timeout
    env = os.environ.get("FASTDIST_TIMEOUT")
    if env is None or env.strip() == "":
        return _DEFAULT_TIMEOUT_FALLBACK
    try:
        value = float(env)
    except ValueError:
        raise ValueError(f"FASTDIST_TIMEOUT must be a number of seconds, got {env!r}") from None
    return _check_seconds(value, "FASTDIST_TIMEOUT")


# ---------------------------------------------------------------------------------------------
# Deadline scopes

# The sooner of every enclosing scope's deadline; math.inf outside any scope. A ContextVar, so
# that each thread (and each asyncio task) sees only the scopes it entered.
_scope_deadline: contextvars.ContextVar[float] = contextvars.ContextVar(
    "fastdist_scope_deadline", default=math.inf
)


class DeadlineScope:
    """An open :func:`fail_after` / :func:`fail_at` scope. Passing it as ``timeout=`` makes a call
    use the scope's deadline (useful in a thread the scope does not cover)."""

    __slots__ = ("deadline",)

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def remaining(self) -> float:
        """Seconds until the deadline, 0 once it passed."""
        return max(0.0, self.deadline - current_time())

    def _fastdist_deadline(self) -> float:
        return self.deadline

    def __repr__(self) -> str:
        if math.isinf(self.deadline):
            return "DeadlineScope(no deadline)"
        return f"DeadlineScope(deadline={self.deadline:.3f}, remaining={self.remaining():.3f} s)"


# Whether the default group has been looked at by a scope: once, when the first scope opens after
# torch.distributed is initialized (one global read per scope after that).
_default_group_checked = False


def _check_default_group() -> None:
    """Warns once when a deadline scope opens while the default group is one fastdist does not
    watch (made by torch.distributed.init_process_group, as a framework does when fastdist is not
    told): the ops torch issues on it would have no deadline, silently. Called by a scope's
    entry once a default group exists."""
    global _default_group_checked
    import torch.distributed as dist

    _default_group_checked = True
    pg = dist.group.WORLD
    if pg is not None and not watched_backends(pg):
        # Point at the user's `with` line: the first frame outside this module.
        level, frame = 1, sys._getframe(0)  # type: int, types.FrameType | None
        while frame is not None and frame.f_code.co_filename == __file__:
            level, frame = level + 1, frame.f_back
        warnings.warn(
            "fastdist: this deadline scope cannot bound the ops torch issues on the default group (DDP's, "
            "FSDP's, torch.distributed.*): it was made by torch.distributed.init_process_group, not "
            "fastdist.init_process_group. Make it with fastdist.init_process_group before your framework "
            "makes one (Lightning: strategy=fastdist.lightning.DDPStrategy(); Accelerate: "
            "fastdist.accelerate.init_process_group() before Accelerator()). fastdist's own calls are "
            "still bounded.",
            RuntimeWarning,
            stacklevel=level,
        )


class _Scope(DeadlineScope):
    """An open fail_after / fail_at scope: a context manager that is its own DeadlineScope. A class
    rather than a generator: entering and leaving it is on every training step's path."""

    __slots__ = ("_reset", "_since", "_thread")

    def __enter__(self) -> DeadlineScope:
        if not _default_group_checked and _c10d.GroupMember.WORLD is not None:
            _check_default_group()
        self._thread = _get_ident()
        outer = _scope_deadline.get()
        self.deadline = min(self.deadline, outer)
        self._reset = _scope_deadline.set(self.deadline)
        # The C++ side of watched groups reads the scope from the thread (and, for threads that
        # never ran Python, such as autograd's device threads, from the soonest scope open in the
        # process).
        _push_scope(self.deadline)
        self._since = _monotonic_wall()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        if _get_ident() != self._thread:
            # The scope lives in the entering thread's context and scope stack: leaving it from
            # here would pop another thread's scope. Refused; it stays open where it was entered.
            raise RuntimeError(
                f"a fail_after/fail_at scope must be left on the thread that entered it (entered on "
                f"thread {self._thread}, left on thread {_get_ident()}); it is still open there"
            )
        _pop_scope()
        _scope_deadline.reset(self._reset)
        if exc_type is not None and exc is not None and issubclass(exc_type, RuntimeError):
            # torch re-wraps some errors on their way up (autograd): give back the typed one,
            # chained to what torch raised.
            typed = typed_error_for(exc, self._since)
            if typed is not None:
                raise typed from exc


_get_ident = threading.get_ident
_push_scope = _watched.push_scope
_pop_scope = _watched.pop_scope
_monotonic_wall = time.monotonic


def fail_at(deadline: float) -> _Scope:
    """Bounds every fastdist call inside the block, and every op on a watched group issued from
    it (torch's own included: DDP's backward, FSDP2, ``torch.distributed.*``), by an absolute
    ``deadline`` on :func:`current_time`'s clock. Calls inside get the sooner of their own
    deadline and this one; a call that starts after the deadline raises at once, without touching
    the network.

    The scope bounds collectives only: it does not interrupt other code, and leaving it raises
    nothing by itself.
    """
    if not is_real(deadline):
        raise TypeError(
            "deadline must be a number (seconds on fastdist.current_time()), got "
            f"{type(deadline).__name__}: {deadline!r}"
        )
    value = _as_float(deadline)
    if math.isnan(value):
        raise ValueError(f"deadline must not be NaN, got {deadline!r}")
    return _Scope(value)


def fail_after(seconds: float | datetime.timedelta) -> _Scope:
    """Bounds every fastdist call inside the block, and every op on a watched group issued from
    it, to finish within ``seconds`` of entering it::

        with fastdist.fail_after(30):
            loss = model(batch).sum()     # DDP / FSDP2 collectives included
            loss.backward()
            fastdist.barrier()            # each call gets the time left of the 30 s

    The countdown starts when the block is entered.
    """
    scope: _Relative = _new_scope(_Relative)  # (no __init__ frame: this is on every step's path)
    kind = type(seconds)
    # (NaN > 0 is False: a NaN goes to validate_seconds, which names it.)
    if kind is float and seconds > 0:  # type: ignore[operator]
        scope._budget = seconds  # type: ignore[assignment]
    elif kind is int and seconds > 0:  # type: ignore[operator]
        scope._budget = _as_float(seconds)  # (10**400: no deadline)
    else:
        scope._budget = validate_seconds(seconds, "seconds")
    return scope


class _Relative(_Scope):
    """fail_after: the deadline is fixed when the block is entered. The way in is _Scope's,
    written out (one Python frame less on every training step)."""

    __slots__ = ("_budget",)
    _budget: float

    def __enter__(self) -> DeadlineScope:
        if not _default_group_checked and _c10d.GroupMember.WORLD is not None:
            _check_default_group()
        now = _now()
        deadline = now + self._budget
        outer = _outer_deadline()
        if outer < deadline:  # noqa: PLR1730 - min() is a call more on every step's path
            deadline = outer
        self.deadline = deadline
        self._reset = _set_deadline(deadline)
        _push_scope(deadline)
        self._since = now  # (the engine's clock is time.monotonic()'s: CLOCK_MONOTONIC)
        self._thread = _get_ident()
        return self


_now = _core.monotonic
_new_scope = object.__new__
_outer_deadline = _scope_deadline.get
_set_deadline = _scope_deadline.set


# ---------------------------------------------------------------------------------------------
# RendezvousTimeout


class RendezvousTimeout:
    """A deadline that starts counting when it is closed, shared by several calls.

    ``close()`` starts the countdown of ``timeout`` seconds (again: no effect). A call given it
    as ``timeout=`` closes it if it is still open, then uses its deadline, so a sequence of calls
    (rank 0 waiting for every rank to gather, then for data from every rank) stops within one
    budget::

        rt = fastdist.RendezvousTimeout(timeout=30)
        fastdist.barrier(timeout=rt)              # starts the 30 s
        fastdist.all_gather(out, t, timeout=rt)   # gets what is left of them
        if rt.is_timed_out(): ...
    """

    __slots__ = ("_deadline", "_lock", "_timeout", "heartbeat", "join", "last_call")

    def __init__(
        self,
        timeout: float | datetime.timedelta = 10.0,
        *,
        join: float | datetime.timedelta | None = None,
        last_call: float | datetime.timedelta | None = None,
        heartbeat: float | datetime.timedelta | None = None,
    ) -> None:
        self._timeout = validate_seconds(timeout, "timeout")
        # For fastdist.init_process_group's rendezvous (see fastdist.store.rendezvous.rendezvous):
        # how long ranks may join, extra time after the countdown, how often to look.
        self.join = None if join is None else validate_seconds(join, "join")
        self.last_call = None if last_call is None else validate_seconds(last_call, "last_call")
        self.heartbeat = None if heartbeat is None else validate_seconds(heartbeat, "heartbeat")
        self._deadline: float | None = None
        self._lock = threading.Lock()

    @property
    def timeout(self) -> float:
        """The countdown's length in seconds."""
        return self._timeout

    @property
    def closed(self) -> bool:
        """Whether the countdown has started."""
        return self._deadline is not None

    @property
    def deadline(self) -> float | None:
        """The absolute deadline on :func:`current_time`'s clock, or ``None`` while open."""
        return self._deadline

    def close(self) -> float:
        """Starts the countdown if it has not started; returns the deadline. Idempotent."""
        if self._deadline is None:
            with self._lock:
                if self._deadline is None:
                    self._deadline = current_time() + self._timeout
        return self._deadline

    def is_timed_out(self) -> bool:
        """True once the countdown has started and run out."""
        return self._deadline is not None and current_time() >= self._deadline

    def remaining(self) -> float:
        """Seconds left: the whole timeout while open, then down to 0."""
        if self._deadline is None:
            return self._timeout
        return max(0.0, self._deadline - current_time())

    def _fastdist_deadline(self) -> float:
        return self.close()

    def __repr__(self) -> str:
        if self._deadline is None:
            return f"RendezvousTimeout(timeout={self._timeout:g}, open)"
        state = "timed out" if self.is_timed_out() else "closed"
        return f"RendezvousTimeout(timeout={self._timeout:g}, {state}, remaining={self.remaining():.3f} s)"


TimeoutLike = Union[float, int, datetime.timedelta, RendezvousTimeout, DeadlineScope, None]


def check_timeout(timeout: object) -> None:
    """Refuses a bad ``timeout=`` as :func:`resolve_deadline` would, without starting its
    countdown (a RendezvousTimeout's starts when it is first resolved): for a call that may
    return before it needs a deadline, so that a bad value fails on every call alike."""
    if timeout is None or isinstance(timeout, (RendezvousTimeout, DeadlineScope)):
        return
    validate_seconds(timeout, "timeout", deadline_objects=True)


def resolve_deadline(timeout: object, now: float) -> float:
    """The absolute deadline for a call starting at ``now`` given its ``timeout=`` argument,
    before enclosing scopes are applied. Raises ``TypeError``/``ValueError`` for bad input."""
    if timeout is None:
        return now + get_default_timeout()
    if isinstance(timeout, (RendezvousTimeout, DeadlineScope)):
        return timeout._fastdist_deadline()
    return now + validate_seconds(timeout, "timeout", deadline_objects=True)


def effective_deadline(timeout: object, now: float) -> float:
    """The sooner of the call's own deadline and every enclosing scope's."""
    # Fast path for the common case, a plain positive number (every collective call runs this).
    kind = type(timeout)
    if (kind is float or kind is int) and timeout > 0:  # type: ignore[operator]
        deadline = now + timeout  # type: ignore[operator]
    else:
        deadline = resolve_deadline(timeout, now)
    scope = _scope_deadline.get()
    return min(scope, deadline)


# ---------------------------------------------------------------------------------------------
# Timeout handler

TimeoutHandler = Callable[[BaseException], Any]


def set_timeout_handler(handler: TimeoutHandler | None) -> None:
    """Sets ``handler(error)``, run in the thread that observed a timeout before the error is
    raised (or before ``False`` is returned with ``raise_on_timeout=False``). If it raises,
    including ``sys.exit()``, that propagates instead; if it returns, the default behaviour
    follows. ``None`` restores the default (no handler)."""
    if handler is not None and not callable(handler):
        raise TypeError(f"handler must be callable or None, got {type(handler).__name__}: {handler!r}")
    SETTINGS.timeout_handler = handler


def get_timeout_handler() -> TimeoutHandler | None:
    """The handler set by :func:`set_timeout_handler`, or ``None``."""
    return SETTINGS.timeout_handler


def exit_process(code: object) -> None:
    """Ends the process from any thread with ``sys.exit``'s meaning of ``code``. ``sys.exit``
    in a thread other than the main one would end only that thread."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # exiting anyway: a stream that cannot flush is left
            stream.flush()
    os._exit(status)


def run_timeout_handler(error: BaseException) -> None:
    handler = SETTINGS.timeout_handler
    if handler is not None:
        handler(error)
