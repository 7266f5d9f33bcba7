"""python/fastdist/examples/train_ddp.py on NCCL under ``fastdist run``, each worker on its LOCAL_RANK's
GPU, or, with one GPU, every worker on it: each process a host of its own to NCCL (NCCL_HOSTID
from RANK, set before the communicators are made; see nccl_gpu_ranks.SHARED_GPU_ENV)."""

import os
import sys

from fastdist.examples import train_ddp

if __name__ == "__main__":
    os.environ["NCCL_HOSTID"] = f"fastdist-test-host{os.environ.get('RANK', '0')}"
    train_ddp.main([*sys.argv[1:], "--backend", "nccl", "--device", "cuda"])
