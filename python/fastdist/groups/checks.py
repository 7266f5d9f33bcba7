"""Opt-in cross-rank checks (``FASTDIST_CHECK=1`` or :func:`set_checks`): before each collective,
every rank publishes the op, dtypes and shapes it is about to use, and all ranks compare them.
That is every collective on a watched group, whoever issues it (torch.distributed, DDP, FSDP2:
the watched backend asks fastdist.ops.watching before it issues one), and fastdist's own
functions on any group. Point-to-point ops are not compared (only two ranks take part).

A mismatch would otherwise hang until the deadline (different collectives) or worse: gloo aborts
the whole process on an all_gather size mismatch. With checks on it becomes
:class:`CollectiveMismatchError` on every rank, raised before anything is sent. The price is a
few store round trips per collective (see bench/), so it is off by default.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING

from .._native import _watched
from ..deadlines import current_time
from ..errors import CollectiveMismatchError
from ..settings import SETTINGS
from ..store import keys

if TYPE_CHECKING:
    from .pgstate import GroupState

_POLL_SECONDS = 0.0005
_watched.set_checks_enabled(SETTINGS.checks)  # (FASTDIST_CHECK, read in fastdist.settings)


def set_checks(enabled: bool) -> None:
    """Turns the cross-rank collective checks on or off for this process. Every rank of a group
    must use the same setting."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}: {enabled!r}")
    SETTINGS.checks = enabled
    _watched.set_checks_enabled(enabled)


def checks_enabled() -> bool:
    """Whether cross-rank collective checks are on."""
    return SETTINGS.checks


def verify(st: GroupState, op: str, seq: int, signature: str, deadline: float) -> bool:
    """Publishes and compares signatures. Returns False if the deadline passed first (the
    caller reports the timeout); raises CollectiveMismatchError on a mismatch."""
    store = st.store
    if store is None or st.size <= 1:
        return True
    prefix = keys.key("check", st.name, st.generation)
    store.set(f"{prefix}/{seq}/{st.rank}", signature)
    wanted = [f"{prefix}/{seq}/{r}" for r in range(st.size)]
    while not store.check(wanted):
        if current_time() >= deadline:
            return False
        time.sleep(_POLL_SECONDS)
    sigs = {r: store.get(k).decode() for r, k in enumerate(wanted)}
    if seq > 2:
        # Every rank read the records of seq - 2 before it could issue seq - 1 (which completed
        # here, or this rank would not be at seq), so this rank's old record can go.
        store.delete_key(f"{prefix}/{seq - 2}/{st.rank}")
    counts = Counter(sigs.values())
    if len(counts) == 1:
        return True
    # The signature most ranks used is "expected"; ties go to the lowest rank's.
    expected = max(counts, key=lambda s: (counts[s], -min(r for r, x in sigs.items() if x == s)))
    differing = {st.global_rank(r): s for r, s in sigs.items() if s != expected}
    raise CollectiveMismatchError(
        op=op, seq=seq, group=st.name, rank=st.my_global_rank, expected=expected, differing=differing
    )
