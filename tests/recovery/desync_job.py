"""The example DDP loop (fastdist.examples.train_ddp: its model, data, optimizer and loop) for
``fastdist run``, with workers killed at chosen moments of a step, for tests/recovery/test_desync.py.

``--plan`` lists the kills, in order, each done once (a marker file in ``--out`` keeps the
process that takes the rank later alive), at the first step from STEP on once the ones before it
are done, as ``KIND:STEP:RANK:ARG`` separated by commas:

- ``hook:S:R:B``: rank R SIGKILLs itself in its DDP comm hook, right after it issued the
  all-reduce of bucket B (inside DDP's all-reduce);
- ``prestep:S:R:V``: rank R's optimizer step pre-hook (its all-reduces are done) SIGKILLs rank V
  and waits 0.3 s before its update;
- ``split:S:R:V``: from the start of a step's all-reduces, rank R runs rank V in slow motion
  (SIGSTOP and SIGCONT in turn: see Throttle); the moment every all-reduce of the step has
  completed on rank R, R leaves V stopped and looks whether the third rank's completed too (a
  marker file): if not (it waits for V's last chunk), R SIGKILLs V, so that R applies the step's
  update and the third rank's all-reduce fails (the live ranks are split); if so, V goes on
  (SIGCONT) and R tries again at the next step (after TRIES misses it kills V anyway). In gloo's
  ring (each rank receives from the next) the third rank must be the one R receives from, and V
  the one the third rank receives from: R=0, V=2; R=1, V=0; R=2, V=1;
- ``splitwait:S:R:V``: the same, and rank R then waits 0.3 s in its optimizer step pre-hook, so
  that the third rank's fault reaches R before R's next op (refused, so never numbered).

``--run-step`` runs each step in ``fastdist.run_step`` (which recovers and redoes it in place)
instead of the loop's own ``fail_after`` and ``recover``.

Each process writes its pid to ``--out``/pid{RANK} (a kill reads its victim's there) and one JSON
line per step, failure, join and kill to ``--events``; fastdist's recovery log is on (INFO).
DDP's buckets are small (``bucket_cap_mb``), so that a step has several all-reduces, and every
bucket goes through a comm hook that computes what DDP's own reduction does (divide by the world
size, all-reduce).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from typing import Any

import fastdist
import torch
import torch.distributed as dist
from fastdist.examples.train_ddp import Events, Progress, batch, recover

# Steps a split kill tries (in one process) before it kills the victim anyway, unsplit.
TRIES = 40
THIRD = {(a, b): ({0, 1, 2} - {a, b}).pop() for a in range(3) for b in range(3) if a != b}


class Kill:
    def __init__(self, spec: str, index: int, out: str) -> None:
        kind, step, rank, arg = spec.split(":")
        self.kind, self.step, self.rank, self.arg = kind, int(step), int(rank), int(arg)
        self.marker = os.path.join(out, f".kill-{index}")
        self.after = os.path.join(out, f".kill-{index - 1}") if index else None
        self.misses = 0

    def due(self, kinds: tuple[str, ...], step: int, rank: int) -> bool:
        if self.kind not in kinds or rank != self.rank or os.path.exists(self.marker):
            return False
        if self.after is not None and not os.path.exists(self.after):
            return False
        return step >= self.step

    def mark(self) -> None:
        open(self.marker, "w").close()


class Throttle:
    """Runs a process in slow motion (stopped 2 ms, running 0.2 ms, over and over) from a thread
    of this one: in gloo's ring, the rank that sends to the slowed one then completes well before
    the one the slowed rank sends to, which waits for its last chunk."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.pid = 0
        self.ending = threading.Event()

    def start(self, pid: int) -> None:
        self.stop()
        os.kill(pid, signal.SIGCONT)
        self.pid, self.ending = pid, threading.Event()
        self.thread = threading.Thread(target=self._run, args=(pid, self.ending), daemon=True)
        self.thread.start()

    @staticmethod
    def _run(pid: int, ending: threading.Event) -> None:
        while True:
            os.kill(pid, signal.SIGSTOP)
            if ending.wait(0.002):
                return
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.0002)

    def stop(self) -> None:
        """Ends the slow motion, the process stopped."""
        if self.thread is not None:
            self.ending.set()
            self.thread.join()
            self.thread = None


