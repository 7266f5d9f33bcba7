"""Whether a worker that a live rank named missing is frozen or only busy, for ``fastdist run``'s
missing-worker rule (fastdist.tools.launcher, ``ReplacingAgent._kill_the_silent``): a worker is
killed only once it shows no sign of life for ``--kill-missing-after`` seconds. A sign of life is
its heartbeat thread answering (fastdist.store.job.start_heartbeat) or its process using CPU; a
stopped process, or one in uninterruptible sleep that uses no CPU, shows none."""

from __future__ import annotations

import math
import os
import time
from typing import Any

from ..store import job

# A worker named missing by a live rank's timeout, silent since, is killed (and so replaced) after
# this many seconds: the live ranks wait for it in recover() (the README's loop gives it 60 s).
KILL_MISSING_AFTER = 10.0
# How often the agent reads the workers' suspicions (one store read; the agent hosts the store).
SUSPECTS_EVERY = 0.5
# How long a process that took a dead rank's place may take to start and join (fastdist.sync_state)
# before the missing-worker rule applies to it: importing torch, building the model and loading
# the state take tens of seconds on a busy GPU host, and killing a replacement while it starts
# spends the job's replacements on one death.
START_GRACE = 300.0
# A replacement still starting after this many seconds is said to be slow (named once, with the
# grace it has): a healthy one imports torch and joins in a few seconds.
SLOW_START = 10.0
# A suspected worker shows a sign of life (it is busy, not frozen) when its heartbeat thread
# touched its file within this many seconds (fastdist.store.job.start_heartbeat), or when its
# process used at least BUSY_CPU_SHARE of a core since the agent's last look: then its kill clock
# starts again.
HEARTBEAT_STALE = 3.0 * job.HEARTBEAT_EVERY
BUSY_CPU_SHARE = 0.1


def sign_of_life(pid: int, cpu_seen: dict[int, tuple[float, float]]) -> str | None:
    """Why worker ``pid`` is busy rather than frozen, in words, or None:
    its heartbeat thread answers (fastdist.store.job.start_heartbeat), or its process used
    CPU since the agent's last look (``cpu_seen``: per pid, the CPU seconds and the time of that look;
    updated) (a long C call holding the GIL stops the heartbeat, not
    the CPU). A stopped process shows neither."""
    fields, now = stat_fields(pid), time.monotonic()
    if fields is None or fields[0] in ("T", "t"):  # gone, or stopped
        return None
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # user + system
    before = cpu_seen.get(pid)
    cpu_seen[pid] = (cpu, now)
    folder = os.environ.get(job.HEARTBEAT_DIR_ENV, "")
    # A main thread in uninterruptible sleep (a hung driver) is stuck whatever its
    # heartbeat thread does: only CPU counts then.
    if folder and fields[0] != "D":
        try:
            age = time.time() - os.stat(job.heartbeat_file(folder, pid)).st_mtime
        except OSError:
            age = math.inf
        if age < HEARTBEAT_STALE:
            return f"its heartbeat thread answered {max(age, 0.0):.1f} s ago"
    if before is None or not 0 < now - before[1] <= 4 * SUSPECTS_EVERY:
        return None  # (no recent look to compare with: the next one says)
    if (cpu - before[0]) / (now - before[1]) >= BUSY_CPU_SHARE:
        return f"it used {cpu - before[0]:.1f} s of CPU in the last {now - before[1]:.1f} s"
    return None


def since(rec: dict[str, Any]) -> float:
    """When the op a suspicion record names began (its writing time, for a record without it)."""
    since = rec.get("since")
    return float(since) if isinstance(since, (int, float)) else float(rec["time"])


def stat_fields(pid: int) -> list[str] | None:
    """Process ``pid``'s /proc/PID/stat after its name: [0] its state, [11] and [12] its user
    and system CPU ticks (all its threads); None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields if len(fields) > 12 and fields[11].isdigit() and fields[12].isdigit() else None


def process_state(pid: int) -> str:
    """What /proc says process ``pid`` is doing, in words."""
    fields = stat_fields(pid)
    if fields is None:
        return "gone or unreadable"
    state = fields[0]
    return {
        "T": "stopped (SIGSTOP or a debugger)",
        "t": "stopped by a debugger",
        "D": "in uninterruptible sleep (a driver or disk wait)",
        "R": "running",
        "S": "sleeping",
        "Z": "a zombie",
    }.get(state, f"in state {state}")
