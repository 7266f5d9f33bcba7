"""The ranks of tests/test_nccl_path.py: the NCCL path's logic on a CPU stand-in (tests/fake_nccl.py)."""

from __future__ import annotations

import math
import time

import fastdist
import torch
import torch.distributed as dist
from fastdist import CollectiveTimeoutError, GroupAbortedError
from ranks_common import record_error


def _poll_until(done, seconds: float) -> bool:
    """Polls ``done()`` every 5 ms until it is true (True) or ``seconds`` passed (False): the
    scenario records what it saw either way, and the test asserts on that."""
    end = time.monotonic() + seconds
    while not done():
        if time.monotonic() >= end:
            return False
        time.sleep(0.005)
    return True


def fake_nccl_logic(ctx) -> None:
    import fake_nccl
    from fastdist.ops import polled

    fake_nccl.register()
    fastdist.init_process_group(fake_nccl.NAME, store=dist.HashStore(), rank=0, world_size=1)
    t = torch.ones(1)
    # A blocking call returns when the "device" finished, not when the future did (at once).
    fake_nccl.DELAY = 0.3
    t0 = time.monotonic()
    fastdist.all_reduce(t, timeout=5)
    fastdist.barrier(timeout=5)
    ctx.record("blocking", elapsed=time.monotonic() - t0)
    # Async: wait() polls the work itself; a handle nobody waits on is released by the reaper.
    fake_nccl.DELAY = 0.2
    reaped = polled.reaper.reaped
    t0 = time.monotonic()  # before the issue: the op takes DELAY from there
    h = fastdist.all_reduce(t, async_op=True, timeout=5)
    first = h.is_completed()
    ok = h.wait()
    elapsed = time.monotonic() - t0
    unwaited = fastdist.all_reduce(t, async_op=True, timeout=5)
    # The reaper releases it (DELAY after its issue): poll for that, bounded.
    _poll_until(lambda: polled.reaper.pending() == 0 and unwaited.is_completed(), 3.0)
    ctx.record(
        "async",
        first=first,
        ok=ok,
        elapsed=elapsed,
        reaped=polled.reaper.reaped - reaped,
        pending=polled.reaper.pending(),
        unwaited_done=unwaited.is_completed() and unwaited.exception() is None,
    )
    # A hang: the deadline fires, the communicators are aborted, the group is dead.
    fake_nccl.DELAY = math.inf
    t0 = time.monotonic()
    try:
        fastdist.all_reduce(t, timeout=0.5)
        ctx.record("no_timeout")
    except CollectiveTimeoutError as e:
        elapsed = time.monotonic() - t0
        ctx.record(
            "timeout",
            elapsed=elapsed,
            aborts_done=polled.wait_aborts(),
            aborted=len(fake_nccl.aborted_groups),
            message=str(e),
        )
    try:
        fastdist.all_reduce(t, timeout=5)
    except GroupAbortedError:
        ctx.record("refused")
    new = fastdist.recover(timeout=5)
    fake_nccl.DELAY = 0.0
    t = torch.tensor([3.0])
    fastdist.all_reduce(t, timeout=5)
    ctx.record("recovered", value=t.item(), new_group=new is not None, dead=fastdist.is_dead())
    # An async handle nobody waits on still times out and aborts.
    fake_nccl.DELAY = math.inf
    aborted_before = len(fake_nccl.aborted_groups)
    h = fastdist.all_reduce(t, async_op=True, timeout=0.3)
    _poll_until(lambda: h.is_completed() and len(fake_nccl.aborted_groups) > aborted_before, 3.0)
    ctx.record(
        "unwaited",
        completed=h.is_completed(),
        error=type(h.exception()).__name__,
        dead=fastdist.is_dead(),
        aborted=len(fake_nccl.aborted_groups),
    )
    fastdist.recover(timeout=5)
    # Finally, an abort that hangs: the caller still raises at its deadline, and the abort's own
    # deadline (FASTDIST_ABORT_TIMEOUT=0.5 in this run) ends the process while recover() waits.
    fake_nccl.ABORT_HANGS = True
    ctx.record("before_hanging_abort")
    t0 = time.monotonic()
    try:
        fastdist.all_reduce(t, timeout=0.3)
    except CollectiveTimeoutError:
        ctx.record("raised_while_aborting", elapsed=time.monotonic() - t0)
    fastdist.recover(timeout=5)
    ctx.record("survived_hanging_abort")


def fake_nccl_report(ctx) -> None:
    """3 ranks on the NCCL path (the test double): rank 0 in all_reduce, rank 1 in barrier (out of
    step), rank 2 never comes. The report names the missing and the desynced rank, as on gloo."""
    import fake_nccl

    fake_nccl.register()
    fastdist.init_process_group(
        fake_nccl.NAME, store=dist.PrefixStore("pg", ctx.store), rank=ctx.rank, world_size=ctx.world_size
    )
    t = torch.ones(1)
    fastdist.all_reduce(t, timeout=20)  # every rank: completes once all three issued it
    fastdist.barrier(timeout=20)
    ctx.record("healthy")
    if ctx.rank == 2:
        ctx.wait_release()
        return
    start = time.monotonic()
    try:
        if ctx.rank == 0:
            fastdist.all_reduce(t, timeout=1.5)
        else:
            fastdist.barrier(timeout=1.5)
        ctx.record("no_timeout")
    except CollectiveTimeoutError as e:
        record_error(ctx, "error", e, start)
    try:
        fastdist.barrier(timeout=5)
    except GroupAbortedError:
        ctx.record("refused")
