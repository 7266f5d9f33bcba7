"""The ranks of tests/diagnostics/test_where_stuck.py: the error says where each rank is."""

from __future__ import annotations

import threading
import time

import fastdist
import torch
import torch.distributed as dist
from ranks_common import load_batch, stop_for


def where_stuck(ctx) -> None:
    """3 ranks. A: rank 2 loops in load_batch; rank 0's barrier(timeout=1) times out while rank 1
    waits in an all_reduce with a 60 s deadline: rank 1 must raise at once with rank 0, and rank
    0's error must say where ranks 1 and 2 are. B: rank 2 is stopped (SIGSTOP) for 4 s: the
    report says it did not answer. Everyone recovers after each."""
    ctx.init()
    fastdist.barrier(timeout=30)
    if ctx.rank == 2:
        load_batch(ctx, "go_a")
    else:
        t0 = time.monotonic()
        try:
            if ctx.rank == 0:
                fastdist.barrier(timeout=1)
            else:
                fastdist.all_reduce(torch.ones(1), timeout=60)
            ctx.record("a_no_error")
        except fastdist.FastdistError as e:
            ctx.record(
                "a",
                type=type(e).__name__,
                message=str(e),
                elapsed=time.monotonic() - t0,
                stacks={str(k): v for k, v in (getattr(e, "stacks", None) or {}).items()},
                missing=getattr(e, "missing_ranks", None),
            )
        ctx.record(
            "history_a", ops=[(o["seq"], o["op"], o["outcome"], o["shape"]) for o in fastdist.history()]
        )
        if ctx.rank == 0:
            ctx.store.set("go_a", "1")
    fastdist.recover(timeout=30)
    fastdist.barrier(timeout=30)
    ctx.record("recovered_a")
    if ctx.rank == 2:
        stop_for(4.0)
    else:
        try:
            fastdist.barrier(timeout=1)
            ctx.record("b_no_error")
        except fastdist.CollectiveTimeoutError as e:
            ctx.record("b", message=str(e), missing=e.missing_ranks)
    fastdist.recover(timeout=30)
    fastdist.barrier(timeout=30)
    ctx.record("recovered_b")
    # C: rank 2 comes 50 ms late to each of 6 all_reduces, then stays away: the timed-out ranks'
    # error names it as the straggler, from the waits each rank posted (the fresh group of
    # generation 2 has these 6 ops and the barrier after recover() in its history).
    for _ in range(6):
        if ctx.rank == 2:
            time.sleep(0.05)
        fastdist.all_reduce(torch.ones(1), timeout=30)
    if ctx.rank == 2:
        load_batch(ctx, "go_c")
    else:
        try:
            fastdist.barrier(timeout=1)
            ctx.record("c_no_error")
        except fastdist.CollectiveTimeoutError as e:
            ctx.record("c", message=str(e), straggler=e.straggler)
        if ctx.rank == 0:
            ctx.store.set("go_c", "1")
    fastdist.recover(timeout=30)
    fastdist.barrier(timeout=30)
    ctx.record("recovered_c")


def side_thread_waits_here(ctx, sub, release: threading.Event) -> None:
    """A side thread that issues the subgroup's ops, then waits (for the test: where it is)."""
    t = torch.ones(1)
    fastdist.all_reduce(t, group=sub, timeout=20)
    release.wait(30)


def subgroup_report_names_issuer(ctx) -> None:
    """2 ranks and a subgroup of both, whose ops come from a side thread. Rank 0 issues a subgroup
    op that rank 1 never joins (rank 1's side thread waits elsewhere, its main thread sleeps in a
    barrier-free loop): rank 0's error shows rank 1's side thread, not its main thread."""
    ctx.init()
    sub = dist.new_group([0, 1])
    release = threading.Event()
    side = threading.Thread(target=side_thread_waits_here, args=(ctx, sub, release), name="side")
    side.start()
    if ctx.rank == 0:
        time.sleep(1.0)
        try:
            fastdist.barrier(group=sub, timeout=2)
        except fastdist.CollectiveTimeoutError as e:
            ctx.record("sub", message=str(e), stacks={str(k): v for k, v in (e.stacks or {}).items()})
        release.set()
    else:
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:  # the main thread, busy elsewhere
            time.sleep(0.01)
        release.set()
    side.join(30)
