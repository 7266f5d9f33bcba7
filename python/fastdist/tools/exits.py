"""How a worker of ``fastdist run`` ended, in words: its exit, its exception's line and traceback
(from the error file torch's ``@record`` or fastdist.diagnostics.uncaught wrote), and the logs
spec that gives each start of one worker a folder of its own (fastdist.tools.launcher)."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs


@dataclass
class Raised:
    """A worker that ended with an exception, its replacement not yet decided."""

    seen: float  # time.monotonic() when the agent saw it end
    local_rank: int
    rank: int
    failure: Any  # torch's ProcessFailure


def error_line(failure: Any) -> str:
    """The exception's line (``ValueError: ...``) from the worker's error file, else torch's
    message (a signal's name, or where to read about tracebacks). torch leaves ``message`` as the
    file's whole record when the file is in ``@record``'s format."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", message)
    return str(message)


def error_type(failure: Any) -> str:
    """The exception's class name (``GroupAbortedError``), from :func:`error_line`."""
    return error_line(failure).split(":", 1)[0].strip().rsplit(".", 1)[-1]


def error_of(failure: Any) -> tuple[int, str]:
    """What tells two exception exits apart: the exit code and the exception's line (not the
    time, which the error file's record carries too)."""
    return failure.exitcode, error_line(failure)


def traceback_of(failure: Any) -> str | None:
    """The worker's traceback from its error file (``@record``'s or fastdist's), else None: the
    worker wrote no file and printed whatever it had itself."""
    data = failure.error_file_data.get("message")
    if isinstance(data, dict):
        stack = data.get("extraInfo", {}).get("py_callstack")
        if isinstance(stack, str) and stack.strip():
            return stack.rstrip("\n")
        data = data.get("message")
    if isinstance(data, str) and data and data != "<NONE>":
        return data
    return None


class PerStartLogs(LogsSpecs):
    """torch's logs spec, for a process context of one worker started at any time: its files go
    to a directory of their own (torch's spec empties one attempt's directory per start)."""

    def __init__(self, inner: LogsSpecs) -> None:
        super().__init__(inner._root_log_dir, inner._redirects, inner._tee, inner._local_ranks_filter)
        self._inner = inner
        self._starts = 0

    @property
    def root_log_dir(self) -> str:
        """The folder under which every start's logs go (torch's spec's)."""
        return self._inner.root_log_dir

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Where this start's output and error file go: torch's spec's, in a folder of this start."""
        self._starts += 1
        env = envs[0]
        tagged = dict(env)
        tagged["TORCHELASTIC_RESTART_COUNT"] = (
            f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}_start{self._starts}"
        )
        dest = self._inner.reify({0: tagged})
        env["TORCHELASTIC_ERROR_FILE"] = tagged.get("TORCHELASTIC_ERROR_FILE", "")
        return dest


# What a replacement's reduction raises before fastdist.sync_state gave it its slot (the stand-in
# backend's refusal, csrc/watched/solo.cpp).
NOT_JOINED = "is a replacement that has not joined the job yet"


def describe_exit(exitcode: int) -> str:
    """``exit by SIGKILL`` / ``exit code 1``."""
    if exitcode < 0:
        try:
            return f"exit by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"exit by signal {-exitcode}"
    return f"exit code {exitcode}"
