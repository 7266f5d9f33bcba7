"""fastdist: real deadlines for torch.distributed.

    from fastdist import barrier
    barrier(timeout=10)   # returns when all ranks arrived, or raises CollectiveTimeoutError

Importing fastdist starts no thread: the deadline engine starts with the first deadline.
"""

from __future__ import annotations

from ._groups import is_dead
from ._timeouts import (
    DeadlineScope,
    RendezvousTimeout,
    current_time,
    fail_after,
    fail_at,
    get_default_timeout,
    get_timeout_handler,
    set_default_timeout,
    set_timeout_handler,
)
from .collectives import all_gather, barrier
from .errors import CollectiveTimeoutError, FastdistError, GroupAbortedError

__version__ = "0.1.0"

__all__ = [
    "CollectiveTimeoutError",
    "DeadlineScope",
    "FastdistError",
    "GroupAbortedError",
    "RendezvousTimeout",
    "__version__",
    "all_gather",
    "barrier",
    "current_time",
    "fail_after",
    "fail_at",
    "get_default_timeout",
    "get_timeout_handler",
    "is_dead",
    "set_default_timeout",
    "set_timeout_handler",
]
