"""Run by tests/recovery/test_replace.py under ``fastdist run`` (3 workers) on the CPU double of NCCL: after
three healthy all_reduces, rank 1 SIGKILLs itself while the others are in an all_reduce whose
"kernel" never ends on its own (the double with delay=inf: a peer's death that NCCL does not
notice, as a kernel spinning over the network). The live ranks must hear of the death from the
launcher at once (not at their 20 s deadline), recover with the replacement, and go on."""

import math
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # tests/support: the harness

import fake_nccl
import fastdist
import torch
import torch.distributed as dist


class Count:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = int(sd["n"])


def main() -> None:
    fake_nccl.register()
    fastdist.init_process_group(fake_nccl.NAME)
    rank = fastdist.get_rank()
    count = Count()
    state = {"count": count}
    t = torch.ones(4)
    if not fastdist.sync_state(state):
        for _ in range(3):
            dist.all_reduce(t)
            count.n += 1
        fastdist.barrier(timeout=30)
        if rank == 1:
            time.sleep(0.5)  # the others are in their all_reduce by now
            os.kill(os.getpid(), signal.SIGKILL)
        fake_nccl.configure(delay=math.inf)
        t0 = time.monotonic()
        try:
            with fastdist.fail_after(20):
                dist.all_reduce(t)
            print(f"rank {rank}: no error", flush=True)
        except fastdist.FastdistError as err:
            print(f"rank {rank}: raised after {time.monotonic() - t0:.2f} s: {err}", flush=True)
        fake_nccl.configure(delay=0.0)
        fastdist.recover(timeout=60, state=state)
    else:
        print(f"rank {rank}: joined at count {count.n}", flush=True)
    t = torch.ones(4)
    dist.all_reduce(t)
    print(f"rank {rank}: done, sum {t[0].item():.0f}, count {count.n}", flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
