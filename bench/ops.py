"""The operations the benchmarks time, shared by rank 0 (the pytest process) and the peer."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

import fastdist


def _checked(fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        fastdist.set_checks(True)
        try:
            fn()
        finally:
            fastdist.set_checks(False)

    return run


def make_ops(world_size: int) -> dict[str, Callable[[], None]]:
    one = torch.ones(1)
    out1 = [torch.zeros(1) for _ in range(world_size)]
    mb = torch.ones(256 * 1024)  # 1 MB of float32
    out_mb = [torch.zeros_like(mb) for _ in range(world_size)]
    return {
        "raw_barrier": lambda: dist.barrier(),
        "fd_barrier": lambda: fastdist.barrier(timeout=30),
        "raw_all_gather_1": lambda: dist.all_gather(out1, one),
        "fd_all_gather_1": lambda: fastdist.all_gather(out1, one, timeout=30),
        "raw_all_gather_1mb": lambda: dist.all_gather(out_mb, mb),
        "fd_all_gather_1mb": lambda: fastdist.all_gather(out_mb, mb, timeout=30),
        "raw_all_reduce_1": lambda: dist.all_reduce(one),
        "fd_all_reduce_1": lambda: fastdist.all_reduce(one, timeout=30),
        "raw_all_reduce_1mb": lambda: dist.all_reduce(mb),
        "fd_all_reduce_1mb": lambda: fastdist.all_reduce(mb, timeout=30),
        # FASTDIST_CHECK's price: the same all_reduce with the cross-rank signature check on.
        "fd_all_reduce_1_checked": _checked(lambda: fastdist.all_reduce(one, timeout=30)),
    }
