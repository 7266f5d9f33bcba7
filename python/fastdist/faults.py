"""Fault injection for testing how a job behaves when a rank misbehaves.

    faults = [Fault("hang", rank=2, step=5), Fault("sigkill", rank=3, step=7)]
    for step in range(steps):
        if inject(faults, step) == "wrong_collective":
            fastdist.barrier(timeout=10)          # this rank does something else this step
        else:
            fastdist.all_reduce(grad, timeout=10)

Kinds: ``hang`` (block for ``seconds``, forever if None: alive, in no collective), ``sigstop``
(the process is stopped, as by a debugger or a stalled node), ``sigkill`` (killed at once),
``exit`` (``os._exit(exit_code)`` without cleanup, like a crash in native code), and
``wrong_collective`` (``inject`` returns ``"wrong_collective"``; the caller makes another
collective than its peers this step).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["KINDS", "Fault", "inject"]

KINDS = ("hang", "sigstop", "sigkill", "exit", "wrong_collective")


@dataclass(frozen=True)
class Fault:
    """A fault for :func:`inject`: ``kind`` (one of :data:`KINDS`) on rank ``rank`` at step
    ``step``; ``seconds``: how long a ``hang`` lasts (None: forever); ``exit_code``: an ``exit``'s
    status. A field out of range raises ValueError."""

    kind: str
    rank: int
    step: int
    seconds: float | None = None  # for "hang": how long; None = forever
    exit_code: int = 0  # for "exit"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        for name in ("rank", "step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if self.seconds is not None and not self.seconds > 0:
            raise ValueError(f"seconds must be positive or None, got {self.seconds!r}")


def inject(faults: Iterable[Fault], step: int, rank: int | None = None) -> str | None:
    """Carries out the fault scheduled for this rank (default: ``dist.get_rank()``) at ``step``.
    Returns ``"wrong_collective"`` when the caller should make a different collective, else
    None (also after a ``hang`` with ``seconds`` ends)."""
    me = dist.get_rank() if rank is None else rank
    for f in faults:
        if f.rank != me or f.step != step:
            continue
        if f.kind == "hang":
            end = float("inf") if f.seconds is None else time.monotonic() + f.seconds
            while time.monotonic() < end:
                time.sleep(min(1.0, max(0.0, end - time.monotonic())))
        elif f.kind == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif f.kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.kind == "exit":
            os._exit(f.exit_code)
        else:
            return "wrong_collective"
    return None
