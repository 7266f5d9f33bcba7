"""This process's job, in one record (:data:`JOB`), and the job's own keys in its store: which
ranks run, which died and how (written by ``fastdist run``'s agent), and where each spare learns
the rank it takes."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import keys, seal
from .bounded import GRACE_SECONDS, bounded

logger = logging.getLogger(__name__)

RUNNING = "running"
END = "end"


@dataclass
class World:
    """The world as this process sees it after shrinks and growths (fastdist.recovery.world and
    growing): its epoch, how many grow() calls since it changed, and what the watcher threads
    learnt (set from those threads, read by grow())."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    epoch: int = 0  # one more at each shrink or growth
    launched: int = 0  # the world size the job was launched with
    armed: bool = False  # the world is smaller than launched: grow() looks
    grower: bool = False  # this process joins by growing the world (until it has)
    calls: int = 0  # grow() calls since the world changed
    requested: bool = False  # rank 0: a grower asked to join
    target: int | None = None  # the call number at which every rank grows


@dataclass
class Job:
    """What this process knows of its job, written by fastdist.init_process_group and recovery
    and read by everything that needs the job rather than one group: its stores, what the default
    group was built with (to rebuild it), where the store is (for messages when it is gone), and
    the world after shrinks and growths."""

    store: Any = None  # the job's store (job-wide keys: deaths, spares, suspects); None without one
    root: Any = None  # the default group's store, through which recovery agrees
    backend: str | None = None  # what the default group was built with, for rebuilding it
    timeout: Any = None  # its timeout (a timedelta), or None for torch's default
    started: bool = False  # this process made its groups (a later init is no joiner's)
    group_name: str | None = None  # torch's name of the default group (its store prefix)
    reconnect: Callable[[], Any] | None = None  # a new connection to ``root`` (after a partition)
    location: str | None = None  # where the store lives: "HOST:PORT (in rank 0)"
    failure: str | None = None  # what the last failed store operation said
    world: World = field(default_factory=World)

    def store_gone_reason(self) -> str:
        """Says that the job's store is unreachable, and where it was."""
        where = f" at {self.location}" if self.location else ""
        return (
            f"the job's store{where} cannot be reached ({self.failure or 'connection lost'}): its host "
            "exited or was killed, and reports and recovery go through it"
        )

    def note_store_failure(self, exc: BaseException) -> None:
        """Keeps what a failed store operation said, for :meth:`store_gone_reason`."""
        text = str(exc).strip()
        self.failure = text.splitlines()[0] if text else type(exc).__name__


JOB = Job()


def running_key() -> str:
    """The store key that marks the job running: set by the ranks of its first start once their
    group is made (see fastdist.recovery.joining)."""
    return keys.key(RUNNING)


def spare_key(launch_rank: int) -> str:
    """Where the spare launched as ``launch_rank`` learns the rank it takes (or "end")."""
    return keys.key("spare", launch_rank)


def dead_key(rank: int) -> str:
    """The launcher's record of how ``rank``'s process ended."""
    return keys.key("dead", rank)


def inboxes_key() -> str:
    """The name of the workers' default group, under whose store prefix their fault inboxes are
    (the launcher puts death notices there)."""
    return keys.key("inboxes")


def deaths_key() -> str:
    """Every death the launcher saw, one JSON record a line (rank, how, pid, time)."""
    return keys.key("deaths")


def joined_key(rank: int) -> str:
    """Where a process that took ``rank``'s place says it joined the job (fastdist.sync_state gave
    it the slot): its pid. ``fastdist run`` fails the job when a replacement ends without it."""
    return keys.key("joined", rank)


def joined(rank: int, step: int | None = None) -> None:
    """Under ``fastdist run``: this process, a replacement or a spare, has joined the job as
    ``rank`` (see :func:`joined_key`), handed the state of ``step`` when its state says which."""
    store = JOB.store
    if store is None or os.environ.get(LAUNCHER_ENV) != "1":
        return
    record = json.dumps({"pid": os.getpid(), "step": step})
    try:
        bounded(lambda _a: store.set(joined_key(rank), record), GRACE_SECONDS, "telling the agent")
    except Exception as exc:  # noqa: BLE001 - the store is failing: the next fault says so
        logger.debug("could not tell fastdist run's agent that rank %d joined: %r", rank, exc)


