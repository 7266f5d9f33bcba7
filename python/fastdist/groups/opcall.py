"""What the paths that end an op in an error carry: one record instead of six positional values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .pgstate import GroupState


@dataclass(frozen=True)
class OpCall:
    """One op on a group: ``op`` (its name), the ProcessGroup ``pg`` and fastdist's state of it
    ``st``, its number ``seq`` there, and when it started and must end (``start``, ``deadline``:
    :func:`fastdist.current_time`'s clock). ``last_seen``: the op before it on the group."""

    op: str
    pg: Any
    st: GroupState
    seq: int
    start: float
    deadline: float
    last_seen: str | None = None

    @property
    def name(self) -> str:
        """``op #seq``, as the errors say it."""
        return f"{self.op} #{self.seq}"
