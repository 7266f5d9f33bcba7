"""Watched groups: every op on a group made by (or after) ``fastdist.init_process_group`` has a
deadline, whoever issues it.

torch builds each process group as usual; when it registers the group's backend (gloo or NCCL)
in the ProcessGroup, fastdist registers a ``fastdist._watched.WatchedBackend`` wrapping it instead
(``ProcessGroup._register_backend`` is the one place every group passes through: the default
group, ``new_group``, ``split_group``, DeviceMesh). The ProcessGroup stays torch's own, with its
name and backend type, so DDP, FSDP2 and DeviceMesh take their usual paths; recovery swaps the
wrapped backend in place, so the objects holding the group train on.

The C++ side numbers and watches every op; when one expires or fails, it asks :func:`_build` here,
once per fault, for the exception every waiter of the group raises: the who-is-missing report
(fastdist.diagnostics) made into a :class:`CollectiveTimeoutError` or :class:`GroupAbortedError`.
"""

from __future__ import annotations

import atexit
import copy
import json
import logging
import math
import os
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch._C._distributed_c10d import ProcessGroup

from . import _core, _groups, _verdict, _watched, diagnostics
from ._timeouts import current_time, get_default_timeout, run_timeout_handler
from ._work import run_handler_unwaited
from .errors import CollectiveTimeoutError, FastdistError, GroupAbortedError

if TYPE_CHECKING:
    from ._groups import GroupState

logger = logging.getLogger(__name__)

WatchedBackend = _watched.WatchedBackend

_lock = threading.Lock()
_active = False
# ctl id -> (weak reference to the ProcessGroup, device) for every watched backend.
_registry: dict[int, tuple[Any, torch.device]] = {}
# The group timeout the user gave fastdist.init_process_group (seconds), or None.
_user_timeout: float | None = None
# Whether Ctrl-C ended an op of this process (the exit then does not wait for it to end in gloo).
_interrupted = False
# The most recent faults, (time.monotonic(), exception): a scope turns a backend error that torch
# re-wrapped on its way up back into the typed one.
_recent: list[tuple[float, BaseException]] = []

_orig_register_backend = ProcessGroup._register_backend


def _register_backend(pg: Any, device: Any, backend_type: Any, backend: Any) -> Any:
    if _active and not isinstance(backend, WatchedBackend) and backend_type in _WATCHED_TYPES:
        backend = _wrap(pg, device, backend_type, backend)
        if backend_type == ProcessGroup.BackendType.GLOO:
            # torch's C++ casts the backend registered as GLOO to ProcessGroupGloo (DDP's logger
            # reads its thread count): a wrapper registered so would be read as one. Registered as
            # CUSTOM, torch takes its generic path; torch.distributed.get_backend(pg) still says
            # "gloo" (it reads its own records), and the object collectives pick the CPU as before.
            if pg._get_backend_name() == "gloo":
                pg._set_default_backend(ProcessGroup.BackendType.CUSTOM)
            backend_type = ProcessGroup.BackendType.CUSTOM
    return _orig_register_backend(pg, device, backend_type, backend)


_WATCHED_TYPES = {ProcessGroup.BackendType.GLOO}
if hasattr(ProcessGroup.BackendType, "NCCL"):
    _WATCHED_TYPES.add(ProcessGroup.BackendType.NCCL)

_wrapped: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()


def _wrap(pg: Any, device: Any, backend_type: Any, backend: Any) -> Any:
    # A backend registered for several devices ("gloo" for cpu and cuda) gets one wrapper.
    per_pg = _wrapped.setdefault(pg, {})
    existing = per_pg.get(id(backend))
    if existing is not None:
        return existing
    timeout = get_default_timeout()
    if _user_timeout is not None:
        options = getattr(backend, "options", None)
        group_timeout = getattr(options, "timeout", None) or getattr(options, "_timeout", None)
        timeout = group_timeout.total_seconds() if group_timeout is not None else _user_timeout
    # NCCL completes a work's future at enqueue: its works are polled (work.is_completed()).
    # FASTDIST_TEST_POLLED=1 watches gloo groups the same way: the NCCL path's logic, testable on
    # a CPU (gloo's completion query is exact, so it stands in for a GPU's).
    polled = backend_type != ProcessGroup.BackendType.GLOO or os.environ.get("FASTDIST_TEST_POLLED") == "1"
    wrapper = WatchedBackend(backend, "", float(timeout), polled)
    per_pg[id(backend)] = wrapper
    with _lock:
        # Insertion order is creation order (watched_groups relies on it): a ctl id that is a
        # freed one's address again goes to the end, not to the old one's place.
        _registry.pop(wrapper.ctl_id, None)
        _registry[wrapper.ctl_id] = (
            weakref.ref(pg),
            torch.device(device) if not isinstance(device, torch.device) else device,
        )
    return wrapper


