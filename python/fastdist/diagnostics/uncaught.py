"""A worker's uncaught exception, written where ``fastdist run`` reads it.

torch's elastic agent learns why a worker ended from the worker's error file
(``TORCHELASTIC_ERROR_FILE``), which only ``@record`` writes; without it the agent knows an exit
code and nothing else. Under ``fastdist run`` a worker writes its uncaught exception there itself
(torch's format, so ``ProcessFailure.message`` and the traceback read as with ``@record``), and
leaves the printing to the agent: when every rank hits the same bug, the agent shows one
traceback as the root cause rather than one per rank (fastdist.tools.launcher).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from types import TracebackType

from ..store import job

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def record_uncaught() -> None:
    """Under ``fastdist run``, makes this process's uncaught exception go to its error file in
    place of stderr (written once, at exit). A hook the script set itself is left alone."""
    if os.environ.get(job.LAUNCHER_ENV) != "1" or not os.environ.get(ERROR_FILE_ENV):
        return
    if sys.excepthook is not sys.__excepthook__:
        return
    sys.excepthook = _write_then_exit


def _write_then_exit(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    if not issubclass(kind, Exception) or not write_error_file(kind, value, tb):
        sys.__excepthook__(kind, value, tb)  # KeyboardInterrupt, or no file: Python's own print


def write_error_file(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> bool:
    """torch's error file (as ``ErrorHandler.record_exception`` writes it) for this exception;
    whether it was written."""
    path = os.environ.get(ERROR_FILE_ENV, "")
    data = {
        "message": {
            "message": f"{kind.__name__}: {value}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(kind, value, tb)),
                "timestamp": str(int(time.time())),
            },
        }
    }
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except (OSError, TypeError, ValueError):
        return False
    return True
