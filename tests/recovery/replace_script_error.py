"""A script with a plain bug, for tests/recovery/test_replace.py: every rank raises the same exception at
step 3 (after three steps of all_reduce), as a training script whose error hits every rank does."""

from __future__ import annotations

import fastdist
import torch
import torch.distributed as dist


def main() -> None:
    fastdist.init_process_group("gloo")
    rank = fastdist.get_rank()
    total = torch.ones(1)
    for step in range(6):
        if step == 3:
            raise RuntimeError("the script's own bug at step 3")
        with fastdist.fail_after(10):
            dist.all_reduce(total)
        print(f"rank {rank}: step {step} done", flush=True)


if __name__ == "__main__":
    main()