def activate(user_timeout: float | None) -> None:
    """Watches every group made from now on (called by fastdist.init_process_group)."""
    global _active, _user_timeout
    with _lock:
        _user_timeout = user_timeout
        if _active:
            return
        _watched.set_engine(_core._engine_capsule())
        _watched.set_fault_builder(_build)
        _watched.set_main_thread(threading.main_thread().ident or 0)
        _watched.install_sigint_hook()
        ProcessGroup._register_backend = _register_backend  # type: ignore[method-assign,assignment]
        _track_ddp()
        _active = True


backend_of = _groups.watched_backend


def backends_of(pg: Any) -> list[Any]:
    """Every distinct WatchedBackend registered in ``pg``."""
    out: list[Any] = []
    seen: set[int] = set()
    for device in _device_order(pg):
        try:
            b = pg._get_backend(device)
        except RuntimeError:
            continue
        if isinstance(b, WatchedBackend) and b.ctl_id not in seen:
            seen.add(b.ctl_id)
            out.append(b)
    return out


def _device_order(pg: Any) -> list[torch.device]:
    try:
        types = list(pg._device_types)
    except (AttributeError, RuntimeError):
        types = []
    return types or [torch.device("cpu")]


# ---------------------------------------------------------------------------------------------
# Building the error for a fault (called from C++, with the GIL, once per fault)


def _build(ctl_id: int, info: dict[str, Any]) -> BaseException:
    # Whatever this raises (a waiter's timeout handler's sys.exit() among others) is the error.
    err = _build_error(ctl_id, info)
    if info["kind"] in ("timeout", "remote", "backend") and os.environ.get("FASTDIST_DUMP_DIR"):
        entry = _registry.get(ctl_id)
        pg = entry[0]() if entry is not None else None
        if pg is not None:
            from . import dump

            dump.write(_groups.state_of(pg), pg, err)
    if info["kind"] != "refused":
        # A copy: the error itself gets a traceback when raised, and with it the frames of the
        # failed call; kept here, those would live on.
        _recent.append((time.monotonic(), copy.copy(err)))
        del _recent[:-8]
    return err


