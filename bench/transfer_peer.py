"""One rank of bench/test_replace.py's hand-over benchmark: RANK PORT MEGABYTES ROUNDS OUT.

A model of square Linear layers and its SGD momentum (half the bytes each), handed from rank 0 to
rank 1 by fastdist's state hand-over and by dist.broadcast of the same tensors, in turn."""

from __future__ import annotations

import datetime
import json
import statistics
import sys
import time

import fastdist
import torch
import torch.distributed as dist
from fastdist.recovery import state_sync


def main() -> None:
    rank, port, megabytes, rounds, out = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
        sys.argv[5],
    )
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, datetime.timedelta(seconds=120))
    fastdist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    side = 2048
    layers = max(1, (megabytes << 20) // 2 // (side * side * 4))
    model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, side)).sum().backward()
    opt.step()  # momentum buffers exist
    state = {"model": model, "optim": opt}
    tensors = [p.data for p in model.parameters()] + [
        opt.state[p]["momentum_buffer"] for p in model.parameters()
    ]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    group = dist.group.WORLD
    fd, raw = [], []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        for t in tensors:
            dist.broadcast(t, 0)
        raw.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            state_sync.send(state, [1], group, fastdist.current_time() + 300)
        else:
            received = state_sync.receive(0, group, fastdist.current_time() + 300, into=state)
            assert received is not None
            for key, obj in state.items():
                obj.load_state_dict(received[key])
            del received
        dist.barrier()  # the receiver has loaded it
        fd.append(time.perf_counter() - t0)
    if rank == 1:
        with open(out, "w") as f:
            json.dump(
                {
                    "bytes": nbytes,
                    "rounds": rounds,
                    "broadcast_gbps": nbytes / statistics.median(raw) / 1e9,
                    "fastdist_gbps": nbytes / statistics.median(fd) / 1e9,
                },
                f,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
