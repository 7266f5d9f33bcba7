"""Run by bench/test_scope_cost.py in its own process: the Python cost fastdist's own all_reduce
adds per call, on a watched world-size-1 gloo group (the op itself is the same, and no peer or
scheduler noise is involved). Prints one JSON line of per-call costs in microseconds."""

from __future__ import annotations

import json
import socket
import sys
import time

import fastdist
import torch
import torch.distributed as dist


def main() -> None:
    rounds, inner = int(sys.argv[1]), int(sys.argv[2])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fastdist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    t = torch.ones(1)
    from fastdist import _watched

    def without_history() -> None:
        _watched.set_history_enabled(False)
        dist.all_reduce(t)
        _watched.set_history_enabled(True)

    def with_history() -> None:  # the same calls around it, so that only the ring differs
        _watched.set_history_enabled(True)
        dist.all_reduce(t)
        _watched.set_history_enabled(True)

    calls = {
        "dist": lambda: dist.all_reduce(t),
        "fastdist": lambda: fastdist.all_reduce(t, timeout=30),
        "fastdist_scope": lambda: fastdist.all_reduce(t),
        "history_off": without_history,
        "history_on": with_history,
    }
    times: dict[str, list[float]] = {k: [] for k in calls}
    for i in range(rounds):  # interleaved, order rotated every round
        names = list(calls)
        names = names[i % len(names) :] + names[: i % len(names)]
        for name in names:
            fn = calls[name]
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - t0) / inner * 1e6)
    # The lower quartile over rounds: each round's mean is the cost plus whatever else the machine
    # did meanwhile (2 shared cores); the minimum is one lucky round, the median carries the noise.
    print(json.dumps({k: sorted(v)[len(v) // 4] for k, v in times.items()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
