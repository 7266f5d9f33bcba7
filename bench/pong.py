"""The other end of bench/test_propagation.py's store round trips: pops a ping from its queue in
the store of ``argv[1]``'s port and pushes it back, ``argv[2]`` times."""

from __future__ import annotations

import datetime
import sys

import torch.distributed as dist


def main() -> None:
    port, count = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    store.set("pong/ready", "1")
    for _ in range(count):
        store.queue_push("pong", store.queue_pop("ping"))


if __name__ == "__main__":
    main()
