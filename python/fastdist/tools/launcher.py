"""``fastdist run``: torchrun, except that a dead worker is replaced and the others keep running.

torch's elastic agent stops every worker of the group when one fails, and restarts them all
(``--max-restarts``). :class:`ReplacingAgent` is torch's ``LocalElasticAgent`` with one process
context per worker, so that one worker's death ends only that worker. When a worker dies the
agent records how (``dead/RANK`` in the job's store: the live ranks' errors and recovery read it),
then either gives its rank to a spare (it waits in ``fastdist.init_process_group`` on a key of
its own, which the agent writes) or starts one replacement process with the same RANK,
LOCAL_RANK and device. The live workers are in ``fastdist.recover(state=...)`` meanwhile, and the
newcomer joins them there (see fastdist.recovery.joining). When ``--max-replacements`` is spent, the
next death ends the job as torchrun would, non-zero, and the log tells every death and what was
done about it. A worker that ends with an exception (an exit code, not a signal) is not a dead
worker when other ranks end the same way within a few seconds, or when its rank's replacement
ends as it did: that is the script's own error, and a replacement would only hit it again. The
job then ends at once, non-zero, with the first traceback shown once as the root cause (each
worker writes its uncaught exception to its error file rather than stderr:
fastdist.diagnostics.uncaught). With several nodes (``--nnodes``, c10d rendezvous), an agent started while the
job runs takes the place of a node whose agent is gone (see fastdist.tools.nodes).

Everything else is torchrun's: its flags (``torch.distributed.run``'s parser), its rendezvous
and its launch (``torch.distributed.launcher.api.launch_agent``), with this agent in place of
``LocalElasticAgent``.

Why one file of about 800 lines: :class:`ReplacingAgent` is one class, as torch's agent runs one
monitor loop whose rules (replace, give a rank to a spare, the script's own error, the missing
worker, the lost node) share its state; what needs none of it is in fastdist.tools.exits,
fastdist.tools.liveness and fastdist.tools.launch_args.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import logging
import math
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any, NoReturn
from unittest import mock

from torch.distributed import DistNetworkError, PrefixStore, TCPStore
from torch.distributed.elastic.agent.server import local_elastic_agent
from torch.distributed.elastic.agent.server.api import RunResult, Worker, WorkerGroup, WorkerState
from torch.distributed.elastic.multiprocessing import start_processes
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from ..store import job, keys, ring, seal
from . import liveness, nodes
from .exits import (
    NOT_JOINED,
    PerStartLogs,
    Raised,
    describe_exit,
    error_line,
    error_of,
    error_type,
    traceback_of,
)
from .launch_args import busy_port_line, check_args, get_args_parser

logger = logging.getLogger(__name__)

# How long a worker that ended with an exception waits for its replacement, in case other ranks
# end the same way (the script's own error: no replacement then). Ranks that raise at the same
# step end within about a second of each other, interpreter teardown on a loaded 2-core machine
# included; a real death's replacement is delayed by this much, a SIGKILLed worker's not at all.
SAME_ERROR_WINDOW = 3.0

# The errors a death causes on the live ranks (fastdist.errors), and how long after the death an
# exception exit counts as caused by it (their deadline, the report and the exit, on a loaded host).
# How far back the suspicions of one stall go: a rank named missing again within this many
# seconds of the last time is taken for the same stall (steps and recoveries are bounded by minutes).
STALL_SPAN = 300.0
# A RecoveryError's tail naming the ranks the recovery waited for (fastdist.errors.RecoveryError).
_DID_NOT_TURN_UP = re.compile(r"\((ranks? [\d, ]+) did not turn up\)")
FAULT_ERRORS = {"GroupAbortedError", "CollectiveTimeoutError", "RecoveryError", "FastdistError"}
FAULT_WINDOW = 120.0


class StoreLost(Exception):
    """The job's store stopped answering this agent: the node that hosts it is lost (main() says
    so and exits 1; torch's ChildFailedError needs a failed worker of this node to name)."""


