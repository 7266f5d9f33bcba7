"""The report a watched group's backends make in C++ when this process's Python cannot run at a
deadline (a thread holds the GIL in a long C call): what each generation of a group hands them
(see ``NativeReport`` in csrc/watched/watched.h; fastdist.store.board reads what they post).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..store import keys, seal


def _runs_no_python(store: Any) -> bool:
    """Whether every call on ``store`` stays in C++ (torch's own stores): a store written in
    Python (EtcdStore) would need the GIL that the native report is for."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return type(store) in (dist.TCPStore, dist.FileStore, dist.HashStore)


def arm(
    backends: list[Any],
    store: Any,
    group: str,
    generation: int,
    rank: int,
    global_rank: int,
    inboxes: list[str],
) -> None:
    """Gives a group's watched ``backends`` what they need to report a timeout in C++ when this
    process's Python cannot run at the deadline (a thread holds the GIL in a long C call): the
    board keys of ``group``'s ``generation`` in ``store`` and the ``inboxes`` this rank rings
    (see ``NativeReport`` in csrc/watched/watched.h). Called by pgstate when a watched group's
    state is made and at each new generation; a store whose calls need Python clears it."""
    if store is None or not _runs_no_python(store):
        for b in backends:
            b.clear_native_report()
        return
    prefix = keys.board(group, generation)
    fault, status, count = (f"{prefix}/{what}" for what in ("fault", "status", "count"))
    secret = (seal.secret() or b"").decode()  # (its records are signed as Python's are)
    for b in backends:
        b.set_native_report(
            store, group, generation, rank, global_rank, fault, status, count, inboxes, secret=secret
        )
