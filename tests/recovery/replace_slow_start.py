"""python/fastdist/examples/train_ddp.py, whose replacement is slow to start: a process that finds
the kill's marker in --out (so: the replacement) sleeps SLOW seconds (argv[1]) before anything
else, as a replacement does on a busy GPU host (importing, loading a model)."""

from __future__ import annotations

import glob
import os
import sys
import time

from fastdist.examples import train_ddp

if __name__ == "__main__":
    slow, args = float(sys.argv[1]), sys.argv[2:]
    if glob.glob(os.path.join(args[args.index("--out") + 1], ".killed-*")):
        time.sleep(slow)
    train_ddp.main(args)