def _build_error(ctl_id: int, info: dict[str, Any]) -> BaseException:
    entry = _registry.get(ctl_id)
    pg = entry[0]() if entry is not None else None
    op, seq, kind = info["op"], int(info["seq"]), info["kind"]
    if pg is None:
        return GroupAbortedError(op=op, group="?", rank=-1, reason=info["detail"] or f"{op} #{seq} {kind}")
    st = _groups.state_of(pg)
    if kind == "refused":
        # The reason fastdist recorded (it names the peer whose fault rang this rank) before the
        # engine's own, which knows only that the op was ended by a peer's fault.
        reason = st.dead_reason or info["detail"] or "aborted"
        return GroupAbortedError(op=op, group=st.name, rank=st.my_global_rank, reason=reason)
    start = float(info["start"])
    deadline = float(info["deadline"])
    last_seen = info["prev"] or None
    if kind == "interrupted":
        global _interrupted
        _interrupted = True
        reason = f"an op was interrupted (Ctrl-C) on rank {st.my_global_rank}"
        _groups.mark_dead(pg, reason)
        # The peers in the op would otherwise wait for it until their deadline, and then blame a
        # timeout: ring them (bounded, so that the KeyboardInterrupt is not held up).
        diagnostics.announce(st, op, seq, "interrupted")
        # Ctrl-C: every op in flight on the group ends, wherever torch waits for it (DDP's backward
        # included), and the group is dead. The KeyboardInterrupt itself is Python's: its handler
        # runs as soon as the main thread is back in Python, a moment later (raising one here too
        # would give two).
        return GroupAbortedError(op=op, group=st.name, rank=st.my_global_rank, reason=reason)
    if kind == "remote":
        return _remote_fault(pg, st, op, seq, start, deadline, last_seen, info)
    text = _verdict.first_line(info["detail"] or "")
    verdict = _verdict.classify(text)
    if kind == "timeout" or verdict == _verdict.TIMEOUT:
        _die(
            pg,
            st,
            f"{op} #{seq} timed out on rank {st.my_global_rank}",
            _verdict.timeout_error(
                st, op, seq, start, deadline, None, last_seen, "aborting the communicators hung"
            ),
        )
        rep = diagnostics.report(st, op, seq, "timed_out", deadline - start)
        cause = None if (not text or deadline <= start) else text  # an expired deadline says so itself
        if rep is None and diagnostics.store_failure is not None:
            cause = diagnostics.store_gone_reason()
        err: BaseException = _verdict.timeout_error(st, op, seq, start, deadline, rep, last_seen, cause)
        _run_handler(err, info["waiter"])
        return err
    if verdict == _verdict.PEER_CLOSED:
        err = _verdict.peer_closed(pg, st, op, seq, start, deadline, last_seen, text)
        if isinstance(err, CollectiveTimeoutError):
            _run_handler(err, info["waiter"])
        return err
    reason = f"{op} #{seq} failed on rank {st.my_global_rank}: {text or 'backend error'}"
    _groups.mark_dead(pg, reason)
    return GroupAbortedError(op=op, group=st.name, rank=st.my_global_rank, reason=reason)


def _remote_fault(
    pg: Any,
    st: GroupState,
    op: str,
    seq: int,
    start: float,
    deadline: float,
    last_seen: str | None,
    info: dict[str, Any],
) -> BaseException:
    """A peer reported a fault on the group (fastdist._bell) while this rank's op ``seq`` was in
    flight. In the same op: the same timeout, with the same report (everyone raises together).
    In another: the group is dead under this op; say whose fault it was."""
    try:
        peer = json.loads(info["detail"])
    except ValueError:
        peer = {}
    who = f"rank {peer.get('rank', '?')}"
    what = f"{peer.get('op', '?')} #{peer.get('seq', '?')}"
    # This rank's op began after the peer's fault: a straggler (it was stopped, or slow), not a
    # rank stuck in the op with the others.
    began = time.time() - (current_time() - start)
    late = isinstance(peer.get("t"), (int, float)) and began > peer["t"]
    if peer.get("state") == "interrupted":
        return _aborted(pg, st, op, f"{who} was interrupted (KeyboardInterrupt) in {what}")
    if isinstance(peer.get("dead"), str):
        return _aborted(pg, st, op, f"{peer['dead']} (seen by {who} in {what})")
    if peer.get("state") == "aborted":
        # The ringer's op failed under it (a peer closed the group): not a timeout of its own.
        return _aborted(
            pg,
            st,
            op,
            f"{who} saw the group closed under it by a peer in {what} (a rank exited or was killed)",
        )
    if peer.get("op") == op and peer.get("seq") == seq and not late:
        _die(
            pg,
            st,
            f"{op} #{seq} timed out on {who}",
            _verdict.timeout_error(
                st, op, seq, start, deadline, None, last_seen, "aborting the communicators hung"
            ),
        )
        rep = diagnostics.report(
            st, op, seq, "aborted", deadline - start if math.isfinite(deadline) else 1.0, rung=True
        )
        err = _verdict.timeout_error(st, op, seq, start, deadline, rep, last_seen, f"{who} timed out first")
        _run_handler(err, info["waiter"])
        return err
    verb = "timed out in" if peer.get("state") == "timed_out" else "failed in"
    return _aborted(
        pg, st, op, f"{who} {verb} {what} and aborted group {st.name!r} while this rank was in {op} #{seq}"
    )


def _aborted(pg: Any, st: GroupState, op: str, reason: str) -> GroupAbortedError:
    """The group is dead under ``op`` for ``reason`` (a peer's fault): the error, after _die."""
    _die(
        pg,
        st,
        reason,
        GroupAbortedError(
            op=op, group=st.name, rank=st.my_global_rank, reason=reason + "; aborting the communicators hung"
        ),
    )
    return GroupAbortedError(op=op, group=st.name, rank=st.my_global_rank, reason=reason)


