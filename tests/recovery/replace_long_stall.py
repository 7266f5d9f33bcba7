"""A stall longer than the recovery, for tests/recovery/test_replace.py: rank 1 sleeps 20 s inside
step 3 of a run_step loop (timeout 2 s, recover_timeout 3 s); ranks 0 and 2 wait for it in
recover() until its timeout and end with RecoveryError. fastdist run must name the stall (the
rank, how long, which timeouts bound it), not call it the script's own error."""

from __future__ import annotations

import time

import fastdist
import torch
import torch.distributed as dist


def main() -> None:
    fastdist.init_process_group("gloo")
    rank = fastdist.get_rank()
    total = torch.ones(1)
    for step in range(6):

        def one_step(step: int = step) -> None:
            if step == 3 and rank == 1:
                time.sleep(20)
            dist.all_reduce(total)

        fastdist.run_step(one_step, timeout=2, recover_timeout=3)
        print(f"rank {rank}: step {step} done", flush=True)


if __name__ == "__main__":
    main()
