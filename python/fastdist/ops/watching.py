"""Watched groups: every op on a group made by (or after) ``fastdist.init_process_group`` has a
deadline, whoever issues it.

torch builds each process group as usual; when it registers the group's backend (gloo or NCCL)
in the ProcessGroup, fastdist registers a ``fastdist._watched.WatchedBackend`` wrapping it instead
(``ProcessGroup._register_backend`` is the one place every group passes through: the default
group, ``new_group``, ``split_group``, DeviceMesh). The ProcessGroup stays torch's own, with its
name and backend type, so DDP, FSDP2 and DeviceMesh take their usual paths; recovery swaps the
wrapped backend in place, so the objects holding the group train on.

The C++ side numbers and watches every op; when one expires or fails, it asks
:func:`fastdist.ops.fault.build`, once per fault, for the exception every waiter of the group
raises: the who-is-missing report (fastdist.store.board) made into a
:class:`CollectiveTimeoutError` or :class:`GroupAbortedError`.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

from torch._C._distributed_c10d import ProcessGroup

from .._native import _watched, hand_engine_over
from ..deadlines import get_default_timeout
from ..groups import checks, pgstate, registry
from ..settings import SETTINGS
from . import fault

logger = logging.getLogger(__name__)

WatchedBackend = _watched.WatchedBackend
# What kind of fault an op met, as the C++ side says it.
Kind = _watched.FaultKind

_lock = threading.Lock()

_orig_register_backend = ProcessGroup._register_backend


def _register_backend(pg: Any, device: Any, backend_type: Any, backend: Any) -> Any:
    if SETTINGS.watching and not isinstance(backend, WatchedBackend) and _watches(backend_type, backend):
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


def _watches(backend_type: Any, backend: Any) -> bool:
    """gloo and NCCL backends are watched, and a custom one that says it is NCCL-like
    (:func:`fastdist.groups.pgstate.stream_marker_of`)."""
    return backend_type in _WATCHED_TYPES or pgstate.stream_marker_of(backend) is not None


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
    if SETTINGS.group_timeout is not None:
        options = pgstate.backend_options(backend)
        group_timeout = getattr(options, "timeout", None) or getattr(options, "_timeout", None)
        timeout = group_timeout.total_seconds() if group_timeout is not None else SETTINGS.group_timeout
    # NCCL completes a work's future at enqueue: its works are polled (work.is_completed(), the
    # end event's query), and so are those of a backend that says it is NCCL-like (its stream
    # marker: the tests' CPU double of NCCL, tests/support/fake_nccl.py).
    marker = pgstate.stream_marker_of(backend)
    is_polled = backend_type == getattr(ProcessGroup.BackendType, "NCCL", None) or marker is not None
    wrapper = WatchedBackend(backend, "", float(timeout), is_polled, marker)
    per_pg[id(backend)] = wrapper
    registry.enroll(wrapper.ctl_id, pg, device)
    _arm_later(pg)
    return wrapper


# Groups whose state is made (and with it the report C++ makes when Python cannot run, see
# fastdist.groups.native_report.arm) once torch has finished making them: torch registers a
# group's backend before it records the group's ranks, and the state needs those.
_unarmed: list[weakref.ref[Any]] = []
_armer: threading.Thread | None = None
_ARM_POLL = 0.02
_ARM_GIVE_UP = 5.0


def _arm_later(pg: Any) -> None:
    global _armer
    with _lock:
        _unarmed.append(weakref.ref(pg))
        if _armer is None or not _armer.is_alive():
            _armer = threading.Thread(target=_arm_pending, name="fastdist-arm", daemon=True)
            _armer.start()


def _arm_pending() -> None:
    since: dict[int, float] = {}
    while True:
        time.sleep(_ARM_POLL)
        with _lock:
            pending = list(_unarmed)
        if not pending:
            with _lock:
                if not _unarmed:
                    return
            continue
        done = []
        for ref in pending:
            pg = ref()
            if pg is None:
                done.append(ref)
            elif pg in pgstate.known_groups():
                pgstate.state_of(pg)  # its making arms it (groups.native_report)
                done.append(ref)
            elif time.monotonic() - since.setdefault(id(ref), time.monotonic()) > _ARM_GIVE_UP:
                done.append(ref)  # a backend made outside a torch group: nothing to arm
        with _lock:
            for ref in done:
                _unarmed.remove(ref)


def activate(user_timeout: float | None) -> None:
    """Watches every group made from now on (called by fastdist.init_process_group)."""
    with _lock:
        SETTINGS.group_timeout = user_timeout
        if SETTINGS.watching:
            return
        _install()
        ProcessGroup._register_backend = _register_backend  # type: ignore[method-assign,assignment]
        SETTINGS.watching = True


_installed = False


def install() -> None:
    """What the C++ side calls back into (the fault builder, the checks, Ctrl-C), set once: by
    :func:`activate`, or before fastdist's first op on a group torch made."""
    if not _installed:
        with _lock:
            _install()


def _install() -> None:
    global _installed
    if _installed:
        return
    hand_engine_over()
    _watched.set_fault_builder(fault.build)
    _watched.set_check_hook(_check)
    _watched.set_main_thread(threading.main_thread().ident or 0)
    _watched.install_sigint_hook()
    _installed = True


def _check(ctl_id: int, op: str, signature: str, deadline: float) -> bool:
    """The cross-rank check of an op torch issues on a watched group (FASTDIST_CHECK=1), called
    from C++ before the op is issued: False when the deadline passed first; raises
    CollectiveMismatchError on a mismatch (on every rank: none of them issues the op)."""
    pg = registry.group_of(ctl_id)
    if pg is None:
        return True
    st = pgstate.state_of(pg)
    st.checks_seq += 1  # numbered apart from the backend's ops, as fastdist's own checked calls are
    return checks.verify(st, op, st.checks_seq, f"{op}({signature})", deadline)


def active() -> bool:
    """Whether groups are watched (fastdist.init_process_group ran)."""
    return SETTINGS.watching


def drain_inflight(end: float) -> None:
    """At exit: waits until ``end`` (time.monotonic()) for the watched ops abandoned at their
    deadline to end in the backend, which calls back into fastdist then (gloo: at its own
    timeout, shortly after the deadline); that must happen while Python still runs."""
    while _watched.abandoned_inflight() > 0 and time.monotonic() < end:
        time.sleep(0.002)


def keep_dead_backends() -> None:
    """At exit: a dead group's backend may still be inside an op (after Ctrl-C, one that waits for
    a peer until gloo's own timeout): its destructor would join that thread, and exit would wait.
    They are kept, never destroyed."""
    _watched.keep_dead_backends()
