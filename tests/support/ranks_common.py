"""Rank code shared by several tests' rank modules (*_ranks.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import fastdist
import torch
import torch.distributed as dist


def record_error(ctx, event: str, err, start: float) -> None:
    ctx.record(
        event,
        kind=type(err).__name__,
        elapsed=time.monotonic() - start,
        message=str(err),
        missing=getattr(err, "missing_ranks", None),
        desynced={str(k): v for k, v in (getattr(err, "desynced", None) or {}).items()},
    )


def after_recovery(ctx, new_group, event: str = "recovered") -> None:
    """Correct results on the rebuilt group."""
    t = torch.tensor([float(dist.get_rank() + 1)])
    fastdist.all_reduce(t, group=new_group, timeout=20)
    n = dist.get_world_size()
    objs = [None] * n
    fastdist.all_gather_object(objs, dist.get_rank(), timeout=20)
    h = fastdist.all_reduce(torch.ones(1), async_op=True, timeout=20)
    assert h.wait() is True
    ctx.record(
        event,
        rank=dist.get_rank(),
        world_size=n,
        sum=t.item(),
        objs=objs,
        default=new_group is dist.group.WORLD,
    )


def stop_for(seconds: float) -> None:
    """SIGSTOP this process; a detached shell resumes it ``seconds`` later."""
    subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"], start_new_session=True)
    os.kill(os.getpid(), signal.SIGSTOP)


def load_batch(ctx, key: str) -> int:
    """Rank 2's stand-in for a data loader that never returns: a Python loop, in no collective,
    until the test lets it go (the report must name this function and its line)."""
    n = 0
    while not ctx.store.check([key]):
        n += sum(range(2000))
    return n
