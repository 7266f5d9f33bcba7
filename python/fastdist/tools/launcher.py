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
done about it.

Everything else is torchrun's: its flags (``torch.distributed.run``'s parser), its rendezvous
and its launch (``torch.distributed.launcher.api.launch_agent``), with this agent in place of
``LocalElasticAgent``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any
from unittest import mock

from torch.distributed import TCPStore
from torch.distributed.elastic.agent.server import local_elastic_agent
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.multiprocessing import start_processes
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

from ..store import job

logger = logging.getLogger(__name__)


class _PerStartLogs(LogsSpecs):
    """torch's logs spec, for a process context of one worker started at any time: its files go
    to a directory of their own (torch's spec empties one attempt's directory per start)."""

    def __init__(self, inner: LogsSpecs) -> None:
        super().__init__(inner._root_log_dir, inner._redirects, inner._tee, inner._local_ranks_filter)
        self._inner = inner
        self._starts = 0

    @property
    def root_log_dir(self) -> str:
        return self._inner.root_log_dir

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        self._starts += 1
        env = envs[0]
        tagged = dict(env)
        tagged["TORCHELASTIC_RESTART_COUNT"] = (
            f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}_start{self._starts}"
        )
        dest = self._inner.reify({0: tagged})
        env["TORCHELASTIC_ERROR_FILE"] = tagged.get("TORCHELASTIC_ERROR_FILE", "")
        return dest


def describe_exit(exitcode: int) -> str:
    """``exit by SIGKILL`` / ``exit code 1``."""
    if exitcode < 0:
        try:
            return f"exit by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"exit by signal {-exitcode}"
    return f"exit code {exitcode}"


class ReplacingAgent(local_elastic_agent.LocalElasticAgent):
    """torch's LocalElasticAgent that replaces a dead worker instead of restarting the group."""

    def __init__(self, *args: Any, max_replacements: int = 3, spares: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._logs_specs = _PerStartLogs(self._logs_specs)
        self._contexts: dict[int, Any] = {}  # local rank -> its process context
        self._serves: dict[int, int] = {}  # local rank -> the global rank its process holds
        self._idle_spares: set[int] = set()  # local ranks of spares still waiting
        self._replacements_left = max_replacements
        self._spares = spares
        self._ended_spares = False
        self._job_client: Any = None
        self.story: list[str] = []

    # -- starting -------------------------------------------------------------------------------

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
        for lr, ctx in list(self._contexts.items()):
            result = ctx.wait(0)
            if result is None or not result.is_failed():
                continue
            failure = result.failures[0]
            del self._contexts[lr]
            verdict = self._replace(worker_group, lr, failure)
            if verdict is not None:
                return verdict
        running = [lr for lr in self._contexts if self._contexts[lr].wait(0) is None]
        serving = [lr for lr in running if lr not in self._idle_spares]
        if not serving:
            if running and not self._ended_spares:
                store = self._job_store(worker_group)
                for lr in running:
                    store.set(job.spare_key(worker_group.workers[lr].global_rank), job.END)
                self._ended_spares = True
            if not running:
                done = {w.global_rank: None for w in worker_group.workers}
                return RunResult(state=WorkerState.SUCCEEDED, return_values=done)
        return RunResult(state=WorkerState.HEALTHY)

    def _replace(self, worker_group: WorkerGroup, lr: int, failure: Any) -> RunResult | None:
        """A worker died: give its rank to a spare or a new process; a RunResult ends the job."""
        store = self._job_store(worker_group)
        how = describe_exit(failure.exitcode)
        if lr in self._idle_spares:
            self._idle_spares.discard(lr)
            self._say(f"spare (local rank {lr}, pid {failure.pid}) died while waiting ({how}): not promoted")
            return None
        rank = self._serves.pop(lr)
        record = {"rank": rank, "how": how, "pid": failure.pid, "time": time.time()}
        store.set(job.dead_key(rank), json.dumps(record))
        store.append(job.deaths_key(), json.dumps(record) + "\n")
        self._say(f"rank {rank} (local rank {lr}, pid {failure.pid}) died: {how}")
        if self._idle_spares:
            spare = min(self._idle_spares)
            self._idle_spares.discard(spare)
            self._serves[spare] = rank
            store.set(job.spare_key(worker_group.workers[spare].global_rank), str(rank))
            self._say(f"rank {rank} goes to a waiting spare (local rank {spare})")
            return None
        if self._replacements_left > 0:
            self._replacements_left -= 1
            pid = self._start_one(worker_group, worker_group.workers[lr], rank=rank)
            self._serves[lr] = rank
            self._say(
                f"rank {rank}: replacement started (pid {pid}), {self._replacements_left} replacements left"
            )
            return None
        self._say(f"rank {rank}: no replacement left (--max-replacements spent): stopping the job")
        self._stop_workers(worker_group)
        return RunResult(state=WorkerState.FAILED, failures={rank: failure})


def get_args_parser() -> argparse.ArgumentParser:
    """torchrun's parser plus fastdist's flags."""
    from torch.distributed.run import get_args_parser as torchrun_parser

    parser = torchrun_parser()
    parser.prog = "fastdist run"
    parser.description = "torchrun, except that a dead worker is replaced and the others keep running"
    parser.add_argument(
        "--max-replacements",
        type=int,
        default=3,
        help="how many dead workers to replace (new processes) before the job ends (default 3)",
    )
    parser.add_argument(
        "--spares",
        type=int,
        default=0,
        help="the last N processes of --nproc-per-node hold no rank; each takes a dead rank's place",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    if args.max_replacements < 0:
        raise SystemExit("fastdist run: --max-replacements must be >= 0")
    if args.spares < 0:
        raise SystemExit("fastdist run: --spares must be >= 0")
    if args.max_restarts:
        raise SystemExit("fastdist run: --max-restarts restarts every worker; use --max-replacements")
    nnodes = str(args.nnodes)
    if nnodes not in ("1", "1:1"):
        raise SystemExit("fastdist run: one node only for now (--nnodes 1); see the README")
    os.environ["FASTDIST_SPARES"] = str(args.spares)
    os.environ[job.LAUNCHER_ENV] = "1"  # the workers' errors may read the deaths recorded

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher import api as launcher_api

    agents: list[ReplacingAgent] = []

    def make_agent(*a: Any, **kw: Any) -> ReplacingAgent:
        agent = ReplacingAgent(*a, max_replacements=args.max_replacements, spares=args.spares, **kw)
        agents.append(agent)
        return agent

    try:
        with mock.patch.object(launcher_api, "LocalElasticAgent", make_agent):
            torchrun.run(args)  # type: ignore[no-untyped-call]
    except ChildFailedError as exc:
        print(f"[fastdist run] the job failed: {exc.get_first_failure()[1].message or exc}", file=sys.stderr)
        return 1
    finally:
        for agent in agents:
            if agent.story:
                print("[fastdist run] what happened:\n  " + "\n  ".join(agent.story), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