def parse_joined(data: bytes) -> dict[str, Any]:
    """What :func:`joined` wrote: ``pid`` and ``step`` (None where the state did not say), or an
    empty dict for anything else."""
    try:
        record = json.loads(data.decode(errors="replace"))
    except ValueError:
        return {}
    if not isinstance(record, dict):
        return {}
    step = record.get("step")
    pid = record.get("pid")
    return {
        "pid": pid if isinstance(pid, int) else None,
        "step": step if isinstance(step, int) and not isinstance(step, bool) else None,
    }


def under_launcher() -> bool:
    """Whether ``fastdist run``'s agent launched this process (and reads the job's records)."""
    return JOB.store is not None and os.environ.get(LAUNCHER_ENV) == "1"


def suspects_key() -> str:
    """Ranks named missing by a live rank's timeout (they neither reached the op nor answered the
    ring: dead, stopped or stuck hard), and ranks that answered since, one JSON record a line:
    ``fastdist run``'s agent kills a rank that stays named (see fastdist.tools.launcher)."""
    return keys.key("suspects")


# Set by fastdist run in its workers' environment: a launcher that records deaths in the store.
LAUNCHER_ENV = "FASTDIST_RUN"
# ... and its own process id: its workers die with it (die_with_agent).
AGENT_PID_ENV = "FASTDIST_AGENT_PID"
# ... and a folder of its own where each worker's heartbeat thread touches a file named by its
# process id (start_heartbeat): the agent's sign that a worker its peers named missing is busy,
# not frozen. Outside the store: nobody but this node's processes can fake it.
HEARTBEAT_DIR_ENV = "FASTDIST_HEARTBEAT_DIR"
HEARTBEAT_EVERY = 1.0
# A death record's fields (the agent's record in deaths_key, and the one it rings each rank with).
DEATH_FIELDS: dict[str, type | tuple[type, ...]] = {"rank": int, "how": str, "time": (int, float)}


def deaths_since(since: float, ranks: list[int], wait: float, bound: float = math.inf) -> dict[int, str]:
    """How each of ``ranks`` that died at or after ``since`` (a time.time()) ended, as
    ``fastdist run``'s agent recorded it ("exit by SIGKILL"), waiting up to ``wait`` seconds for
    a record (the agent sees a death within its monitor interval, 0.1 s by default). Empty
    without such a launcher.

    The store lives in an agent, which may be frozen or gone with its node: the store work is
    bounded (``wait`` plus :data:`~fastdist.store.bounded.GRACE_SECONDS`, and at most ``bound``
    seconds), and a store that does not answer raises
    :class:`~fastdist.store.bounded.StoreUnanswered`; one that fails raises what torch raised."""
    store = JOB.store
    if store is None or os.environ.get(LAUNCHER_ENV) != "1":
        return {}

    def work(abandoned: threading.Event) -> dict[int, str]:
        end = time.monotonic() + wait
        while True:
            found: dict[int, str] = {}
            if store.check([deaths_key()]):
                for line in bytes(store.get(deaths_key())).decode(errors="replace").splitlines():
                    rec: Any = keys.parse_record(line, DEATH_FIELDS, "death record")
                    if rec is not None and rec["rank"] in ranks and rec["time"] >= since - 1.0:
                        found[rec["rank"]] = rec["how"]
            if found or time.monotonic() >= end or abandoned.is_set():
                return found
            time.sleep(0.02)

    return bounded(work, min(wait + GRACE_SECONDS, max(bound, 0.0)), "reading the launcher's death records")


def name_missing(ranks: list[int], by: int, what: str, since: float) -> None:
    """Under ``fastdist run``: tells the agent that ``ranks`` did not answer rank ``by``'s timeout
    of ``what`` ("all_reduce #43 on group 'default'"), an op that began at ``since`` (a
    time.time()): a process that took one of those ranks after that is not the one that failed
    to reach it. Best effort, bounded: the caller's error must not wait on a store that stopped
    answering."""
    now = time.time()
    _note([{"rank": r, "by": by, "what": what, "since": since, "time": now} for r in ranks])


