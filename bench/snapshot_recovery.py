"""One process of bench/test_snapshot.py's recovery benchmark, under ``fastdist run``:
OUT MEGABYTES STEPS [--kill-step K] [--save-at S] [--resume].

FSDP2 over every rank (a 1-D mesh) on square Linear layers of MEGABYTES in all, SGD with momentum,
a PeerSnapshot every 10 steps, STEPS steps. ``--kill-step K``: rank 1 writes the time to
OUT/death and SIGKILLs itself at the end of step K (once); the spare takes its place and every
rank rolls back to the last snapshot. ``--save-at S``: a DCP checkpoint of step S in OUT/ckpt.
``--resume``: a restart, which loads that checkpoint after building the model. Rank 0 writes the
time of the first step it completes after starting, recovering or joining to OUT/trained.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import fastdist
import torch
from fastdist.examples.train_ddp import Progress
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("megabytes", type=int)
    p.add_argument("steps", type=int)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--save-at", type=int, default=-1)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()
    fastdist.init_process_group("gloo")
    rank = fastdist.get_rank()
    mesh = init_device_mesh("cpu", (fastdist.get_world_size(),))
    side = 1024
    torch.manual_seed(0)
    layers = max(1, (args.megabytes << 20) // (side * side * 4))
    model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(layers)])
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    progress = Progress()
    state = {"model": model, "optim": opt, "progress": progress}
    snap = fastdist.PeerSnapshot(state, every=10)
    fastdist.sync_state(state, timeout=120, snapshot=snap)
    ckpt = os.path.join(args.out, "ckpt")
    if args.resume:
        fastdist.load_checkpoint(state, ckpt, timeout=120)
    x = torch.randn(16, side, generator=torch.Generator().manual_seed(rank))
    marker = os.path.join(args.out, "death")
    fresh = True  # the next completed step is the first since starting, recovering or joining
    while progress.step < args.steps:
        try:
            with fastdist.fail_after(30):
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
            progress.step += 1
            if fresh and rank == 0:
                with open(os.path.join(args.out, "trained"), "w") as f:
                    f.write(repr(time.time()))
            fresh = False
            snap.step(progress.step)
            if progress.step == args.save_at:
                fastdist.save_checkpoint(state, ckpt, timeout=120)
            if rank == 1 and progress.step == args.kill_step and not os.path.exists(marker):
                snap.wait()  # (the kill is mid-training, not mid-snapshot)
                with open(marker, "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
        except fastdist.FastdistError:
            fastdist.recover(timeout=120, state=state, snapshot=snap)
            fresh = True


if __name__ == "__main__":
    main()
