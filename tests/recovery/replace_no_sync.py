"""A DDP loop that knows nothing of fastdist's replacement: it recovers from a fault, but never
calls fastdist.sync_state. Rank 2 SIGKILLs itself at step 3 (once: a marker file says it did).
Its replacement must not train alone: its first reduction is refused (before sync_state it has
no slot in the job), or, with ``--exit-at-start``, it exits 0 at once; either way ``fastdist run``
ends the job saying why. With ``--no-recover`` the live ranks raise the death's fault instead of
recovering. ``OUT/done-RANK-PID`` marks a process that finished all its steps."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import fastdist
import torch
import torch.distributed as dist


def main() -> None:
    out = Path(sys.argv[1])
    fastdist.init_process_group("gloo")
    rank = dist.get_rank()
    marker = out / "killed"
    if rank == 2 and marker.exists() and "--exit-at-start" in sys.argv:
        return  # a replacement that ends at once, exit 0, having joined nothing
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = 0
    while step < 20:
        if rank == 2 and step == 3 and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            with fastdist.fail_after(10):
                opt.zero_grad()
                model(torch.ones(8, 4) * (step + rank)).sum().backward()
                opt.step()
            step += 1
        except fastdist.FastdistError:
            if "--no-recover" in sys.argv:
                raise  # a loop that does not recover: the live ranks end on the death's fault
            fastdist.recover(timeout=60)
    (out / f"done-{rank}-{os.getpid()}").touch()


if __name__ == "__main__":
    main()
