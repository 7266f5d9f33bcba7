"""python/fastdist/examples/train_ddp.py on the CPU double of NCCL (tests/support/fake_nccl.py): the script
``fastdist run`` launches in tests/recovery/test_replace.py, so that a dead worker is replaced on the C++
path real NCCL takes."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # tests/support: the harness

import fake_nccl
from fastdist.examples import train_ddp

if __name__ == "__main__":
    fake_nccl.register()
    train_ddp.main([*sys.argv[1:], "--backend", fake_nccl.NAME])
