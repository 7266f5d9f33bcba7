"""RPC with fastdist's deadline model.

``torch.distributed.rpc`` has per-call timeouts but reports them as a plain ``RuntimeError``
whose text must be parsed. Here every call takes ``timeout=`` like a collective (seconds, a
``timedelta``, a deadline object, or an enclosing :func:`fastdist.fail_after` scope; ``None``
means the agent's ``rpc_timeout``) and a timeout raises :class:`RpcTimeoutError`, after the
timeout handler ran.

    fastdist.rpc.init_rpc("worker0", rank=0, world_size=2, rpc_timeout=60)
    fastdist.rpc.rpc_sync("worker1", torch.add, args=(t, 1), timeout=5)
    fut = fastdist.rpc.rpc_async("worker1", f, timeout=5); fut.wait()   # or fastdist.wait(fut)
    fastdist.rpc.remote("worker1", f).to_here(timeout=5)
    fastdist.rpc.shutdown(timeout=10)

What happens to a call that timed out: the caller stops waiting, but the callee keeps running
the function (torch cannot interrupt it); its result is dropped when it arrives. The agent keeps
working. A graceful ``shutdown()`` on the callee waits for such calls, so fastdist bounds it.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any, Callable

import torch.distributed.rpc as _rpc

from .deadlines import TimeoutLike, current_time, effective_deadline, run_timeout_handler, validate_seconds
from .errors import RpcTimeoutError
from .ops.work import wait_until
from .settings import SETTINGS

__all__ = ["RRef", "RpcFuture", "init_rpc", "remote", "rpc_async", "rpc_sync", "shutdown"]

logger = logging.getLogger(__name__)

# torch's own per-call timeout is set this much after fastdist's deadline, so fastdist's engine
# (which raises RpcTimeoutError) sees the deadline first, and torch cleans up right after.
_TORCH_GRACE = 0.05
_TORCH_TIMEOUT_MARKER = "ran for more than set timeout"


def init_rpc(name: str, *, rank: int, world_size: int, rpc_timeout: float = 60.0, **options: Any) -> None:
    """Starts torch's TensorPipe RPC agent with ``rpc_timeout`` (seconds, or a ``timedelta``)
    as the default per-call timeout. ``options`` go to ``TensorPipeRpcBackendOptions``
    (``init_method``, ``num_worker_threads``, ``device_maps``, ...)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {type(name).__name__}: {name!r}")
    for arg, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{arg} must be a non-negative int, got {value!r}")
    if not rank < world_size:
        raise ValueError(f"rank must be less than world_size ({world_size}), got {rank}")
    seconds = validate_seconds(rpc_timeout, "rpc_timeout")
    backend_options = _rpc.TensorPipeRpcBackendOptions(
        rpc_timeout=0 if math.isinf(seconds) else seconds, **options
    )
    _rpc.init_rpc(  # type: ignore[no-untyped-call]
        name,
        backend=_rpc.BackendType.TENSORPIPE,  # type: ignore[attr-defined]
        rank=rank,
        world_size=world_size,
        rpc_backend_options=backend_options,
    )
    SETTINGS.rpc_timeout = seconds


def _deadline(timeout: TimeoutLike, now: float) -> float:
    if timeout is None:
        if SETTINGS.rpc_timeout is None:
            raise RuntimeError("RPC is not initialized: call fastdist.rpc.init_rpc() first")
        timeout = SETTINGS.rpc_timeout
    return effective_deadline(timeout, now)


def _torch_timeout(deadline: float, now: float) -> float:
    # torch: 0 means no timeout. A deadline already past still gets a tiny positive one.
    return 0.0 if math.isinf(deadline) else max(deadline - now, 0.0) + _TORCH_GRACE


def _func_name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _check_call(to: Any, func: Any, args: Any, kwargs: Any) -> None:
    if not isinstance(to, (str, int, _rpc.WorkerInfo)):
        raise TypeError(f"to must be a worker name, rank or WorkerInfo, got {type(to).__name__}: {to!r}")
    if not callable(func):
        raise TypeError(f"func must be callable, got {type(func).__name__}: {func!r}")
    if args is not None and not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple or None, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict or None, got {type(kwargs).__name__}")


def _timeout_error(to: Any, func: Any, start: float, deadline: float) -> RpcTimeoutError:
    err = RpcTimeoutError(
        to=str(to), func=_func_name(func), timeout=deadline - start, elapsed=current_time() - start
    )
    run_timeout_handler(err)
    return err


class RpcFuture:
    """The result of :func:`rpc_async`: ``wait()`` returns the value or raises
    :class:`RpcTimeoutError` at the call's deadline (or the remote error)."""

    _fastdist_handle = True  # fastdist.wait() calls wait(timeout) on it

    def __init__(self, fut: Any, to: Any, func: Any, start: float, deadline: float) -> None:
        self._fut = fut
        self._to, self._func, self._start, self._deadline = to, func, start, deadline

    @property
    def deadline(self) -> float:
        """The call's absolute deadline on :func:`fastdist.current_time`'s clock (``math.inf``:
        none)."""
        return self._deadline

    @property
    def torch_future(self) -> Any:
        """The underlying ``torch.futures.Future`` (its timeout error is torch's RuntimeError)."""
        return self._fut

    def done(self) -> bool:
        """True once the call has finished (torch's future is done)."""
        return bool(self._fut.done())

    def wait(self, timeout: TimeoutLike = None) -> Any:
        """The call's result; raises the remote error, or :class:`RpcTimeoutError` at the call's
        deadline. With ``timeout`` (seconds, a ``timedelta`` or a deadline object), waits at most
        that long, and raises a plain :class:`TimeoutError` if it ends before the call's deadline
        (the call goes on)."""
        now = current_time()
        limit = self._deadline if timeout is None else min(self._deadline, effective_deadline(timeout, now))
        finished, _token, _ = wait_until(self._fut, limit)
        if finished:
            try:
                return self._fut.wait()
            except RuntimeError as exc:
                if _TORCH_TIMEOUT_MARKER not in str(exc):
                    raise
        if limit < self._deadline and current_time() < self._deadline:
            raise TimeoutError(
                f"wait() on the RPC {_func_name(self._func)} to {self._to} gave up; "
                "the call's own deadline has not passed"
            )
        _raise(_timeout_error(self._to, self._func, self._start, self._deadline))

    value = wait


