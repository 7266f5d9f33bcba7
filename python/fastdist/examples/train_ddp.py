"""A DDP training script as a user writes it for ``fastdist run``: the same script on every
process, first start or replacement.

    fastdist run --nproc-per-node 3 -m fastdist.examples.train_ddp --steps 20

``--kill-rank R --kill-step S`` makes rank R SIGKILL itself in its backward at step S, once (a
marker file keeps its replacement alive), to show a dead worker replaced. ``--out DIR`` writes
each rank's final parameters and optimizer state (``rank{R}.pt``) for comparing runs, and
``--events FILE`` one JSON line per step, kill and join (bench/test_replace.py reads them).
``--checkpoint-dir DIR`` is the restart-based alternative the benchmark compares with: a
torch.distributed.checkpoint save after every step, loaded at start (plain torchrun with
``--max-restarts``). ``--backend nccl --device cuda`` runs it on GPUs (each process on its
LOCAL_RANK's GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from typing import Any

import torch

import fastdist


class Progress:
    """The loop's position, as state that is handed to a joiner with the model's."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        """The loop's position: ``{"step": N}``."""
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Moves the loop to the step in ``sd``."""
        self.step = int(sd["step"])


def batch(step: int, rank: int) -> torch.Tensor:
    """This rank's data at ``step``: a function of the step alone, so a redone step sees the same."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=g)


class Events:
    """``--events FILE``: one JSON line per event, appended (every rank and process shares it)."""

    def __init__(self, path: str | None, rank: int) -> None:
        self.path, self.rank = path, rank

    def __call__(self, event: str, **fields: Any) -> None:
        """Appends one line for ``event`` and ``fields``, with the rank, the pid and the time
        (``time.time()``), when a file was given."""
        if self.path:
            with open(self.path, "a") as f:
                rec = {"event": event, "rank": self.rank, "pid": os.getpid(), "time": time.time(), **fields}
                f.write(json.dumps(rec) + "\n")


class Checkpoint:
    """``--checkpoint-dir``: the job's state saved with torch.distributed.checkpoint after every
    step and loaded at start, the way a job restarted by torchrun picks up."""

    def __init__(self, path: str, model: Any, opt: Any, progress: Progress) -> None:
        self.path, self.model, self.opt, self.progress = path, model, opt, progress

    def state_dict(self) -> dict[str, Any]:
        """The model's and optimizer's state dicts (``get_state_dict`` of
        torch.distributed.checkpoint) and the step."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd, "step": self.progress.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Loads ``sd`` into the model, the optimizer and the loop's position."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.progress.step = sd["step"]

    def save(self) -> None:
        """Saves the state into the directory with torch.distributed.checkpoint, over the previous
        save."""
        import torch.distributed.checkpoint as dcp

        dcp.save({"app": self}, storage_writer=dcp.FileSystemWriter(self.path, overwrite=True))

    def load(self) -> bool:
        """Loads the last save from the directory; returns False when there is none."""
        import torch.distributed.checkpoint as dcp

        if not os.path.exists(os.path.join(self.path, ".metadata")):
            return False
        dcp.load({"app": self}, checkpoint_id=self.path)
        return True


def recover(rank: int, state: dict[str, Any], tries: int = 3) -> None:
    """``fastdist.recover``, tried again when the recovery itself fails (a replacement that died
    while it was being brought up to date: the launcher starts another)."""
    for attempt in range(1, tries + 1):
        t0 = time.monotonic()
        try:
            fastdist.recover(timeout=60, state=state)
        except fastdist.RecoveryError as err:
            print(f"rank {rank}: recovery {attempt} failed: {err}", flush=True)
            if attempt == tries:
                raise
            continue
        print(f"rank {rank}: recovered in {time.monotonic() - t0:.2f} s", flush=True)
        return


def main(argv: list[str] | None = None) -> None:
    """Runs the script with ``argv`` (default: the command line): see the module's docstring."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-timeout", type=float, default=3.0)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--out", default=None)
    p.add_argument("--events", default=None)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--backend", default="gloo", help="gloo (default), nccl, or another registered backend")
    p.add_argument(
        "--device", default="cpu", help="cpu (default) or cuda: this process's GPU is LOCAL_RANK's"
    )
    args = p.parse_args(argv)

    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    fastdist.init_process_group(args.backend)  # env:// from the launcher; a joiner returns at once
    rank = fastdist.get_rank()
    Events(args.events, rank)("started", agent=os.getppid())
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(device)
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    progress = Progress()
    state = {"model": model, "optim": opt, "progress": progress}
    events = Events(args.events, rank)
    resumed = False
    if fastdist.sync_state(state):  # False on a first start; a joiner loads the live ranks' state
        print(
            f"rank {rank}: joined the running job at step {progress.step} (RANK={os.environ.get('RANK')})",
            flush=True,
        )
        events("joined", step=progress.step)
        resumed = True
    checkpoint = Checkpoint(args.checkpoint_dir, model, opt, progress) if args.checkpoint_dir else None
    if checkpoint is not None and checkpoint.load():
        print(f"rank {rank}: restarted from the checkpoint of step {progress.step}", flush=True)
        resumed = True

    marker = os.path.join(args.out or "/tmp", f".killed-{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}")
    if rank == args.kill_rank and not os.path.exists(marker):

        def die(grad: torch.Tensor) -> torch.Tensor:
            if progress.step == args.kill_step:
                open(marker, "w").close()
                events("kill", step=progress.step)
                os.kill(os.getpid(), signal.SIGKILL)  # mid-backward, as an OOM kill would
            return grad

        net[0].weight.register_hook(die)  # type: ignore[operator]

    while progress.step < args.steps:
        try:
            t0 = time.time()
            with fastdist.fail_after(args.step_timeout):
                opt.zero_grad()
                model(batch(progress.step, rank).to(device)).pow(2).mean().backward()
                opt.step()
            progress.step += 1
            events("step", step=progress.step, seconds=time.time() - t0, resumed=resumed)
            resumed = False
            if checkpoint is not None:
                checkpoint.save()
        except fastdist.FastdistError as err:
            print(f"rank {rank}: step {progress.step} failed: {err}", flush=True)
            events("failed", step=progress.step)
            recover(rank, state)
            events("recovered", step=progress.step)
            resumed = True

    if args.out:
        torch.save(
            {
                "params": {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()},
                "optim": _to_cpu(opt.state_dict()),
                "step": progress.step,
            },
            os.path.join(args.out, f"rank{rank}.pt"),
        )
    print(f"rank {rank}: done at step {progress.step}", flush=True)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


def compare(reference: str, other: str, world: int) -> float:
    """The largest difference between any rank's parameters and SGD momentum in ``other`` and
    rank 0's in ``reference`` (each a --out directory); inf when a rank's file is missing or its
    step differs."""
    ref = torch.load(os.path.join(reference, "rank0.pt"))
    worst = 0.0
    for r in range(world):
        path = os.path.join(other, f"rank{r}.pt")
        if not os.path.exists(path):
            return float("inf")
        got = torch.load(path)
        if got["step"] != ref["step"]:
            return float("inf")
        pairs = list(zip(ref["params"].values(), got["params"].values()))
        pairs += [
            (a["momentum_buffer"], b["momentum_buffer"])
            for a, b in zip(ref["optim"]["state"].values(), got["optim"]["state"].values())
        ]
        worst = max([worst] + [(a - b).abs().max().item() for a, b in pairs])
    return worst


if __name__ == "__main__":
    main()
