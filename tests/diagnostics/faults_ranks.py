"""The ranks of tests/diagnostics/test_faults.py: a training loop under injected faults (fastdist.faults)."""

from __future__ import annotations

import time

import fastdist
import torch
import torch.distributed as dist
from fastdist import CollectiveTimeoutError, GroupAbortedError
from fastdist.faults import Fault, inject
from ranks_common import after_recovery, record_error

STEP_TIMEOUT = 1.5


def _train(ctx, faults, steps: int, timeout: float = STEP_TIMEOUT):
    """A training loop of all_reduces with the given faults. Returns (step, error) for the
    first step that failed, or (steps, None); records how long the failing call took."""
    for step in range(steps):
        wrong = inject(faults, step, ctx.rank) == "wrong_collective"
        t = torch.tensor([1.0])
        call_start = time.monotonic()
        try:
            if wrong:
                fastdist.barrier(timeout=timeout)
            else:
                fastdist.all_reduce(t, timeout=timeout)
                assert t.item() == dist.get_world_size(), t
        except (CollectiveTimeoutError, GroupAbortedError) as e:
            ctx.record("failing_call", step=step, seconds=time.monotonic() - call_start)
            return step, e
    return steps, None


def _fault_run(ctx, faults, steps: int = 4, shrink: bool = True) -> None:
    ctx.init()
    start = time.monotonic()
    step, err = _train(ctx, faults, steps)
    if err is None:
        ctx.record("no_error")
        return
    record_error(ctx, "error", err, start + 0)  # elapsed is measured from the loop's start
    ctx.record("failed_at", step=step)
    t0 = time.monotonic()
    new = fastdist.recover(timeout=3.0 if shrink else 20.0, allow_shrink=shrink)
    ctx.record("recover_time", seconds=time.monotonic() - t0)
    after_recovery(ctx, new)


def fault_hang_two_of_four(ctx) -> None:
    _fault_run(ctx, [Fault("hang", rank=2, step=2), Fault("hang", rank=3, step=2)])


def fault_sigstop(ctx) -> None:
    _fault_run(ctx, [Fault("sigstop", rank=2, step=1)])


def fault_exit(ctx) -> None:
    _fault_run(ctx, [Fault("exit", rank=1, step=1, exit_code=0)])


def fault_sigkill_mid_all_reduce(ctx) -> None:
    ctx.init()
    start = time.monotonic()
    _train(ctx, [], 1)
    t = torch.ones(8 * 1024 * 1024)  # 32 MB: the ring takes long enough to be cut mid-way
    if ctx.rank == 2:
        fastdist.all_reduce(t, async_op=True, timeout=30)  # in flight...
        inject([Fault("sigkill", rank=2, step=0)], 0, 2)
    try:
        fastdist.all_reduce(t, timeout=STEP_TIMEOUT)
        ctx.record("no_error")
        return
    except (CollectiveTimeoutError, GroupAbortedError) as e:
        record_error(ctx, "error", e, start)
    new = fastdist.recover(timeout=3.0, allow_shrink=True)
    after_recovery(ctx, new)


def fault_wrong_collective(ctx) -> None:
    """Rank 2 calls barrier where the others call all_reduce: everyone times out with the same
    desync report; recovery keeps all three; then, with checks on, a size mismatch is caught."""
    ctx.init()
    start = time.monotonic()
    _step, err = _train(ctx, [Fault("wrong_collective", rank=2, step=1)], 3)
    record_error(ctx, "error", err, start)
    new = fastdist.recover(timeout=20)
    after_recovery(ctx, new)
    fastdist.set_checks(True)
    n = 3 if ctx.rank == 2 else 2
    out = [torch.zeros(2) for _ in range(3)]
    try:
        fastdist.all_gather(out, torch.zeros(n), timeout=10)
        ctx.record("no_mismatch")
    except fastdist.CollectiveMismatchError as e:
        ctx.record("mismatch", message=str(e), differing={str(k): v for k, v in e.differing.items()})
    t = torch.ones(1)
    fastdist.all_reduce(t, timeout=10)  # the group is still usable after a mismatch
    fastdist.set_checks(False)
    ctx.record("after_mismatch", value=t.item())


def fault_straggler_rejoins(ctx) -> None:
    """Rank 2 stalls past the deadline; the others time out and wait in recover(); the straggler
    wakes, is refused at once by the dead group, and joins the recovery."""
    ctx.init()
    start = time.monotonic()
    _step, err = _train(ctx, [Fault("hang", rank=2, step=1, seconds=STEP_TIMEOUT + 1.5)], 3)
    record_error(ctx, "error", err, start)
    new = fastdist.recover(timeout=20)
    after_recovery(ctx, new)


def fault_straggler_left_out(ctx) -> None:
    """Rank 2 stalls until the others have rebuilt the group without it: it is refused at once by
    the dead group, and its recover() says it was left out."""
    ctx.init()
    start = time.monotonic()
    faults = [Fault("hang", rank=2, step=1, seconds=STEP_TIMEOUT + 3.0)]
    _step, err = _train(ctx, faults, 3)
    record_error(ctx, "error", err, start)
    if ctx.rank == 2:
        try:
            fastdist.recover(timeout=5, allow_shrink=True)
            ctx.record("recovered_unexpectedly")
        except fastdist.RecoveryError as e:
            ctx.record("left_out", message=str(e))
        return
    new = fastdist.recover(timeout=1.0, allow_shrink=True)
    after_recovery(ctx, new)


def dead_peer_not_waited_for(ctx) -> None:
    """3 ranks launched by hand (no agent); rank 2 is SIGKILLed in an all_reduce the others wait
    in (a 3.3 s step deadline): they raise at once, and recover(allow_shrink=True) with a 20 s
    timeout leaves rank 2 out without waiting for it."""
    ctx.init()
    fastdist.barrier(timeout=20)
    t = torch.ones(1)
    if ctx.rank == 2:
        time.sleep(0.5)
        ctx.record("dying", wall=time.time())
        inject([Fault("sigkill", rank=2, step=0)], 0, 2)
    try:
        fastdist.all_reduce(t, timeout=3.3)
        ctx.record("no_error")
        return
    except (CollectiveTimeoutError, GroupAbortedError) as e:
        ctx.record("error", kind=type(e).__name__, message=str(e), wall=time.time())
    t0 = time.monotonic()
    new = fastdist.recover(timeout=20, allow_shrink=True)
    ctx.record("recover_time", seconds=time.monotonic() - t0)
    after_recovery(ctx, new)