def _raise(err: BaseException) -> None:
    try:
        raise err
    finally:
        del err  # no frame on the way up keeps it: see collectives._fail


def rpc_sync(
    to: Any,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    *,
    timeout: TimeoutLike = None,
) -> Any:
    """``torch.distributed.rpc.rpc_sync`` with a deadline: returns ``func``'s result from ``to``,
    or raises :class:`RpcTimeoutError` at the deadline."""
    return rpc_async(to, func, args, kwargs, timeout=timeout).wait()


def rpc_async(
    to: Any,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    *,
    timeout: TimeoutLike = None,
) -> RpcFuture:
    """``torch.distributed.rpc.rpc_async`` with a deadline fixed now; returns an
    :class:`RpcFuture` (``fastdist.wait(fut)`` works too)."""
    start = current_time()
    deadline = _deadline(timeout, start)
    _check_call(to, func, args, kwargs)
    fut = _rpc.rpc_async(to, func, args=args, kwargs=kwargs, timeout=_torch_timeout(deadline, start))
    return RpcFuture(fut, to, func, start, deadline)


class RRef:
    """The result of :func:`remote`: ``to_here(timeout=None)`` raises :class:`RpcTimeoutError`
    at its deadline (``None``: the deadline set by ``remote``'s ``timeout``). Everything else is
    the torch ``RRef``'s (``rref.torch_rref``)."""

    def __init__(self, rref: Any, to: Any, func: Any, start: float, deadline: float) -> None:
        self.torch_rref = rref
        self._to, self._func, self._start, self._deadline = to, func, start, deadline

    def to_here(self, timeout: TimeoutLike = None) -> Any:
        """The remote value, copied here; raises :class:`RpcTimeoutError` at the deadline:
        ``remote``'s, or with ``timeout`` (seconds, a ``timedelta`` or a deadline object), that long
        from now."""
        start = current_time()
        deadline = self._deadline if timeout is None else effective_deadline(timeout, start)
        # torch's own timeout is the only one here (to_here blocks in torch); it can fire a little
        # early, so it gets the grace too: the error never comes before the deadline.
        seconds = _torch_timeout(deadline, start)
        try:
            return self.torch_rref.to_here(timeout=seconds)
        except RuntimeError as exc:
            if _TORCH_TIMEOUT_MARKER not in str(exc) and "timed out" not in str(exc).lower():
                raise
        _raise(_timeout_error(self._to, self._func, start if timeout is not None else self._start, deadline))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.torch_rref, name)


def remote(
    to: Any,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    *,
    timeout: TimeoutLike = None,
) -> RRef:
    """``torch.distributed.rpc.remote`` with a deadline for creating the value on ``to``."""
    start = current_time()
    deadline = _deadline(timeout, start)
    _check_call(to, func, args, kwargs)
    rref = _rpc.remote(to, func, args=args, kwargs=kwargs, timeout=_torch_timeout(deadline, start))
    return RRef(rref, to, func, start, deadline)


# RPC shutdowns still running after their timeout, with that timeout: the exit waits for them.
_lingering: list[tuple[threading.Thread, float]] = []


def join_lingering() -> None:
    """At exit (fastdist.shutdown): waits for each RPC shutdown that outlived its timeout, as long
    again at most."""
    for worker, seconds in _lingering:
        worker.join(None if math.isinf(seconds) else seconds)


def shutdown(graceful: bool = True, *, timeout: float = 10.0) -> bool:
    """Stops the RPC agent. A graceful shutdown waits for every worker and for calls still
    running here, including ones whose callers timed out long ago, so it is bounded by
    ``timeout`` seconds: past that, shutdown continues in a background thread, the still-running
    calls finish (or not) on their own and their results are dropped, and this returns False;
    interpreter exit then waits up to ``timeout`` once more for them (a call still running when
    the interpreter finalizes can make torch abort the process). Returns True once the agent
    stopped."""
    if not isinstance(graceful, bool):
        raise TypeError(f"graceful must be a bool, got {type(graceful).__name__}: {graceful!r}")
    seconds = validate_seconds(timeout, "timeout")
    worker = threading.Thread(
        target=_rpc.shutdown, kwargs={"graceful": graceful}, name="fastdist-rpc-shutdown", daemon=True
    )
    worker.start()
    worker.join(None if math.isinf(seconds) else seconds)
    SETTINGS.rpc_timeout = None
    if worker.is_alive():
        logger.warning(
            "RPC shutdown did not finish within %.3g s: a call is still running here (its caller may have "
            "timed out); leaving it to finish in the background",
            seconds,
        )
        # A call still running when the interpreter finalizes is killed inside torch, which can
        # abort the process; so the exit (fastdist.shutdown) waits for it once more, as long again
        # at most.
        _lingering.append((worker, seconds))
        return False
    return True