class ReplacingAgent(local_elastic_agent.LocalElasticAgent):
    """torch's LocalElasticAgent that replaces a dead worker instead of restarting the group."""

    def __init__(
        self,
        *args: Any,
        max_replacements: int = 3,
        spares: int = 0,
        link: nodes.NodeLink | None = None,
        kill_missing_after: float = liveness.KILL_MISSING_AFTER,
        node_wait: float = 60.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._link = link  # several nodes: this node's records in the rendezvous store
        self._logs_specs = PerStartLogs(self._logs_specs)
        self._contexts: dict[int, Any] = {}  # local rank -> its process context
        self._serves: dict[int, int] = {}  # local rank -> the global rank its process holds
        self._idle_spares: set[int] = set()  # local ranks of spares still waiting
        self._replacements_left = max_replacements
        self._spares = spares
        self._ended_spares = False
        self._job_client: Any = None
        self._raised: list[Raised] = []  # exception exits waiting for SAME_ERROR_WINDOW
        self._replaced_errors: dict[int, tuple[int, str]] = {}  # rank -> its last replaced one
        self.story: list[str] = []
        self.showed_root_cause = False
        self._kill_missing_after = kill_missing_after
        self._node_wait = node_wait  # how long a lost node's place waits for a new agent
        # Other nodes seen lost (their agent's beat stopped) with ranks named missing: group
        # rank -> (its slot, seconds its beat has not moved).
        self._lost_nodes: dict[int, tuple[nodes.Slot, float]] = {}
        # Local rank -> time.time() since when its process holds its rank (started, or promoted).
        self._serving_since: dict[int, float] = {}
        self._suspected: dict[int, float] = {}  # local rank -> when the agent first said so
        self._suspects_read = 0.0  # time.monotonic() of the last read
        self._suspects_failed = False  # a read failed (said once)
        # Process id -> (its CPU seconds, time.monotonic()) at the agent's last look, and the
        # local ranks said to be busy (once per suspicion).
        self._cpu_seen: dict[int, tuple[float, float]] = {}
        self._said_busy: set[int] = set()
        self._said_slow: set[int] = set()  # local ranks whose slow start was said
        self._said_joined: set[tuple[int, int]] = set()  # (local rank, pid) whose join was said
        self._started_at: dict[int, float] = {}  # local rank -> time.monotonic() its replacement began
        # Local rank -> (rank, pid) of a process that took a dead rank's place (a replacement or a
        # promoted spare) and has not said yet that it joined the job (fastdist.sync_state).
        self._unjoined: dict[int, tuple[int, int]] = {}
        self.verdict: str | None = None  # the job's last line, when the agent ends it on a rule
        self._deaths: list[tuple[float, int, str]] = []  # (time.monotonic(), rank, how): by signal

    # -- starting -------------------------------------------------------------------------------

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        link = self._link
        if link is None:
            super()._rendezvous(worker_group)
            return
        if link.slot is None:  # a first start: torch's rendezvous, then this node's record
            super()._rendezvous(worker_group)
            ranks = [w.global_rank for w in worker_group.workers]
            link.publish(
                nodes.Slot(
                    group_rank=worker_group.group_rank or 0,
                    group_world_size=worker_group.group_world_size or 1,
                    base_rank=min(ranks),
                    local_world_size=len(ranks),
                    world_size=worker_group.workers[0].world_size,
                    master_addr=str(worker_group.master_addr),
                    master_port=int(worker_group.master_port or 0),
                )
            )
            return
        # In a dead node's place: its slot, not a new round (which would restart the others).
        slot = link.slot
        size = worker_group.spec.local_world_size
        if size != slot.local_world_size:
            raise RuntimeError(f"node {slot.group_rank} ran {slot.local_world_size} workers, not {size}")
        worker_group.workers = [
            Worker(
                local_rank=i,
                global_rank=slot.base_rank + i,
                role_rank=slot.base_rank + i,
                world_size=slot.world_size,
                role_world_size=slot.world_size,
            )
            for i in range(size)
        ]
        self._store = link.store()
        wg: Any = worker_group  # (torch declares these fields as None until a rendezvous)
        wg.store = self._store
        wg.group_rank = slot.group_rank
        wg.group_world_size = slot.group_world_size
        wg.master_addr = slot.master_addr
        wg.master_port = slot.master_port
        self._say(
            f"in place of node {slot.group_rank} (its agent stopped answering): ranks "
            f"{slot.base_rank}-{slot.base_rank + size - 1} of {slot.world_size} start again"
        )

    def _exit_barrier(self) -> None:
        if self._link is None:
            super()._exit_barrier()  # type: ignore[no-untyped-call]
        elif not self._link.exit_barrier(self._exit_barrier_timeout):
            self._say(f"not every node finished within {self._exit_barrier_timeout:.0f} s")

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._contexts.clear()
        world = worker_group.workers[0].world_size if worker_group.workers else 0
        for w in worker_group.workers:
            self._start_one(worker_group, w)
            if w.global_rank >= world - self._spares:
                self._idle_spares.add(w.local_rank)
            else:
                self._serves[w.local_rank] = w.global_rank
        return {lr: ctx.pids()[0] for lr, ctx in self._contexts.items()}

    def _start_one(self, worker_group: WorkerGroup, worker: Any, rank: int | None = None) -> int:
        """Starts ``worker`` in a process context of its own (as ``rank``, for a replacement)."""
        w = copy.copy(worker)
        if rank is not None:
            w.global_rank = w.role_rank = rank
        sub = copy.copy(worker_group)
        sub.workers = [w]
        lr = w.local_rank

        def start_one(**kwargs: Any) -> Any:
            for name in ("args", "envs", "log_line_prefixes"):
                if kwargs.get(name) is not None:
                    kwargs[name] = {0: kwargs[name][lr]}
            return start_processes(**kwargs)

        # torch's _start_workers builds each worker's environment (RANK, LOCAL_RANK, MASTER_*, ...)
        # and starts one context for all: here, for this worker alone.
        with mock.patch.object(local_elastic_agent, "start_processes", start_one):
            super()._start_workers(sub)
        ctx = self._pcontext
        assert ctx is not None
        self._contexts[lr] = ctx
        self._serving_since[lr] = time.time()
        self._suspected.pop(lr, None)
        return int(ctx.pids()[0])

    # -- stopping -------------------------------------------------------------------------------

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, *args: Any, **kwargs: Any) -> None:
        # (torch 2.13 passes timeout=, older versions is_restart=: handed on as they came.)
        self._pcontext = None
        super()._shutdown(death_sig, *args, **kwargs)
        for ctx in self._contexts.values():
            ctx.close(death_sig)

    # -- watching -------------------------------------------------------------------------------

    def _job_store(self, worker_group: WorkerGroup) -> Any:
        """A client of the store the workers use (MASTER_ADDR:MASTER_PORT), fastdist's keys unprefixed."""
        if self._job_client is None:
            self._job_client = TCPStore(
                str(worker_group.master_addr),
                int(worker_group.master_port or 0),
                None,
                False,
                datetime.timedelta(seconds=30),
            )
        return self._job_client

    def _say(self, text: str) -> None:
        line = f"[fastdist run] {time.strftime('%H:%M:%S')} {text}"
        self.story.append(line)
        print(line, file=sys.stderr, flush=True)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self._link is not None:
            try:
                self._link.beat()
            except Exception as exc:  # noqa: BLE001 - torch's DistNetworkError and kin: the store is gone
                return self._store_lost(worker_group, exc)
        if self._unjoined:
            self._say_joined(worker_group)
        for lr, ctx in list(self._contexts.items()):
            result = ctx.wait(0)
            if result is not None and not result.is_failed() and lr in self._unjoined:
                verdict = self._ended_unjoined(worker_group, lr, None)
                if verdict is not None:
                    return verdict
            if result is None or not result.is_failed():
                continue
            failure = result.failures[0]
            del self._contexts[lr]
            verdict = self._replace(worker_group, lr, failure)
            if verdict is not None:
                return verdict
        if self._raised:
            return self._settle_raised(worker_group) or RunResult(state=WorkerState.HEALTHY)
        if (math.isfinite(self._kill_missing_after) or self._link is not None) and (
            time.monotonic() - self._suspects_read >= liveness.SUSPECTS_EVERY
        ):
            self._suspects_read = time.monotonic()
            read = self._read_suspects(worker_group)
            if read is not None and math.isfinite(self._kill_missing_after):
                self._kill_the_silent(*read)
            if read is not None and self._link is not None:
                verdict = self._lost_node(worker_group, *read[1:])
                if verdict is not None:
                    return verdict
        running = [lr for lr in self._contexts if self._contexts[lr].wait(0) is None]
        serving = [lr for lr in running if lr not in self._idle_spares]
        if not serving:
            if running and not self._ended_spares:
                store = self._job_store(worker_group)
                for lr in running:
                    store.set(job.spare_key(worker_group.workers[lr].global_rank), seal.seal(job.END))
                self._ended_spares = True
            if not running:
                done = {w.global_rank: None for w in worker_group.workers}
                return RunResult(state=WorkerState.SUCCEEDED, return_values=done)
        return RunResult(state=WorkerState.HEALTHY)

    def _say_joined(self, worker_group: WorkerGroup) -> None:
        """One line when a replacement (or a spare) has joined the job: the step it was handed
        (when its state says, see fastdist.store.job.joined) and how long after the death."""
        for lr, (rank, pid) in list(self._unjoined.items()):
            if (lr, pid) in self._said_joined:
                continue
            try:
                store = self._job_store(worker_group)
                if not store.check([job.joined_key(rank)]):
                    continue
                record = job.parse_joined(bytes(store.get(job.joined_key(rank))))
            except Exception:  # noqa: BLE001, S112 - the store is failing: said at the next poll or never
                continue
            self._said_joined.add((lr, pid))
            deaths = [d[0] for d in self._deaths if d[1] == rank]
            began = max(deaths) if deaths else self._started_at.get(lr)
            after = "" if began is None else f", {time.monotonic() - began:.1f} s after the death"
            at = "" if record.get("step") is None else f" at step {record['step']}"
            who = "replacement" if self._started_at.get(lr) is not None else "spare"
            self._say(f"rank {rank}'s {who} (pid {record.get('pid', pid)}) joined the job{at}{after}")

    def _read_suspects(
        self, worker_group: WorkerGroup
    ) -> tuple[Any, dict[int, dict[str, Any]], dict[int, float]] | None:
        """The job's store, and per rank its latest suspicion (fastdist.store.job.suspects_key)
        and when it last answered; None when there is none or the store is failing."""
        read = self._suspect_records(worker_group)
        if read is None:
            return None
        store, records = read
        suspicion: dict[int, dict[str, Any]] = {}
        answered: dict[int, float] = {}
        for rec in records:
            if rec.get("answering"):
                answered[rec["rank"]] = max(answered.get(rec["rank"], 0.0), float(rec["time"]))
            else:
                suspicion[rec["rank"]] = rec
        return store, suspicion, answered

    def _suspect_records(self, worker_group: WorkerGroup) -> tuple[Any, list[Any]] | None:
        """The job's store and its suspect records, in order (the signed ones); None when there
        are none or the store is failing."""
        try:
            store = self._job_store(worker_group)
            if not store.check([job.suspects_key()]):
                return None
            text = bytes(store.get(job.suspects_key())).decode(errors="replace")
        except Exception as exc:  # noqa: BLE001 - the store is failing: the ranks' deadlines still hold
            if not self._suspects_failed:  # once: this runs every liveness.SUSPECTS_EVERY
                self._suspects_failed = True
                logger.warning("fastdist run: could not read the workers' suspicions: %r", exc)
            return None
        parsed = (
            keys.parse_record(ln, {"rank": int, "time": (int, float)}, "suspect record")
            for ln in text.splitlines()
        )
        return store, [rec for rec in parsed if rec is not None]

    def _lost_node(
        self, worker_group: WorkerGroup, suspicion: dict[int, dict[str, Any]], answered: dict[int, float]
    ) -> RunResult | None:
        """Several nodes: a rank of another node named missing, whose node's agent has not beaten
        since (its node is lost: host, network or agent) and whose place no new agent took within
        ``--node-wait`` (a new agent beats on the slot it claims): the job ends, naming the node.
        Without this the live ranks' recoveries fail one after the other and this agent would
        replace its own healthy workers as they give up."""
        link = self._link
        if link is None or link.slot is None:
            return None
        here = set(self._serves.values())
        watched: set[int] = set()
        self._lost_nodes = {}
        try:
            for rank, rec in suspicion.items():
                if rank in here or liveness.since(rec) < answered.get(rank, 0.0):
                    continue
                slot = link.node_of(rank)
                if slot is None or slot.group_rank == link.slot.group_rank or slot.group_rank in watched:
                    continue
                watched.add(slot.group_rank)
                silent = link.silent_for(slot.group_rank)
                if silent >= nodes.STALE_AFTER:
                    self._lost_nodes[slot.group_rank] = (slot, silent)
        except Exception as exc:  # noqa: BLE001 - the rendezvous store is failing: the same agent hosts the job's
            return self._store_lost(worker_group, exc)
        for _, (slot, silent) in sorted(self._lost_nodes.items()):
            if silent < nodes.STALE_AFTER + self._node_wait:
                continue
            lr, rank = min(self._serves.items()) if self._serves else (0, worker_group.workers[0].global_rank)
            return self._end_job(
                worker_group,
                f"{slot.named()} is lost: its agent has not answered for {silent:.0f} s and no new agent "
                f"took its place within --node-wait {self._node_wait:g} s (start one with the same "
                "--rdzv-endpoint and --rdzv-id to replace a lost node)",
                rank,
                ProcessFailure(local_rank=lr, pid=os.getpid(), exitcode=1, error_file=""),
            )
        return None

    def _end_job(
        self, worker_group: WorkerGroup, verdict: str, rank: int, failure: Any, said: str = "stopping the job"
    ) -> RunResult:
        """Ends the job on one of the agent's rules: ``verdict`` is its last line (``said`` follows
        it in the story), this node's workers are stopped, and ``failure`` is ``rank``'s."""
        self.verdict = verdict
        self._say(f"{verdict}; {said}")
        self._stop_workers(worker_group)
        return RunResult(state=WorkerState.FAILED, failures={rank: failure})

    def _kill_the_silent(
        self, store: Any, suspicion: dict[int, dict[str, Any]], answered: dict[int, float]
    ) -> None:
        """A worker of this node that a live rank's timeout named missing, and that has not
        answered since (``suspicion``, ``answered``: _read_suspects), is named in the story with
        its process's state; still silent ``--kill-missing-after`` seconds later it is SIGKILLed,
        and so replaced, while the live ranks wait for it in recover(). A process frozen for good
        (SIGSTOP, a hung driver) would otherwise hold the job until their recovery fails. A
        suspicion counts only if the rank has not answered since the op it names began (a rank
        that was itself late, its deadline passed while it was stopped, names peers that have
        long since moved on)."""
        for lr, rank in list(self._serves.items()):
            rec = suspicion.get(rank)
            ctx = self._contexts.get(lr)
            if (
                rec is None
                or ctx is None
                or liveness.since(rec) < max(answered.get(rank, 0.0), self._serving_since.get(lr, 0.0))
            ):
                if self._suspected.pop(lr, math.inf) < math.inf:
                    self._say(f"rank {rank} (local rank {lr}) answered: not killed")
                self._said_busy.discard(lr)
                continue
            pid = int(ctx.pids()[0])
            if lr in self._unjoined and time.time() - self._serving_since.get(lr, 0.0) < liveness.START_GRACE:
                try:
                    starting = not store.check([job.joined_key(rank)])
                except Exception:  # noqa: BLE001 - the store is failing: not killed on a guess
                    starting = True
                if starting:
                    self._suspected.setdefault(lr, math.inf)
                    started = time.time() - self._serving_since.get(lr, 0.0)
                    if started >= liveness.SLOW_START and lr not in self._said_slow:
                        self._said_slow.add(lr)  # a healthy one joins in seconds: said only when slow
                        self._say(
                            f"rank {rank} (local rank {lr}, pid {pid}) is a replacement still starting "
                            f"{started:.0f} s after it was started (it has not joined the job yet): not "
                            f"killed before it joins or {liveness.START_GRACE:.0f} s pass"
                        )
                    continue
                if self._suspected.get(lr) == math.inf:
                    self._suspected.pop(lr)  # joined: the rule applies from now on
            life = liveness.sign_of_life(pid, self._cpu_seen)
            if life is not None and self._suspected.get(lr) != math.inf:
                # Busy in user code (an evaluation, a loader wait, a checkpoint write), not frozen:
                # its peers' recovery waits for it; killing it would lose its work and a
                # replacement. Its clock starts once it shows no sign of life.
                if lr not in self._said_busy:
                    self._said_busy.add(lr)
                    self._say(
                        f"rank {rank} (local rank {lr}, pid {pid}) did not answer rank {rec.get('by')} in "
                        f"{rec.get('what')}, but it is busy, not frozen ({life}): not killed while it "
                        "shows signs of life"
                    )
                self._suspected.pop(lr, None)
                continue
            if lr not in self._suspected:
                self._suspected[lr] = time.monotonic()
                self._say(
                    f"rank {rank} (local rank {lr}, pid {pid}) did not answer rank {rec.get('by')} in "
                    f"{rec.get('what')}: its process is {liveness.process_state(pid)}; killed in "
                    f"{self._kill_missing_after:g} s unless it answers (--kill-missing-after)"
                )
            elif time.monotonic() - self._suspected[lr] >= self._kill_missing_after:
                self._say(
                    f"rank {rank} (pid {pid}) still does not answer ({liveness.process_state(pid)}): killed, "
                    "to be replaced"
                )
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                self._suspected[lr] = math.inf  # said and done: its death comes through ctx.wait

    def _tell_the_living(self, worker_group: WorkerGroup, store: Any, record: dict[str, Any]) -> None:
        """Puts the death in every other rank's fault inbox (fastdist.ops.listener): on
        NCCL a peer's death may never end the collective the live ranks are in (a kernel spins
        until the deadline), so they hear it from here, at once. (gloo's ops fail as soon as the
        dead rank's connections close; its groups ignore this.)"""
        world = (worker_group.workers[0].world_size if worker_group.workers else 0) - self._spares
        notice = seal.seal_json({"kind": "death", **record})
        try:
            if not store.check([job.inboxes_key()]):
                return  # the job had not started (its default group's name is written then)
            # Where the workers' listeners wait: their default store, torch's group prefix under
            # fastdist's (fastdist.process_group).
            group = bytes(store.get(job.inboxes_key())).decode()
            inboxes = PrefixStore(f"{group}/", PrefixStore(keys.pg_prefix(), store))
            for r in range(world):
                if r != record["rank"]:
                    ring.deliver(inboxes, r, notice)
        except Exception as exc:  # noqa: BLE001 - the store is failing: the ranks' deadlines still hold
            logger.warning(
                "fastdist run: could not tell the live ranks of rank %s's death: %r", record["rank"], exc
            )

    def _replace(self, worker_group: WorkerGroup, lr: int, failure: Any) -> RunResult | None:
        """A worker died: recorded and told, then its rank given to a spare or a new process (an
        exception exit first waits to be told from the script's own error); a RunResult ends
        the job."""
        store = self._job_store(worker_group)
        how = describe_exit(failure.exitcode)
        if lr in self._idle_spares:
            self._idle_spares.discard(lr)
            self._say(f"spare (local rank {lr}, pid {failure.pid}) died while waiting ({how}): not promoted")
            return None
        if lr in self._unjoined and failure.exitcode > 0 and NOT_JOINED in (traceback_of(failure) or ""):
            verdict = self._ended_unjoined(worker_group, lr, failure)
            if verdict is not None:
                return verdict
        self._unjoined.pop(lr, None)
        rank = self._serves.pop(lr)
        record = {"rank": rank, "how": how, "pid": failure.pid, "time": time.time()}
        try:
            store.set(job.dead_key(rank), seal.seal_json(record))
            store.append(job.deaths_key(), seal.seal_json(record) + "\n")
        except Exception as exc:  # noqa: BLE001 - torch's DistNetworkError and kin: the store is gone
            return self._store_lost(worker_group, exc, (rank, lr, failure))
        self._tell_the_living(worker_group, store, record)
        if failure.exitcode > 0:
            # Not a death: the process raised (a healthy rank whose recovery failed, say). Said as
            # the type it raised, not as "died" (its message is shown once, further on).
            said = error_line(failure).split(":", 1)[0].strip()
            if traceback_of(failure) is None or not said.replace(".", "").isidentifier():
                said = "no error file; its output above says why"
            self._say(
                f"rank {rank} (local rank {lr}, pid {failure.pid}) ended with an exception ({how}): {said}"
            )
        else:
            self._say(f"rank {rank} (local rank {lr}, pid {failure.pid}) died: {how}")
            self._deaths.append((time.monotonic(), rank, how))
        if failure.exitcode > 0 and self._lost_nodes:
            # A healthy rank that gave up on a recovery the lost node's ranks never came to: a
            # replacement would wait for them too.
            _, (slot, silent) = min(self._lost_nodes.items())
            return self._end_job(
                worker_group,
                f"{slot.named()} is lost (its agent has not answered for {silent:.0f} s), and rank {rank} "
                f"ended on it ({how}): not replaced",
                rank,
                failure,
            )
        if failure.exitcode > 0:  # an exception: perhaps the script's own error (_settle_raised)
            self._raised.append(Raised(time.monotonic(), lr, rank, failure))
            if self._replaced_errors.get(rank) == error_of(failure):
                return self._script_error(worker_group, f"as the process it replaced did ({how})")
            return None
        return self._give_rank(worker_group, lr, rank, failure)

    def _ended_unjoined(self, worker_group: WorkerGroup, lr: int, failure: Any) -> RunResult | None:
        """A process that took a dead rank's place ended (``failure``: None for exit 0) without
        having joined the job: it never called fastdist.sync_state, so it never trained with the
        job (its reductions are refused before it joins): whatever it computed, saved or printed
        was its own alone. Another replacement would do the same: the job ends, saying why."""
        rank, pid = self._unjoined.pop(lr)
        try:
            if self._job_store(worker_group).check([job.joined_key(rank)]):
                return None
        except Exception as exc:  # noqa: BLE001 - torch's DistNetworkError and kin: the store is gone
            return self._store_lost(worker_group, exc)
        how = (
            "exited 0" if failure is None else f"ended with an exception ({describe_exit(failure.exitcode)})"
        )
        verdict = (
            f"rank {rank}'s replacement (local rank {lr}, pid {pid}) {how} without having joined the "
            "job: the script never calls fastdist.sync_state(state), so the replacement would train "
            "alone and its results would not be the job's. Call fastdist.sync_state(state) after "
            "building the model and before the first step (fastdist.accelerate and fastdist.lightning "
            "call it for you)"
        )
        ended = failure or ProcessFailure(local_rank=lr, pid=pid, exitcode=0, error_file="")
        result = self._end_job(worker_group, verdict, rank, ended, said="no replacement; stopping the job")
        if failure is not None:
            self._show_error(f"rank {rank}'s replacement's error (pid {pid})", failure)
        return result

    def _store_lost(
        self, worker_group: WorkerGroup, exc: BaseException, ended: tuple[int, int, Any] | None = None
    ) -> NoReturn:
        """The job's store (or, with several nodes, the rendezvous store: the same agent hosts
        both) does not answer: the node whose agent hosts it is lost. Without it nobody can
        recover or join: the job ends, and the story says that a node went, rather than that this
        node's ranks died of themselves. ``ended``: (rank, local rank, failure) of the worker whose
        end was being recorded."""
        where = f"{worker_group.master_addr}:{worker_group.master_port}"
        if self._link is not None:
            where = f"{self._link.endpoint} (the rendezvous endpoint)"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        said = ""
        if ended is not None:
            rank, lr, failure = ended
            how = describe_exit(failure.exitcode)
            said = f"rank {rank} (local rank {lr}, pid {failure.pid}) ended ({how}); "
        self._say(
            f"{said}the job's store at {where} does not answer ({first}): the node whose agent hosts it "
            "is lost, and no rank can recover or join without it: stopping this node's workers"
        )
        self._stop_workers(worker_group)
        raise StoreLost(f"the node whose agent hosts the job's store ({where}) is lost")

    def _settle_raised(self, worker_group: WorkerGroup) -> RunResult | None:
        """Exception exits: several within SAME_ERROR_WINDOW are the script's own error; one
        alone, once the window has passed, is a dead worker, replaced."""
        if len(self._raised) > 1:
            return self._script_error(worker_group, f"within {SAME_ERROR_WINDOW:.0f} s of each other")
        alone = self._raised[0]
        if time.monotonic() - alone.seen < SAME_ERROR_WINDOW:
            return None
        self._raised.clear()
        self._replaced_errors[alone.rank] = error_of(alone.failure)
        self._show_error(f"rank {alone.rank}'s error (pid {alone.failure.pid})", alone.failure)
        return self._give_rank(worker_group, alone.local_rank, alone.rank, alone.failure)

    def _script_error(self, worker_group: WorkerGroup, why: str) -> RunResult:
        """Ends the job on the script's own error: every worker stopped, no replacement, the
        first traceback shown once as the root cause and the other ranks' errors in a line each."""
        raised, self._raised = self._raised, []
        ranks = ", ".join(str(r.rank) for r in raised)
        death = self._first_cause(raised)
        if death is not None:
            # A death came first, and these errors are the faults it caused on the live ranks
            # (a loop that does not recover, say): the death is the cause, their errors details.
            self.verdict = (
                f"rank {death[1]} died ({death[2]}), and then rank{'s' if len(raised) > 1 else ''} {ranks} "
                f"ended with the fault{'s' if len(raised) > 1 else ''} it caused "
                f"({', '.join(sorted({error_type(r.failure) for r in raised}))}): the job "
                "cannot go on without their state (a loop that calls fastdist.recover() on a FastdistError "
                "survives this)"
            )
            self._say(self.verdict + "; stopping the job")
            self._stop_workers(worker_group)
            for r in raised:
                self._show_error(
                    f"rank {r.rank}'s error (pid {r.failure.pid}), after rank {death[1]}'s death", r.failure
                )
            return RunResult(state=WorkerState.FAILED, failures={r.rank: r.failure for r in raised})
        stall = self._stall_verdict(worker_group, raised)
        if stall is not None:
            self.verdict = stall
            self._say(stall + "; stopping the job")
            self._stop_workers(worker_group)
            for r in raised:
                line = error_line(r.failure)
                print(f"[fastdist run] rank {r.rank} (pid {r.failure.pid}): {line}", file=sys.stderr)
            self.showed_root_cause = True
            return RunResult(state=WorkerState.FAILED, failures={r.rank: r.failure for r in raised})
        self._say(
            f"rank{'s' if len(raised) > 1 else ''} {ranks} ended with an exception {why}: the "
            "script's own error, not a dead worker: no replacement; stopping the job"
        )
        self._stop_workers(worker_group)
        root = raised[0]
        self._show_error(f"root cause: rank {root.rank} (pid {root.failure.pid})", root.failure)
        for other in raised[1:]:
            same = error_of(other.failure) == error_of(root.failure)
            what = "the same error" if same else error_line(other.failure)
            if traceback_of(other.failure) is None:
                what = describe_exit(other.failure.exitcode) + " (its output above says why)"
            print(f"[fastdist run] rank {other.rank} (pid {other.failure.pid}): {what}", file=sys.stderr)
        self.showed_root_cause = True
        return RunResult(state=WorkerState.FAILED, failures={r.rank: r.failure for r in raised})

    def _stall_verdict(self, worker_group: WorkerGroup, raised: list[Raised]) -> str | None:
        """When every exception exit is a live rank's RecoveryError that waited for ranks which
        did not turn up and did not die (a stall that outlived the recovery): the verdict naming
        the stalled ranks, how long each has been stalled (since a live rank named it missing),
        its process's state, and the timeouts that bound it; else None."""
        missing: set[int] = set()
        for r in raised:
            found = _DID_NOT_TURN_UP.search(error_line(r.failure))
            if error_type(r.failure) != "RecoveryError" or found is None:
                return None
            missing |= {int(n) for n in re.findall(r"\d+", found.group(1))}
        missing -= {r.rank for r in raised}
        dead = {d[1] for d in self._deaths}
        if not missing or missing & dead:
            return None
        read = self._suspect_records(worker_group)
        records = read[1] if read is not None else []
        said = []
        for rank in sorted(missing):
            rec = _stall_began(records, rank)
            lr = next((lr for lr, rk in self._serves.items() if rk == rank), None)
            ctx = self._contexts.get(lr) if lr is not None else None
            how = f"rank {rank}"
            if rec is not None:
                ago = time.time() - liveness.since(rec)
                how += f" stalled: named missing in {rec.get('what')} {ago:.0f} s ago"
            else:
                how += " stalled"
            if ctx is not None and ctx.wait(0) is None:
                how += f" (its process is alive: {liveness.process_state(int(ctx.pids()[0]))})"
            said.append(how)
        ranks = ", ".join(str(r) for r in sorted(r.rank for r in raised))
        return (
            f"{'; '.join(said)}, and did not return within the live ranks' recovery: rank"
            f"{'s' if len(raised) > 1 else ''} {ranks} waited for it in recover() until its timeout and "
            "ended with RecoveryError. A stalled rank must be back within the step's deadline plus "
            "recover()'s timeout (step_timeout + recover_timeout, docs/frameworks.md): raise "
            "recover_timeout, or pass --kill-missing-after S so that a worker silent that long is "
            "killed and replaced"
        )

    def _first_cause(self, raised: list[Raised]) -> tuple[float, int, str] | None:
        """The death by signal that the exception exits ``raised`` followed (within FAULT_WINDOW
        before the first of them), when every one of them ended on a fastdist fault (the errors a
        death causes on the live ranks); else None: the script's own error."""
        first = min(r.seen for r in raised)
        deaths = [d for d in self._deaths if first - FAULT_WINDOW <= d[0] <= first]
        faults = all(error_type(r.failure) in FAULT_ERRORS for r in raised)
        return deaths[-1] if deaths and faults else None

    def _show_error(self, title: str, failure: Any) -> None:
        """The traceback a worker wrote to its error file (it printed none), once, on stderr."""
        text = traceback_of(failure)
        if text is None:
            text = f"{describe_exit(failure.exitcode)}: no error file; its output above says why"
        print(f"[fastdist run] {title}:\n{text}", file=sys.stderr, flush=True)

    def _give_rank(self, worker_group: WorkerGroup, lr: int, rank: int, failure: Any) -> RunResult | None:
        """The dead ``rank`` (its process was local rank ``lr``) to a spare or a new process; a
        RunResult ends the job."""
        store = self._job_store(worker_group)
        try:
            store.delete_key(job.joined_key(rank))  # the process that held it said so, not the next
        except Exception:  # noqa: BLE001, S110 - a store without delete: the key is absent then anyway
            pass
        if self._idle_spares:
            spare = min(self._idle_spares)
            self._idle_spares.discard(spare)
            self._unjoined[spare] = (rank, next(iter(self._contexts[spare].pids().values()), -1))
            self._serves[spare] = rank
            self._serving_since[spare] = time.time()
            self._suspected.pop(spare, None)
            store.set(job.spare_key(worker_group.workers[spare].global_rank), seal.seal(str(rank)))
            self._say(f"rank {rank} goes to a waiting spare (local rank {spare})")
            return None
        if self._replacements_left > 0:
            self._replacements_left -= 1
            pid = self._start_one(worker_group, worker_group.workers[lr], rank=rank)
            self._unjoined[lr] = (rank, pid)
            self._started_at[lr] = time.monotonic()
            self._said_slow.discard(lr)
            self._serves[lr] = rank
            self._say(
                f"rank {rank}: replacement started (pid {pid}), {self._replacements_left} replacements left"
            )
            return None
        self._say(f"rank {rank}: no replacement left (--max-replacements spent): stopping the job")
        self._stop_workers(worker_group)
        return RunResult(state=WorkerState.FAILED, failures={rank: failure})


