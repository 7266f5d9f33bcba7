"""The ranks of tests/store/test_etcd.py: a job on an etcd store."""

from __future__ import annotations

import os
import signal
import time

import fastdist
import torch
import torch.distributed as dist
from fastdist import CollectiveTimeoutError, GroupAbortedError
from ranks_common import load_batch


def _init(ctx) -> None:
    fastdist.init_process_group(
        "gloo", os.environ["FASTDIST_TEST_ETCD_URL"], rank=ctx.rank, world_size=ctx.world_size, timeout=60
    )


def _sum_check(ctx, event: str) -> None:
    t = torch.tensor([float(dist.get_rank() + 1)])
    fastdist.all_reduce(t, timeout=20)
    ctx.record(event, rank=dist.get_rank(), world_size=dist.get_world_size(), sum=t.item())


def etcd_job(ctx) -> None:
    """3 ranks on etcd. Healthy collectives; A: rank 2 stays in load_batch, ranks 0 and 1 time
    out naming it, all recover; B: rank 0 (the rank that would host a TCPStore) is SIGKILLed mid
    all_reduce: ranks 1 and 2 get a typed error and recover(allow_shrink=True) to 2 ranks."""
    _init(ctx)
    store = dist.distributed_c10d._get_default_store()
    ctx.record("store", kind=type(getattr(store, "underlying_store", store)).__name__)
    _sum_check(ctx, "healthy")
    objs = [None] * 3
    fastdist.all_gather_object(objs, ctx.rank, timeout=20)
    ctx.record("objects", objs=objs)
    # A
    if ctx.rank == 2:
        load_batch(ctx, "go_a")
    else:
        t0 = time.monotonic()
        try:
            fastdist.barrier(timeout=1)
            ctx.record("a_no_error")
        except CollectiveTimeoutError as e:
            ctx.record("a", missing=e.missing_ranks, message=str(e), elapsed=time.monotonic() - t0)
        if ctx.rank == 0:
            ctx.store.set("go_a", "1")
    t0 = time.monotonic()
    fastdist.recover(timeout=30)
    ctx.record("recover_a", seconds=time.monotonic() - t0)
    _sum_check(ctx, "recovered_a")
    # B
    big = torch.ones(8 * 1024 * 1024)  # 32 MB: the ring takes long enough to be cut mid-way
    if ctx.rank == 0:
        fastdist.all_reduce(big, async_op=True, timeout=30)  # in flight...
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        fastdist.all_reduce(big, timeout=10)
        ctx.record("b_no_error")
    except (CollectiveTimeoutError, GroupAbortedError) as e:
        ctx.record("b", type=type(e).__name__, message=str(e), elapsed=time.monotonic() - t0)
    t0 = time.monotonic()
    fastdist.recover(timeout=3, allow_shrink=True)
    ctx.record("recover_b", seconds=time.monotonic() - t0)
    _sum_check(ctx, "recovered_b")


def etcd_member_lost(ctx) -> None:
    """3 ranks on a 3-member etcd cluster; rank 0 kills the member the job's URL names first
    (every rank's current endpoint) mid-job: the job goes on, through a timeout and recover()."""
    _init(ctx)
    _sum_check(ctx, "before")
    fastdist.barrier(timeout=20)
    if ctx.rank == 0:
        os.kill(int(os.environ["FASTDIST_TEST_ETCD_KILL_PID"]), signal.SIGKILL)
        ctx.record("killed_member")
    fastdist.barrier(timeout=20)
    _sum_check(ctx, "after_loss")
    # The store is needed again: a report, a recovery, a new group.
    if ctx.rank == 2:
        load_batch(ctx, "go_m")
    else:
        try:
            fastdist.barrier(timeout=1)
            ctx.record("m_no_error")
        except CollectiveTimeoutError as e:
            ctx.record("m", missing=e.missing_ranks)
        if ctx.rank == 0:
            ctx.store.set("go_m", "1")
    fastdist.recover(timeout=30)
    _sum_check(ctx, "recovered")
    sub = dist.new_group([0, 1])
    if ctx.rank in (0, 1):
        t = torch.ones(1)
        fastdist.all_reduce(t, group=sub, timeout=20)
        ctx.record("subgroup", sum=t.item())
