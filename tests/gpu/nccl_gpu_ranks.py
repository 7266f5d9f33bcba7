"""The ranks of tests/gpu/test_nccl_gpu.py: NCCL on a GPU."""

from __future__ import annotations

import os
import time

import fastdist
import torch
import torch.distributed as dist
from fastdist import CollectiveTimeoutError


def _sleep_cycles_per_second() -> float:
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    t0 = time.monotonic()
    torch.cuda._sleep(int(2e8))
    torch.cuda.synchronize()
    return 2e8 / (time.monotonic() - t0)


def gpu_nccl_timeout_and_recover(ctx) -> None:
    """One GPU: healthy NCCL ops; an all_reduce queued behind a 3 s stream stall with timeout 1 s
    raises CollectiveTimeoutError in time, the process survives, recover() gives a working group."""

    torch.cuda.set_device(ctx.rank)
    fastdist.init_process_group(
        "nccl", store=dist.PrefixStore("pg", ctx.store), rank=ctx.rank, world_size=ctx.world_size
    )
    ctx.record("env", mode=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), torch=torch.__version__)
    t = torch.ones(1024, device="cuda")
    fastdist.all_reduce(t, timeout=30)
    assert fastdist.barrier(timeout=30)
    h = fastdist.all_reduce(t, async_op=True, timeout=30)
    assert h.wait() is True
    torch.cuda.synchronize()
    ctx.record("healthy", value=t[0].item())
    rate = _sleep_cycles_per_second()
    results = []
    for attempt in range(3):
        torch.cuda._sleep(int(rate * 3.0))  # the stream is busy for ~3 s: the collective waits behind it
        t0 = time.monotonic()
        try:
            fastdist.all_reduce(t, timeout=1.0)
            ctx.record("no_timeout", attempt=attempt)
            return
        except CollectiveTimeoutError as e:
            detected = time.monotonic() - t0
            message = str(e)
        t1 = time.monotonic()
        new = fastdist.recover(timeout=30)
        recovered = time.monotonic() - t1
        t = torch.full((1024,), 2.0, device="cuda")
        fastdist.all_reduce(t, group=new, timeout=30)
        torch.cuda.synchronize()  # the new collective also waits for the stall to end
        first_ok = time.monotonic() - t1
        results.append(
            {
                "detected": detected,
                "past_deadline": detected - 1.0,
                "recover": recovered,
                "first_ok_after_recover": first_ok,
                "value": t[0].item() / ctx.world_size,
                "message": message,
            }
        )
    ctx.record("timeouts", results=results)
    # An async handle and a barrier behind the same kind of stall: both honour their deadline.
    for kind in ("async_all_reduce", "barrier"):
        torch.cuda._sleep(int(rate * 3.0))
        t0 = time.monotonic()
        try:
            if kind == "barrier":
                fastdist.barrier(timeout=1.0)
            else:
                h = fastdist.all_reduce(t, async_op=True, timeout=1.0)
                h.wait()
            ctx.record("no_timeout", kind=kind)
            return
        except CollectiveTimeoutError as e:
            ctx.record("stalled", kind=kind, detected=time.monotonic() - t0, message=str(e))
        fastdist.recover(timeout=30)
    time.sleep(2.0)  # torch's watchdog must not kill the process after fastdist aborted
    assert fastdist.barrier(timeout=30)
    ctx.record("alive_after", ok=True)


def gpu_nccl_missing_rank(ctx) -> None:
    """Two or more GPUs: the last rank skips an all_reduce; the others report it missing."""
    torch.cuda.set_device(ctx.rank)
    fastdist.init_process_group(
        "nccl", store=dist.PrefixStore("pg", ctx.store), rank=ctx.rank, world_size=ctx.world_size
    )
    t = torch.ones(1024, device="cuda")
    fastdist.all_reduce(t, timeout=30)
    torch.cuda.synchronize()
    if ctx.rank == ctx.world_size - 1:
        ctx.wait_release()
        return
    t0 = time.monotonic()
    try:
        fastdist.all_reduce(t, timeout=2.0)
        ctx.record("no_timeout")
    except CollectiveTimeoutError as e:
        ctx.record("timeout", elapsed=time.monotonic() - t0, missing=e.missing_ranks, message=str(e))
