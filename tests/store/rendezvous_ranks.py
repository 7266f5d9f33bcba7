"""The ranks of tests/store/test_rendezvous.py: init_process_group's rendezvous."""

from __future__ import annotations

import os
import time

import fastdist


def rdzv_init(ctx) -> None:
    """3 ranks: the last never calls init; the others' rendezvous names it within the timeout."""

    if ctx.rank == ctx.world_size - 1:
        ctx.wait_release()
        return
    t0 = time.monotonic()
    try:
        fastdist.init_process_group(
            "gloo",
            f"tcp://127.0.0.1:{os.environ['FASTDIST_RDZV_PORT']}",
            rank=ctx.rank,
            world_size=ctx.world_size,
            connect_timeout=10,
            rendezvous_timeout=fastdist.RendezvousTimeout(1.5),
        )
        ctx.record("no_error")
    except fastdist.RendezvousTimeoutError as e:
        ctx.record(
            "rdzv_timeout",
            elapsed=time.monotonic() - t0,
            raised_at=time.time(),
            missing=e.missing_ranks,
            joined=e.joined,
            message=str(e),
        )
