"""The process's settings, in one record (:data:`SETTINGS`): what the user chose through the API
(the default timeout, the timeout handler, RPC's default timeout, the checks, the group timeout
given to ``fastdist.init_process_group``), what the environment said at import
(``FASTDIST_CHECK``, ``FASTDIST_ABORT_TIMEOUT``), and whether fastdist watches the groups torch
makes. The functions that change them (``fastdist.set_default_timeout``,
``fastdist.set_timeout_handler``, ``fastdist.set_checks``, ``fastdist.rpc.init_rpc``,
``fastdist.init_process_group``) check what they are given and write here; nothing else does.

Imports nothing of fastdist: every layer reads it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def abort_timeout_from_env() -> float:
    """FASTDIST_ABORT_TIMEOUT (seconds, > 0; default 10), refused with its name when it is not."""
    text = os.environ.get("FASTDIST_ABORT_TIMEOUT", "10")
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:  # (NaN too)
        raise ValueError(f"FASTDIST_ABORT_TIMEOUT must be a number of seconds > 0 (inf: never), got {text!r}")
    return value


@dataclass
class Settings:
    """The process's settings (one instance: :data:`SETTINGS`)."""

    # fastdist.set_default_timeout: what ``timeout=None`` stands for (None: FASTDIST_TIMEOUT, else
    # 600 s; fastdist.get_default_timeout reads both).
    default_timeout: float | None = None
    # fastdist.set_timeout_handler: run in the thread that saw a timeout, before it raises.
    timeout_handler: Callable[[BaseException], Any] | None = None
    # fastdist.rpc.init_rpc's rpc_timeout: the default per-call timeout (None: RPC not started).
    rpc_timeout: float | None = None
    # FASTDIST_CHECK / fastdist.set_checks: the cross-rank checks before each op (read per op).
    checks: bool = False
    # FASTDIST_ABORT_TIMEOUT: how long torch's abort of a group's communicators may take before
    # fastdist gives up on it and ends the process.
    abort_timeout: float = 10.0
    # fastdist.init_process_group ran: every group made since is watched ...
    watching: bool = False
    # ... and this is the group timeout it was given (seconds), or None.
    group_timeout: float | None = None


SETTINGS = Settings(
    checks=os.environ.get("FASTDIST_CHECK", "") not in ("", "0"),
    abort_timeout=abort_timeout_from_env(),
)