def _die(pg: Any, st: GroupState, reason: str, if_abort_hangs: BaseException) -> None:
    """Marks the group dead and, on NCCL, starts aborting its communicators (in the background,
    bounded: ``if_abort_hangs`` goes to the timeout handler when the abort does not return)."""
    _groups.mark_dead(pg, reason)
    if st.polled:
        from . import _polled

        _polled.abort_group(pg, st.is_default, if_abort_hangs)


def _run_handler(err: BaseException, waiter: bool) -> None:
    if waiter:
        run_timeout_handler(err)  # whatever it raises propagates in the waiting thread
    else:
        run_handler_unwaited(err)


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


def history(group: Any = None) -> list[dict[str, Any]]:
    """The last 64 ops on ``group`` (default: the default group), oldest first, whoever issued
    them: ``seq``, ``op``, ``dtype`` and ``shape`` of the first input tensor (``tensors``: how
    many), ``thread`` (the issuer's ``threading.get_ident()``), ``start`` and ``end`` (on
    :func:`fastdist.current_time`'s clock; ``end`` None while in flight) and ``outcome``
    (``"pending"``, ``"ok"``, ``"timed_out"``, ``"failed"``). Kept in a fixed ring by the watched
    backend at a cost of about 100 ns per op; empty for a group fastdist does not watch."""
    pg = _groups.resolve(group)
    if pg is None:
        return []
    out: list[dict[str, Any]] = []
    for b in backends_of(pg):
        out.extend(b.history())
    return sorted(out, key=lambda r: int(r["seq"]))


def is_watched(pg: Any) -> bool:
    return backend_of(pg) is not None


# Groups a shrinking recover() replaced with new ones: kept alive while their abandoned work is
# in flight (for its late errors), but never rebuilt again.
_retired: weakref.WeakSet[Any] = weakref.WeakSet()


def retire(pgs: list[Any]) -> None:
    """``pgs`` were replaced by new groups: later in-place recoveries leave them out."""
    with _lock:
        for pg in pgs:
            _retired.add(pg)


def watched_groups() -> list[Any]:
    """Every live watched group of this process, oldest first: the order they were made in,
    which is the same on every rank (torch makes groups in the same order everywhere), so that
    recovery rebuilds them in step. (Not by the C++ object's address: addresses are in no
    particular order, and ranks once rebuilt different groups at the same time, each waiting
    for the others' addresses until the deadline.)"""
    with _lock:
        entries = list(_registry.items())
    out: list[Any] = []
    seen: set[int] = set()
    for _ctl, (ref, _device) in entries:
        pg = ref()
        if pg is not None and id(pg) not in seen and pg not in _retired:
            seen.add(id(pg))
            out.append(pg)
    return out


# DistributedDataParallel modules on watched groups, so that recover() can reset their reducers
# (a backward that failed leaves DDP waiting for a reduction that never finished).
_ddp_modules: weakref.WeakSet[Any] = weakref.WeakSet()


def _track_ddp() -> None:
    from torch.nn.parallel import DistributedDataParallel

    if getattr(DistributedDataParallel.__init__, "_fastdist", False):
        return
    original = DistributedDataParallel.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _ddp_modules.add(self)

    __init__._fastdist = True  # type: ignore[attr-defined]
    __init__.__doc__ = original.__doc__
    DistributedDataParallel.__init__ = __init__  # type: ignore[method-assign]


def reset_ddp(old_groups: list[Any], replacement: Any | None = None) -> int:
    """Resets every DDP module on one of ``old_groups`` after a recovery: its reducer forgets the
    failed iteration and, with ``replacement`` (a shrunk default group), moves to that group, so
    that gradients are averaged over the new world size. Returns how many were reset."""
    ids = {id(g) for g in old_groups}
    n = 0
    for module in list(_ddp_modules):
        pg = getattr(module, "process_group", None)
        if id(pg) in ids:
            module._update_process_group(replacement if replacement is not None else pg)
            n += 1
    return n


