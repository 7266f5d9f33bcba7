"""The registry of watched groups: every group whose backend fastdist wraps, in creation order,
and the op history their backends keep."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from .._native import _watched, watched_backends
from . import pgstate

WatchedBackend = _watched.WatchedBackend

_lock = threading.Lock()
# ctl id -> (weak reference to the ProcessGroup, device) for every watched backend.
_registry: dict[int, tuple[Any, torch.device]] = {}


def enroll(ctl_id: int, pg: Any, device: Any) -> None:
    """Records the watched backend ``ctl_id`` of ``pg`` on ``device``."""
    with _lock:
        # Insertion order is creation order (watched_groups relies on it): a ctl id that is a
        # freed one's address again goes to the end, not to the old one's place.
        _registry.pop(ctl_id, None)
        pgstate.set_owner(ctl_id, pg)
        _registry[ctl_id] = (
            weakref.ref(pg),
            torch.device(device) if not isinstance(device, torch.device) else device,
        )


def group_of(ctl_id: int) -> Any | None:
    """The live ProcessGroup of the watched backend ``ctl_id`` (or of the private backends a group
    torch made has for fastdist's own ops), or None."""
    return pgstate.owner_of(ctl_id)


backend_of = pgstate.watched_backend


backends_of = watched_backends


def history(group: Any = None) -> list[dict[str, Any]]:
    """The last 64 ops on ``group`` (default: the default group), oldest first, whoever issued
    them: ``seq``, ``op``, ``dtype`` and ``shape`` of the first input tensor (``tensors``: how
    many), ``thread`` (the issuer's ``threading.get_ident()``), ``start`` and ``end`` (on
    :func:`fastdist.current_time`'s clock; ``end`` None while in flight) and ``outcome``
    (``"pending"``, ``"ok"``, ``"timed_out"``, ``"failed"``). Kept in a fixed ring by the watched
    backend at a cost of about 100 ns per op; on a group torch made, fastdist's own ops only."""
    pg = pgstate.resolve(group)
    return [] if pg is None else pgstate.state_of(pg).history()


def is_watched(pg: Any) -> bool:
    """Whether ``pg`` has a WatchedBackend: fastdist watches its ops."""
    return backend_of(pg) is not None


def retire(pgs: list[Any]) -> None:
    """``pgs`` were replaced by new groups in a shrinking recover(): kept alive while their
    abandoned work is in flight (for its late errors), but left out of later in-place
    recoveries."""
    for pg in pgs:
        pgstate.state_of(pg).retired = True


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
        st = pgstate.peek(pg) if pg is not None else None
        if pg is not None and id(pg) not in seen and not (st is not None and st.retired):
            seen.add(id(pg))
            out.append(pg)
    return out