def _stall_began(records: list[Any], rank: int) -> dict[str, Any] | None:
    """Where ``rank``'s latest stall began: of the suspect records naming it, the earliest within
    STALL_SPAN of the latest (a rank that stalls is named again by each recovery that waits for it;
    a busy rank's answers prove it alive, not done); None when none names it."""
    named = [r for r in records if r["rank"] == rank and not r.get("answering")]
    if not named:
        return None
    latest = max(liveness.since(r) for r in named)
    first: dict[str, Any] = min(
        (r for r in named if liveness.since(r) >= latest - STALL_SPAN), key=liveness.since
    )
    return first


def main(argv: Sequence[str] | None = None) -> int:
    """``fastdist run ARGS``: parses and checks torchrun's and fastdist's flags, then runs torchrun
    with :class:`ReplacingAgent` in place of its agent; returns the exit code (1 when the job
    failed, after the story of what happened)."""
    args = get_args_parser().parse_args(argv)
    _, max_nodes = check_args(args)
    link: nodes.NodeLink | None = None
    if max_nodes > 1:
        link = nodes.NodeLink(args.rdzv_endpoint, args.rdzv_id)
        if link.job_running():
            nproc = int(args.nproc_per_node) if str(args.nproc_per_node).isdigit() else None
            print(
                f"[fastdist run] job {args.rdzv_id!r} runs at {args.rdzv_endpoint}: waiting up to "
                f"{args.node_wait:.0f} s for a node whose agent is gone, to take its place",
                file=sys.stderr,
                flush=True,
            )
            if link.claim(nproc, args.node_wait) is None:
                raise SystemExit(
                    f"fastdist run: job {args.rdzv_id!r} runs and every node's agent answers: this "
                    "agent can only take a dead node's place (a new round would restart every worker)"
                )
    os.environ["FASTDIST_SPARES"] = str(args.spares)
    os.environ[job.LAUNCHER_ENV] = "1"  # the workers' errors may read the deaths recorded
    os.environ[job.AGENT_PID_ENV] = str(os.getpid())  # and they die with this process
    # The job's secret: the records that act (faults, suspects, deaths, spares, joiners, layouts)
    # are signed with it, and a record without it is ignored (fastdist.store.seal). It reaches
    # the workers through their environment, never through the store.
    if not os.environ.get(seal.SECRET_ENV):
        if max_nodes == 1:
            os.environ[seal.SECRET_ENV] = secrets.token_hex(32)
        else:
            print(
                f"[fastdist run] {seal.SECRET_ENV} is not set: the job's store records are not signed, "
                "and anything that reaches the store can abort, kill or steer this job's workers; set it "
                "to the same value on every node (export FASTDIST_JOB_SECRET=$(openssl rand -hex 32))",
                file=sys.stderr,
                flush=True,
            )
    # Where they show they are alive though busy (their heartbeat threads: fastdist.tools.liveness).
    heartbeats = tempfile.mkdtemp(prefix="fastdist-heartbeat-")
    os.environ[job.HEARTBEAT_DIR_ENV] = heartbeats

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher import api as launcher_api

    agents: list[ReplacingAgent] = []

    def make_agent(*a: Any, **kw: Any) -> ReplacingAgent:
        agent = ReplacingAgent(
            *a,
            max_replacements=args.max_replacements,
            spares=args.spares,
            link=link,
            kill_missing_after=args.kill_missing_after,
            node_wait=args.node_wait,
            **kw,
        )
        agents.append(agent)
        return agent

    try:
        with mock.patch.object(launcher_api, "LocalElasticAgent", make_agent):
            torchrun.run(args)  # type: ignore[no-untyped-call]
    except ChildFailedError as exc:
        why = error_line(exc.get_first_failure()[1]) or exc
        if any(agent.showed_root_cause for agent in agents):
            why = "the script's own error (root cause above)"
        why = next((agent.verdict for agent in agents if agent.verdict), why)
        print(f"[fastdist run] the job failed: {why}", file=sys.stderr)
        return 1
    except StoreLost as exc:
        print(f"[fastdist run] the job failed: {exc}", file=sys.stderr)
        return 1
    except RendezvousConnectionError as exc:
        # torch's agent loop met the lost store first (its rendezvous polls it between our
        # checks); its shutdown has stopped this node's workers.
        where = f"{args.rdzv_endpoint} (the rendezvous endpoint)"
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        line = (
            f"the job's store at {where} does not answer ({first}): the node whose agent hosts it is "
            "lost, and no rank can recover or join without it: this node's workers were stopped"
        )
        if agents:
            agents[-1]._say(line)
        print(
            f"[fastdist run] the job failed: the node whose agent hosts the job's store ({where}) is lost",
            file=sys.stderr,
        )
        return 1
    except DistNetworkError as exc:
        # Taken between check_args and the store's bind (torch says so in a traceback).
        taken = re.search(r"port: (\d+)\b.*EADDRINUSE", str(exc))
        if taken is None:
            raise
        flag = "--master-port" if args.rdzv_backend == "static" else "--rdzv-endpoint"
        print(f"fastdist run: {busy_port_line(int(taken.group(1)), flag)}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(heartbeats, ignore_errors=True)
        for agent in agents:
            if agent.story:
                print("[fastdist run] what happened:\n  " + "\n  ".join(agent.story), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
