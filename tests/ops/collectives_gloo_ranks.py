"""The ranks of tests/ops/test_collectives_gloo.py: fastdist's own collectives on gloo, one rank absent."""

from __future__ import annotations

import sys
import time

import fastdist
import torch
import torch.distributed as dist
from fastdist import CollectiveTimeoutError, GroupAbortedError


def _healthy_round(ctx, group=None) -> None:
    """A barrier and an all_gather that must succeed with the right data."""
    ws = ctx.world_size
    assert fastdist.barrier(group, timeout=20) is True
    t = torch.tensor([ctx.rank, ctx.rank * 10], dtype=torch.float32)
    out = [torch.zeros(2) for _ in range(ws)]
    fastdist.all_gather(out, t, group, timeout=20)
    expected = [[r, r * 10] for r in range(ws)]
    assert [o.tolist() for o in out] == expected, out
    c = torch.tensor([complex(ctx.rank, 1)])
    outc = [torch.zeros(1, dtype=torch.complex64) for _ in range(ws)]
    fastdist.all_gather(outc, c, group, timeout=20)
    assert [o.item() for o in outc] == [complex(r, 1) for r in range(ws)], outc


def timeout_one_absent(ctx) -> None:
    """Healthy rounds, then the last rank stays away from a barrier: the others time out, later
    calls are refused at once, and the processes exit promptly."""
    ctx.init()
    _healthy_round(ctx)
    ctx.record("healthy")
    absent = ctx.world_size - 1
    if ctx.rank == absent:
        ctx.wait_release()
        return
    timeout = 1.5
    start = time.monotonic()
    try:
        fastdist.barrier(timeout=timeout)
        ctx.record("no_timeout")
    except CollectiveTimeoutError as e:
        ctx.record(
            "timeout",
            elapsed=time.monotonic() - start,
            op=e.op,
            rank=e.rank,
            world_size=e.world_size,
            group=e.group,
            timeout=e.timeout,
            err_elapsed=e.elapsed,
            is_timeout_error=isinstance(e, TimeoutError),
            message=str(e),
        )
    assert fastdist.is_dead()
    start = time.monotonic()
    try:
        fastdist.all_gather([torch.zeros(1) for _ in range(ctx.world_size)], torch.zeros(1), timeout=30)
    except GroupAbortedError as e:
        ctx.record("aborted", elapsed=time.monotonic() - start, message=str(e))
    # raise_on_timeout=False on a dead group still refuses: the group is aborted, not slow.
    try:
        fastdist.barrier(timeout=30, raise_on_timeout=False)
    except GroupAbortedError:
        ctx.record("aborted_again")


def shared_deadline_and_handler(ctx) -> None:
    """2 ranks. Two calls sharing one RendezvousTimeout stop at its deadline; a timeout handler
    runs before the raise; then a handler's sys.exit(3) ends the process with code 3."""
    ctx.init()
    sub = dist.new_group([0, 1])
    _healthy_round(ctx)
    _healthy_round(ctx, sub)
    ctx.record("healthy")
    if ctx.rank == 1:
        # Join rank 0's first shared-deadline call late, then stay away from the second.
        time.sleep(0.5)
        out = [torch.zeros(1) for _ in range(2)]
        fastdist.all_gather(out, torch.ones(1), timeout=30)
        ctx.wait_release()
        return

    seen = []
    fastdist.set_timeout_handler(lambda err: seen.append(err))
    rt = fastdist.RendezvousTimeout(timeout=2.0)
    assert not rt.closed and rt.deadline is None
    out = [torch.zeros(1) for _ in range(2)]
    fastdist.all_gather(out, torch.zeros(1), timeout=rt)  # closes rt, then waits ~0.5 s for rank 1
    assert rt.closed and [o.item() for o in out] == [0.0, 1.0]
    first_done = fastdist.current_time()
    try:
        fastdist.barrier(timeout=rt)
        ctx.record("no_timeout")
    except CollectiveTimeoutError as e:
        now = fastdist.current_time()
        ctx.record(
            "shared_timeout",
            after_deadline=now - rt.deadline,
            second_call_budget=e.timeout,
            first_call=first_done - (rt.deadline - 2.0),
            timed_out=rt.is_timed_out(),
            handler_saw_same=len(seen) == 1 and seen[0] is e,
        )

    # The sub-group is separate and still healthy; its timeout goes to a handler that exits.
    def exit_three(err):
        ctx.record("handler", op=err.op, group=err.group)
        sys.exit(3)

    fastdist.set_timeout_handler(exit_three)
    fastdist.barrier(sub, timeout=1.0)
    ctx.record("handler_returned")
