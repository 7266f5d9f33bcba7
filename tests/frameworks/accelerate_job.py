"""An Accelerate job as a user writes it, for tests/frameworks/test_frameworks.py's Accelerate tests:
``torchrun --nproc-per-node 3 tests/frameworks/accelerate_job.py --out DIR``. CPU (gloo), DDP prepared by
Accelerate, ``gradient_accumulation_steps=2`` under ``accelerator.accumulate``, dropout, a LR
scheduler, and ``gather`` / ``wait_for_everyone`` outside the step.

Each process trains twice: undisturbed, then with rank 2 stalling ``--stall`` s in the last
micro-batch of optimizer step 3 (the one whose backward all-reduces; the gradients of the
window's first micro-batch are in ``.grad`` then). After each run it saves what the test compares to
``DIR/rank{R}-{run}.pt``.

``--kill`` (under ``fastdist run``): one step per accumulation window (both micro-batches in the
step), a shuffled loader, the loop's position and the epoch's shuffle order
(``fastdist.accelerate.LoaderState``) handed over with the model, and rank 2 SIGKILLs itself in the first
micro-batch of window 3, once; the replacement joins with ``fastdist.sync_state``, skips the
windows done with ``accelerator.skip_first_batches`` and trains on. No dropout: a replacement
cannot draw the dead rank's masks. Runs ``undisturbed`` and ``killed`` (a replacement skips the
runs its rank finished).

    python -m fastdist.run --nproc-per-node 3 tests/frameworks/accelerate_job.py --out DIR --kill
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import time
from typing import Any

import fastdist.accelerate
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from fastdist.examples.train_ddp import Progress
from jobs_common import result
from torch.utils.data import DataLoader, TensorDataset

STALL_RANK, STALL_STEP, STEPS, ACCUM = 2, 3, 20, 2


def _prepared(dropout: float, shuffle: bool = False) -> tuple[Any, Any, Any, Any, Any]:
    """The group (timeout 77 s, through InitProcessGroupKwargs), the Accelerator and the prepared
    model, optimizer, loader (shuffled with ``shuffle``) and scheduler."""
    kwargs = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=77))
    fastdist.accelerate.init_process_group(kwargs)
    accelerator = Accelerator(cpu=True, kwargs_handlers=[kwargs], gradient_accumulation_steps=ACCUM)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(dropout), torch.nn.Linear(16, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * 3 * STEPS * ACCUM, 8, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4, shuffle=shuffle)
    return accelerator, *accelerator.prepare(model, opt, loader, sched)


def _micro_batch(
    accelerator: Any, model: Any, opt: Any, sched: Any, xb: torch.Tensor, yb: torch.Tensor
) -> torch.Tensor:
    """One micro-batch as a user's loop writes it (Accelerate skips the optimizer's step and
    zero_grad until the window's last)."""
    loss = F.mse_loss(model(xb), yb)
    accelerator.backward(loss)
    opt.step()
    sched.step()
    opt.zero_grad()
    return loss.detach()


def train(stall: float) -> dict[str, Any]:
    accelerator, model, opt, loader, sched = _prepared(0.2)
    torch.manual_seed(1 + accelerator.process_index)
    rank, stalled, calls, losses = accelerator.process_index, False, 0, []
    for i, (xb, yb) in enumerate(loader):
        with accelerator.accumulate(model):

            def one_step(i: int = i, xb: torch.Tensor = xb, yb: torch.Tensor = yb) -> torch.Tensor:
                nonlocal stalled, calls
                calls += 1
                if stall and not stalled and rank == STALL_RANK and i == STALL_STEP * ACCUM + 1:
                    stalled = True
                    time.sleep(stall)
                return _micro_batch(accelerator, model, opt, sched, xb, yb)

            loss = fastdist.accelerate.step(accelerator, one_step, timeout=2)
        losses.append(accelerator.gather(loss).sum().item())  # a collective outside the step
    accelerator.wait_for_everyone()
    timeout = torch.distributed.group.WORLD._get_backend(torch.device("cpu")).default_timeout
    net, steps = accelerator.unwrap_model(model), sched.scheduler.last_epoch
    return result(rank, net, opt.optimizer, steps, losses, retries=calls - len(loader), group_timeout=timeout)


def train_windows(kill: str | None, joiner_dies: bool = False) -> dict[str, Any]:
    """One fastdist step per accumulation window; ``kill``: the marker of rank 2's death.
    ``joiner_dies``: its first replacement SIGKILLs itself too, while it loads the loader's state
    in the hand-over (a death in the hand-over: the live ranks recover again, with a second)."""
    accelerator, model, opt, loader, sched = _prepared(0.0, shuffle=True)
    progress = Progress()  # optimizer steps done: one a window
    # The loader's shuffle order in this epoch goes to a replacement with the model (without it,
    # the replacement's iterator would broadcast Accelerate's RNG state alone).
    data = fastdist.accelerate.LoaderState(loader)
    if joiner_dies and kill and os.path.exists(kill) and not os.path.exists(kill + "-joiner"):
        real_load = data.load_state_dict

        def load_state_dict(sd: dict[str, Any]) -> None:
            open(kill + "-joiner", "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
            real_load(sd)

        data.load_state_dict = load_state_dict  # type: ignore[method-assign]
    state = {"model": model, "optim": opt, "sched": sched, "progress": progress, "data": data}
    joined = progress.step if fastdist.sync_state(state) else None  # a replacement: its step
    rank, losses = accelerator.process_index, []
    batches = iter(accelerator.skip_first_batches(loader, progress.step * ACCUM) if joined else loader)
    while progress.step < STEPS:
        window = [next(batches) for _ in range(ACCUM)]

        def one_window(window: list[Any] = window) -> torch.Tensor:
            for j, (xb, yb) in enumerate(window):
                dies = kill and rank == STALL_RANK and progress.step == STALL_STEP and j == 0
                if dies and not os.path.exists(kill):  # once: the replacement must live
                    open(kill, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
                with accelerator.accumulate(model):
                    loss = _micro_batch(accelerator, model, opt, sched, xb, yb)
            return loss

        loss = fastdist.accelerate.step(accelerator, one_window, timeout=2, state=state)
        progress.step += 1
        losses.append(accelerator.gather(loss).sum().item())  # a collective outside the step
    accelerator.wait_for_everyone()
    net, steps = accelerator.unwrap_model(model), sched.scheduler.last_epoch
    return result(rank, net, opt.optimizer, steps, losses, joined=joined, pid=os.getpid())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--stall", type=float, default=3.5)
    p.add_argument("--kill", action="store_true", help="rank 2 is SIGKILLed (under fastdist run)")
    p.add_argument("--joiner-dies", action="store_true", help="with --kill: its first replacement too")
    args = p.parse_args()
    if args.kill:
        marker = os.path.join(args.out, ".killed")
        for run in ("undisturbed", "killed"):
            path = os.path.join(args.out, f"rank{os.environ['RANK']}-{run}.pt")
            if not os.path.exists(path):  # a replacement skips the runs its rank finished
                torch.save(train_windows(marker if run == "killed" else None, args.joiner_dies), path)
        return
    for run, stall in (("undisturbed", 0.0), ("stalled", args.stall)):
        result = train(stall)
        torch.save(result, os.path.join(args.out, f"rank{result['rank']}-{run}.pt"))


if __name__ == "__main__":
    main()
