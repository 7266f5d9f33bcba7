"""An FSDP2 script for ``fastdist run`` (tests/recovery/test_replace.py): rank 1 SIGKILLs itself in its
backward at step 2, once. Its shards exist on no live rank, so the replacement's ``sync_state``
and the live ranks' ``recover(state=)`` must both raise RecoveryError saying so."""

from __future__ import annotations

import os
import signal
import sys

import fastdist
import torch
from fastdist.examples.train_ddp import Progress
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main() -> None:
    out = sys.argv[1]
    fastdist.init_process_group("gloo")
    rank = fastdist.get_rank()
    mesh = init_device_mesh("cpu", (fastdist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    progress = Progress()
    state = {"model": model, "optim": opt, "progress": progress}
    try:
        fastdist.sync_state(state, timeout=30)
    except fastdist.RecoveryError as err:
        print(f"rank {rank}: sync_state: {err}", flush=True)
        raise SystemExit(2) from None
    marker = os.path.join(out, ".killed")
    while progress.step < 6:
        if rank == 1 and progress.step == 2 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            with fastdist.fail_after(3):
                opt.zero_grad()
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
            progress.step += 1
        except fastdist.FastdistError as err:
            print(f"rank {rank}: step {progress.step} failed: {type(err).__name__}", flush=True)
            try:
                fastdist.recover(timeout=30, state=state)
            except fastdist.RecoveryError as rec:
                print(f"rank {rank}: recover: {rec}", flush=True)
                raise SystemExit(3) from None
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    main()