def answering(rank: int) -> None:
    """Under ``fastdist run``: ``rank`` is alive and answering (it entered recover(), or joined the
    job): a suspicion of it from before is withdrawn."""
    _note([{"rank": rank, "answering": True, "time": time.time()}])


def _note(records: list[dict[str, Any]]) -> None:
    store = JOB.store
    if store is None or os.environ.get(LAUNCHER_ENV) != "1" or not records:
        return
    text = "".join(seal.seal_json(r) + "\n" for r in records)
    try:
        bounded(lambda _a: store.append(suspects_key(), text), GRACE_SECONDS, "telling the agent")
    except Exception as exc:  # noqa: BLE001 - the store is failing: the error the caller raises says so
        logger.debug("could not tell fastdist run's agent %s: %r", text.strip(), exc)


def die_with_agent() -> None:
    """Under ``fastdist run``, makes this worker die (SIGKILL) when its agent's process ends. torch
    starts each worker in a session of its own, so a worker outlives an agent that was killed; but
    a node's agent and workers are replaced together (a new agent restarts all of the node's ranks:
    fastdist.tools.nodes), and a worker left running would then hold a rank twice. An agent already
    gone when this runs (or a stale FASTDIST_AGENT_PID inherited by a process started by hand):
    RuntimeError, naming both variables. Linux only."""
    agent = os.environ.get(AGENT_PID_ENV, "")
    if os.environ.get(LAUNCHER_ENV) != "1" or not agent.isdigit() or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    if os.getppid() != int(agent):
        # Started through a wrapper (a shell script, say), or the agent is gone already: or a
        # process started by hand inherited a fastdist run worker's environment.
        try:
            os.kill(int(agent), 0)
        except ProcessLookupError:
            raise RuntimeError(
                f"fastdist: {LAUNCHER_ENV}=1 says fastdist run started this process, and its agent "
                f"({AGENT_PID_ENV}={agent}) is not running: the agent ended, or this process inherited a "
                f"worker's environment (unset {LAUNCHER_ENV} and {AGENT_PID_ENV} to run it by hand)"
            ) from None
        except PermissionError:
            pass
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != int(agent):  # the agent ended between the check and the line above
        os.kill(os.getpid(), signal.SIGKILL)


def heartbeat_file(folder: str, pid: int) -> str:
    """Where worker ``pid``'s heartbeat thread touches its file (see start_heartbeat)."""
    return os.path.join(folder, str(pid))


_heartbeat: list[threading.Thread] = []


def start_heartbeat() -> None:
    """Under ``fastdist run``: starts (once per process) a daemon thread that touches this
    process's file in the agent's heartbeat folder every HEARTBEAT_EVERY seconds. A worker busy
    in user code (an evaluation, a loader wait, a checkpoint write, a sleep) keeps it going, so
    the agent does not kill it as frozen (fastdist.tools.launcher); a stopped process, or one
    whose interpreter cannot run, stops it. Ends when the folder goes (the agent ended)."""
    folder = os.environ.get(HEARTBEAT_DIR_ENV, "")
    if os.environ.get(LAUNCHER_ENV) != "1" or not folder or not os.path.isdir(folder):
        return
    if _heartbeat and _heartbeat[0].is_alive() and _heartbeat[0].name == f"fastdist-heartbeat-{os.getpid()}":
        return
    path = heartbeat_file(folder, os.getpid())

    def beat() -> None:
        try:
            open(path, "a").close()
            while True:
                os.utime(path)
                time.sleep(HEARTBEAT_EVERY)
        except OSError:
            return  # the agent removed its folder: it is ending

    thread = threading.Thread(target=beat, name=f"fastdist-heartbeat-{os.getpid()}", daemon=True)
    thread.start()
    _heartbeat[:] = [thread]


def job_running(store: Any) -> bool:
    """Whether ``store`` marks the job running: a process that finds the mark before making its
    group is a joiner."""
    return bool(store.check([running_key()]))


def mark_running(store: Any) -> None:
    """Marks the job running in ``store`` (see :func:`job_running`)."""
    store.set(running_key(), "1")
