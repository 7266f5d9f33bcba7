"""An Accelerate job as a user writes it, for tests/test_lightning.py's Accelerate test:
``torchrun --nproc-per-node 3 tests/accelerate_job.py --out DIR``. CPU (gloo), DDP prepared by
Accelerate, ``gradient_accumulation_steps=2`` under ``accelerator.accumulate``, dropout, a LR
scheduler, and ``gather`` / ``wait_for_everyone`` outside the step.

Each process trains twice: undisturbed, then with rank 2 stalling ``--stall`` s in the last
micro-batch of optimizer step 3 (the one whose backward all-reduces; the gradients of the
window's first micro-batch are in ``.grad`` then). After each run it saves what the test compares to
``DIR/rank{R}-{run}.pt``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from typing import Any

import fastdist.accelerate
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from torch.utils.data import DataLoader, TensorDataset

STALL_RANK, STALL_STEP, STEPS, ACCUM = 2, 3, 20, 2


def train(stall: float) -> dict[str, Any]:
    kwargs = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=77))
    fastdist.accelerate.init_process_group(kwargs)
    accelerator = Accelerator(cpu=True, kwargs_handlers=[kwargs], gradient_accumulation_steps=ACCUM)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * 3 * STEPS * ACCUM, 8, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
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
                loss = F.mse_loss(model(xb), yb)
                accelerator.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
                return loss.detach()

            loss = fastdist.accelerate.step(accelerator, one_step, timeout=2)
        losses.append(accelerator.gather(loss).sum().item())  # a collective outside the step
    accelerator.wait_for_everyone()
    inner = opt.optimizer
    net = accelerator.unwrap_model(model)
    return {
        "rank": rank,
        "params": {k: v.detach().clone() for k, v in net.state_dict().items()},
        "momentum": [inner.state[p]["momentum_buffer"].clone() for p in net.parameters()],
        "lr": [pg["lr"] for pg in inner.param_groups],
        "optimizer_steps": sched.scheduler.last_epoch,
        "losses": losses,
        "retries": calls - len(loader),
        "group_timeout": torch.distributed.group.WORLD._get_backend(torch.device("cpu")).default_timeout,
        "world": torch.distributed.get_world_size(),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--stall", type=float, default=3.5)
    args = p.parse_args()
    for run, stall in (("undisturbed", 0.0), ("stalled", args.stall)):
        result = train(stall)
        torch.save(result, os.path.join(args.out, f"rank{result['rank']}-{run}.pt"))


if __name__ == "__main__":
    main()
