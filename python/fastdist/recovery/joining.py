"""A process that joins a running job: a replacement for a dead rank, or a spare taking its place.

A process learns that it joins (rather than starts the job) from the job's store: every rank of
the job's first start marks it running once its group is made (``running``), and a process that
finds the mark before making its own group is a joiner. No rank of a first start can find it:
making the default group needs every rank's connection, so no rank's init ends before the last
one's begins.

A joiner's groups are made on :class:`fastdist._watched.SoloBackend` (its ops complete at once,
locally): the constructors the script runs before ``fastdist.sync_state`` (DDP's parameter check
and broadcast, DeviceMesh) need no peer. ``sync_state`` then joins the live ranks' ``recover()``,
swaps real backends in, and loads the state a live rank sends.

Spares: with ``spares=K`` the last K processes of a launch hold no rank. A spare waits in
``init_process_group``, blocked in a store wait on its own key (``spare/LAUNCH_RANK``: no CPU, no
polling) until the launcher (``fastdist run``) writes a dead rank's number there, or "end" when
the job is over (the spare then exits 0). A key per spare, not one queue for all: the agent knows
which spare holds which rank, and a spare that dies waiting takes no rank with it.
"""

from __future__ import annotations

import datetime
import importlib
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.distributed import distributed_c10d as _c10d

from .._native import _watched
from ..store import job, seal

_lock = threading.Lock()
# Set between a joiner's init_process_group and its sync_state.
_pending = False


def spares_arg(spares: Any) -> int:
    """``spares=`` or FASTDIST_SPARES, validated."""
    if spares is None:
        raw = os.environ.get("FASTDIST_SPARES", "0").strip() or "0"
        if not raw.isdigit():
            raise ValueError(f"FASTDIST_SPARES must be a whole number, got {raw!r}")
        return int(raw)
    if isinstance(spares, bool) or not isinstance(spares, int):
        raise TypeError(f"spares must be an int, got {type(spares).__name__}: {spares!r}")
    if spares < 0:
        raise ValueError(f"spares must be >= 0, got {spares}")
    return spares


def wait_for_vacancy(store: Any, launch_rank: int) -> int:
    """Blocks until the launcher gives this spare a dead rank's place; returns that rank. Exits the
    process with status 0 when the job ends without needing it."""
    key = job.spare_key(launch_rank)
    _warm_up()
    while True:
        store.wait([key], datetime.timedelta(days=3650))
        value = seal.opened(bytes(store.get(key)), "spare's rank")
        if value == job.END:
            raise SystemExit(0)
        if value is not None and value.isdigit():
            return int(value)
        # Not the agent's (not signed with the job's secret): ignored until the agent writes its own
        # over it (polled: only a forged key gets here).
        time.sleep(0.2)


# What a training script's first DDP, FSDP2 or DeviceMesh constructor imports: torch._dynamo alone
# takes 1.4 s on this machine. A spare imports them while it waits, not once it is needed.
_WARM_MODULES = ("torch._dynamo", "torch.nn.parallel", "torch.distributed.tensor", "torch.distributed.fsdp")


def _warm_up() -> None:
    for name in _WARM_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # pragma: no cover - an older torch without one of them
            pass


def is_pending() -> bool:
    """Whether this process is a joiner between its init_process_group and its sync_state (its
    groups are made on SoloBackends)."""
    return _pending


def set_pending(on: bool) -> None:
    """Sets whether this process is a pending joiner: while ``on``, torch makes gloo and NCCL groups
    with stand-ins that build SoloBackends; off, with its own classes again."""
    global _pending
    with _lock:
        _pending = on
        for name, real in _REAL.items():
            setattr(_c10d, name, _STAND_INS[name] if on else real)


@contextmanager
def real_classes() -> Iterator[None]:
    """torch's own backend classes inside, even while a joiner's stand-ins are in place: a
    third-party backend that recovery rebuilds (through its creator, which may build torch's
    gloo or NCCL itself) connects for real."""
    with _lock:
        was = _pending
        for name, real in _REAL.items():
            setattr(_c10d, name, real)
    try:
        yield
    finally:
        with _lock:
            if was and _pending:
                for name in _REAL:
                    setattr(_c10d, name, _STAND_INS[name])


def _stand_in(real: Any, backend_name: str) -> Any:
    """A class that stands in for ``real`` (ProcessGroupGloo, ProcessGroupNCCL) in torch's group
    creation while a joiner waits for its slot: the group is made, named and registered as torch
    makes it, on a SoloBackend, and nothing connects to a peer (gloo would connect at once; NCCL
    at the constructors' first collective, which the live ranks, busy in recover(), never join)."""

    class Meta(type):
        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, (real, _watched.SoloBackend))

        def __getattr__(cls, name: str) -> Any:
            return getattr(real, name)

    class StandIn(metaclass=Meta):
        def __new__(cls, store: Any, rank: int, size: int, *args: Any, **kwargs: Any) -> Any:
            backend = _watched.SoloBackend(rank, size, backend_name)
            try:
                backend.options = _Options()
            except AttributeError:  # torch 2.14: a property, which reads the backend's own options
                pass
            return backend

    StandIn.__name__ = f"Solo{real.__name__}"
    return StandIn


# What torch.distributed constructs a group's backend with, by name: stood in for while pending.
_REAL: dict[str, Any] = {
    attr: getattr(_c10d, attr)
    for attr in ("ProcessGroupGloo", "ProcessGroupNCCL")
    if isinstance(getattr(_c10d, attr, None), type)
}
_STAND_INS = {
    attr: _stand_in(real, "gloo" if attr == "ProcessGroupGloo" else "nccl") for attr, real in _REAL.items()
}


class _Options:
    """What torch sets on a new gloo backend's options (group name, global ranks)."""


@contextmanager
def solo_groups() -> Iterator[None]:
    """Groups made inside are made on SoloBackends (for a joiner's init)."""
    set_pending(True)
    try:
        yield
    except BaseException:
        set_pending(False)
        raise


def source_of(size: int, joiners: list[int]) -> int:
    """The live rank that sends the state when the live ranks are known to be in step (a growth):
    the lowest rank that did not join. (A recovery picks the one that got least far: see
    fastdist.recovery.reconcile.)"""
    for r in range(size):
        if r not in joiners:
            return r
    raise ValueError("every rank is joining: no live rank holds the state")