def fresh_ddp_reducers(groups: list[Any]) -> int:
    """Gives every DDP module on one of ``groups`` a new reducer, as its constructor builds one
    (torch's own recipe, ``DistributedDataParallel.__setstate__``): a process that joined has
    a new DDP whose gradient buckets are laid out by parameter order, while the live ranks' were
    rebuilt in the order gradients came; an all-reduce over buckets laid out differently sums
    unrelated gradients. Afterwards every rank starts from the same layout, and rebuilds it the
    same way after the next step. Returns how many were rebuilt."""
    ids = {id(g) for g in groups}
    n = 0
    for module in list(_ddp_modules):
        if id(getattr(module, "process_group", None)) not in ids:
            continue
        parameters, expect_sparse = module._build_params_for_reducer()
        names = module._build_debug_param_to_name_mapping(parameters)
        module._ddp_init_helper(parameters, expect_sparse, names, module.static_graph)
        if module.static_graph:
            module.reducer._set_static_graph()
        module._has_rebuilt_buckets = False
        n += 1
    return n


def reset_fsdp() -> int:
    """Resets the per-iteration state of every root FSDP2 module (``reset_iter_state``, torch's
    own recovery hook for a forward or backward that raised), so that the next step starts from
    sharded parameters. Returns how many were reset."""
    if "torch.distributed.fsdp" not in sys.modules:
        return 0
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return 0
    import gc

    # type(), not isinstance(): isinstance reads __class__, which some objects in the heap answer
    # with a warning (torch's deprecated torch.distributed.reduce_op).
    roots = [m for m in gc.get_objects() if issubclass(type(m), FSDPModule) and _fsdp_is_root(m)]
    for m in roots:
        if not hasattr(m, "reset_iter_state"):  # torch before 2.11: reshard what can be
            m.reshard()
            continue
        if not _fsdp_ran(m):  # never ran a step (a joiner's new model): nothing to reset
            continue
        try:
            m.reset_iter_state()
        except FastdistError:
            # It waits on the failed step's all-gathers, which raise their fault: forget them.
            for state in m._get_fsdp_state()._state_ctx.all_states:
                for group in state._fsdp_param_groups:
                    group._all_gather_result = None
            m.reset_iter_state()
    return len(roots)


def _fsdp_ran(module: Any) -> bool:
    """Whether the FSDP2 root ran its lazy init (its first forward; torch's FSDPCommContext makes
    ``all_gather_state`` there): before it, torch's reset_iter_state fails on state that does not
    exist yet."""
    try:
        return hasattr(module._get_fsdp_state()._comm_ctx, "all_gather_state")
    except (AttributeError, RuntimeError):
        return False


def _fsdp_is_root(module: Any) -> bool:
    try:
        return module._get_fsdp_state()._is_root is not False
    except (AttributeError, RuntimeError):
        return False


@atexit.register
def _at_exit() -> None:
    # Ops that failed at their deadline are still in flight in the backend, which calls back into
    # fastdist when they end (gloo: its own timeout, shortly after the deadline). Let that happen
    # while Python still runs.
    if not _active:
        return
    from . import _bell

    _bell.stop()
    # Except after Ctrl-C: the ops it ended were waiting for peers that had not come, and end only
    # at gloo's own timeout (the group's, often minutes): waiting would only delay the exit.
    end = time.monotonic() + (0.0 if _interrupted else EXIT_DRAIN_SECONDS)
    while _watched.abandoned_inflight() > 0 and time.monotonic() < end:
        time.sleep(0.002)
    # Right after completing an op, gloo's worker destroys it, dropping the last reference to
    # tensors whose Python objects need the GIL: a caller that wakes on completion and exits at
    # once can beat it into finalization, and the worker would be killed (the process aborts).
    from ._work import EXIT_SETTLE_SECONDS

    time.sleep(EXIT_SETTLE_SECONDS)
    # A dead group's backend may still be inside an op (after Ctrl-C, one that waits for a peer
    # until gloo's own timeout): its destructor would join that thread, and exit would wait.
    _watched.keep_dead_backends()


EXIT_DRAIN_SECONDS = 2.0

from . import _timeouts as _timeouts_mod

_timeouts_mod._typed_error_for = typed_error_for
