"""fastdist's exceptions.

Every error carries the fields a person needs to act on it and builds its message from them.
All of them pickle (they cross process boundaries in multi-process tools and in RPC), and every
timeout error is also a builtin :class:`TimeoutError`, so ``except TimeoutError`` catches it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Sequence

__all__ = [
    "FastdistError",
    "CollectiveTimeoutError",
    "GroupAbortedError",
]


def _rebuild(cls: type[FastdistError], fields: dict[str, Any]) -> FastdistError:
    return cls(**fields)


def _fmt_seconds(value: Optional[float]) -> str:
    if value is None:
        return "?"
    return f"{value:.3g} s" if value < 10 else f"{value:.1f} s"


def _fmt_ranks(ranks: Sequence[int]) -> str:
    ranks = list(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


class FastdistError(Exception):
    """Base of every error fastdist raises on its own account.

    Subclasses list their fields in ``_fields``; the constructor takes them as keyword
    arguments, stores them as attributes, and the message comes from ``_message()``.
    """

    _fields: ClassVar[tuple[str, ...]] = ("message",)

    def __init__(self, message: str = "", **fields: Any) -> None:
        if type(self)._fields == ("message",):
            fields["message"] = message
        elif message:
            raise TypeError(f"{type(self).__name__} builds its message from its fields; pass them by keyword")
        unknown = set(fields) - set(self._fields)
        if unknown:
            raise TypeError(f"{type(self).__name__} got unknown fields: {sorted(unknown)}")
        for name in self._fields:
            setattr(self, name, fields.get(name))
        super().__init__(self._message())

    def _message(self) -> str:
        return str(getattr(self, "message", "") or "")

    def _field_values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._fields}

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self._field_values()))


class CollectiveTimeoutError(FastdistError, TimeoutError):
    """A collective did not finish before its deadline.

    Fields: ``op`` (e.g. ``"barrier"``), ``rank`` and ``world_size`` (within ``group``),
    ``group`` (its name, ``"default"`` for the default group), ``timeout`` (the budget in
    seconds the call had), ``elapsed`` (seconds it waited), ``missing_ranks`` (the ranks that
    never arrived, when known, else ``None``) and ``cause`` (what the backend said, if the
    backend noticed first).
    """

    _fields = ("op", "rank", "world_size", "group", "timeout", "elapsed", "missing_ranks", "cause")

    op: str
    rank: int
    world_size: int
    group: str
    timeout: float
    elapsed: float
    missing_ranks: Optional[list[int]]
    cause: Optional[str]

    def _message(self) -> str:
        text = (
            f"{self.op} on group {self.group!r} timed out after {_fmt_seconds(self.timeout)} "
            f"on rank {self.rank} of {self.world_size} (waited {_fmt_seconds(self.elapsed)})"
        )
        if self.missing_ranks:
            text += f": {_fmt_ranks(self.missing_ranks)} never arrived"
        if self.cause:
            text += f" [{self.cause}]"
        return text


class GroupAbortedError(FastdistError):
    """A call on a process group that is no longer usable.

    Raised at once by any fastdist call on a group after a collective on it timed out (gloo
    closes the group's connections then, and every later op would fail or hang), or when the
    backend reported that a peer closed the group mid-collective. Fields: ``op`` (the call that
    was refused or failed), ``group``, ``rank`` and ``reason`` (what killed the group: the
    original timeout's message, or the backend's words).
    """

    _fields = ("op", "group", "rank", "reason")

    op: str
    group: str
    rank: int
    reason: str

    def _message(self) -> str:
        return (
            f"{self.op} on group {self.group!r} on rank {self.rank}: the group is aborted "
            f"({self.reason}); destroy it and create a new one"
        )
