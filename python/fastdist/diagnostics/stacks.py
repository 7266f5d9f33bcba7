"""Where a thread is: the innermost frames of its Python stack, for the reports."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

_MAX_FRAMES = 6
_SKIP = (os.sep + "torch" + os.sep, os.sep + "fastdist" + os.sep, "<frozen ", os.sep + "threading.py")


def issuer(backends: list[Any]) -> int:
    """The thread that issued the group's latest op, if it still runs (a subgroup's ops often come
    from a thread of their own), else the main thread: where this rank is, as far as the group
    is concerned."""
    history = [h for b in backends for h in b.ctl.history()]
    if history:
        thread = int(max(history, key=lambda h: int(h["seq"]))["thread"])
        if thread in sys._current_frames():
            return thread
    return threading.main_thread().ident or 0


def stack_of(thread_ident: int) -> list[str]:
    """The innermost frames of a thread, innermost first, as ``file:line in function``: the
    caller's own code first (torch's and fastdist's frames are left out unless nothing else is)."""
    frame = sys._current_frames().get(thread_ident)
    frames: list[str] = []
    everything: list[str] = []
    while frame is not None and len(frames) < _MAX_FRAMES:
        code = frame.f_code
        text = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        everything.append(text)
        if not any(part in code.co_filename for part in _SKIP):
            frames.append(text)
        frame = frame.f_back
    return frames or everything[:_MAX_FRAMES]