def _pid(out: str, rank: int) -> int:
    with open(os.path.join(out, f"pid{rank}")) as f:
        return int(f.read())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-timeout", type=float, default=5.0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--plan", default="")
    p.add_argument("--out", required=True)
    p.add_argument("--events", default=None)
    p.add_argument("--run-step", action="store_true", help="each step in fastdist.run_step")
    args = p.parse_args()
    out = args.out
    kills = [Kill(spec, i, out) for i, spec in enumerate(s for s in args.plan.split(",") if s)]
    logging.basicConfig(format="%(message)s")
    logging.getLogger("fastdist.recovery").setLevel(logging.INFO)

    fastdist.init_process_group("gloo")
    rank = fastdist.get_rank()
    with open(os.path.join(out, f"pid{rank}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(out, f"pid{rank}.tmp"), os.path.join(out, f"pid{rank}"))
    events = Events(args.events, rank)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.0005)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    progress = Progress()
    state = {"model": model, "optim": opt, "progress": progress}
    if fastdist.sync_state(state):
        print(f"rank {rank}: joined the running job at step {progress.step}", flush=True)
        events("joined", step=progress.step)

    # This step's all-reduces on this rank: how many were issued and completed, and whether DDP
    # issued its last bucket's. (Updated from the main thread and gloo's.)
    ops = {"step": -1, "issued": 0, "done": 0, "last": False}
    splitting = any(k.kind.startswith("split") for k in kills)
    pause = [False]

    throttle = Throttle()

    def all_reduced(step: int) -> None:
        """Every all-reduce of ``step`` completed on this rank (on a gloo thread)."""
        if splitting:
            open(os.path.join(out, f".reduced-{step}-{rank}"), "w").close()
        for k in kills:
            if not k.due(("split", "splitwait"), step, rank):
                continue
            victim = _pid(out, k.arg)
            throttle.stop()  # (it leaves the victim stopped)
            time.sleep(0.02)
            split = not os.path.exists(os.path.join(out, f".reduced-{step}-{THIRD[rank, k.arg]}"))
            if not split and k.misses < TRIES:
                k.misses += 1
                os.kill(victim, signal.SIGCONT)  # the third rank completed too: the next step
                events("missed", step=step, kind=k.kind, victim=k.arg)
                continue
            k.mark()
            events("kill", step=step, kind=k.kind, victim=k.arg, split=split)
            os.kill(victim, signal.SIGKILL)
            pause[0] = k.kind == "splitwait"

    def comm_hook(_, bucket):  # type: ignore[no-untyped-def]  # (DDP reads the annotations)
        step = progress.step
        if ops["step"] != step:
            ops.update(step=step, issued=0, done=0, last=False)
        if not ops["issued"]:
            for k in kills:
                if k.due(("split", "splitwait"), step, rank):
                    throttle.start(_pid(out, k.arg))
        buf = bucket.buffer()
        buf.div_(model.process_group.size())
        fut = dist.all_reduce(buf, group=model.process_group, async_op=True).get_future()  # type: ignore[union-attr]
        ops["issued"] += 1
        ops["last"] = ops["last"] or bucket.is_last()
        for k in kills:
            if k.due(("hook",), step, rank) and bucket.index() == k.arg:
                k.mark()
                events("kill", step=step, kind="hook", victim=rank)
                os.kill(os.getpid(), signal.SIGKILL)

        def completed(f: Any) -> None:
            try:
                f.wait()
            except Exception:  # noqa: BLE001 - the step failed here
                return
            if ops["step"] == step:
                ops["done"] += 1
                if ops["last"] and ops["done"] == ops["issued"]:
                    all_reduced(step)

        fut.then(completed)
        return fut.then(lambda f: f.value()[0])

    def pre_step(*_: Any) -> None:
        for k in kills:
            if k.due(("prestep",), progress.step, rank):
                k.mark()
                events("kill", step=progress.step, kind="prestep", victim=k.arg)
                os.kill(_pid(out, k.arg), signal.SIGKILL)
                time.sleep(0.3)
        if pause[0]:
            pause[0] = False
            time.sleep(0.3)

    opt.register_step_pre_hook(pre_step)

    def step() -> None:
        opt.zero_grad()
        model(batch(progress.step, rank)).pow(2).mean().backward()
        opt.step()

    hooked: list[Any] = [None]
    while progress.step < args.steps:
        if model.reducer is not hooked[0]:  # a recovery with a joiner gives DDP a fresh reducer
            model.register_comm_hook(None, comm_hook)
            hooked[0] = model.reducer
        try:
            if args.run_step:
                fastdist.run_step(step, timeout=args.step_timeout, optimizers=[opt], state=state)
            else:
                with fastdist.fail_after(args.step_timeout):
                    step()
            progress.step += 1
            events("step", step=progress.step)
            time.sleep(args.step_sleep)
        except fastdist.FastdistError as err:
            print(f"rank {rank}: step {progress.step} failed: {err}", flush=True)
            events("failed", step=progress.step)
            recover(rank, state)
        except RuntimeError as err:  # run_step's refusal to redo a step
            events("refused", step=progress.step, error=str(err))
            raise

    torch.save(
        {
            "params": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
            "optim": opt.state_dict(),
            "step": progress.step,
        },
        os.path.join(out, f"rank{rank}.pt"),
    )
    print(f"rank {rank}: done at step {progress.step}", flush=True)


if __name__ == "__main__":
    main()
