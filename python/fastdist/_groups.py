"""Process groups as fastdist sees them: resolving ``group=``, naming groups, and the registry
of groups that died.

A group whose collective timed out is dead: gloo closes its connections, and any later op on it
fails or hangs. fastdist remembers it and refuses every later call on it at once with
:class:`GroupAbortedError`. The registry also keeps the dead group alive on purpose: dropping the
last reference to a gloo group whose op is still in flight blocks the dropping thread in its
destructor until the op ends, and that must never be a user's thread in the middle of a call.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _Backend

from .errors import GroupAbortedError

logger = logging.getLogger(__name__)

_lock = threading.Lock()
# id(group) -> (group, reason). The group is held so that its id is not reused and its
# destructor does not run while an op may still be in flight.
_dead: dict[int, tuple[Any, str]] = {}


def resolve(group: Any) -> Optional[Any]:
    """The ProcessGroup for ``group=`` (``None`` = the default group), or ``None`` when this
    process is not a member of it. Raises for anything that is not a group."""
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError(
                "the default process group is not initialized: call "
                "torch.distributed.init_process_group() first, or pass group="
            )
        return dist.distributed_c10d._get_default_group()
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return None
    # A raw backend (e.g. a ProcessGroupGloo built by hand) has the same per-call API.
    if not isinstance(group, (dist.ProcessGroup, _Backend)):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}: {group!r}")
    return group


def name_of(pg: Any) -> str:
    """``"default"`` for the default group, else the group's torch name."""
    if dist.is_initialized() and pg is dist.distributed_c10d._get_default_group():
        return "default"
    return str(getattr(pg, "group_name", None) or dist.distributed_c10d._world.pg_names.get(pg, "?"))


def check_alive(pg: Any, op: str) -> None:
    """Raises GroupAbortedError at once if ``pg`` died earlier."""
    if _dead:
        entry = _dead.get(id(pg))
        if entry is not None:
            raise GroupAbortedError(op=op, group=name_of(pg), rank=pg.rank(), reason=entry[1])


def mark_dead(pg: Any, reason: str) -> None:
    with _lock:
        if id(pg) not in _dead:
            _dead[id(pg)] = (pg, reason)
            logger.warning("rank %d: group %r is aborted: %s", pg.rank(), name_of(pg), reason)


def is_dead(group: Any = None) -> bool:
    """Whether fastdist considers ``group`` (default: the default group) aborted."""
    pg = resolve(group)
    return pg is not None and id(pg) in _dead
