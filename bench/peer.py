"""Rank 1 of the benchmark job: performs, call for call, the plan rank 0 posts in the store."""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ops import make_ops


def main() -> None:
    port, world_size = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=1, world_size=world_size)
    ops = make_ops(world_size)
    step = 0
    while True:
        plan = json.loads(store.get(f"plan/{step}"))  # blocks until rank 0 posts it
        if plan is None:
            break
        for name in plan:
            ops[name]()
        step += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
