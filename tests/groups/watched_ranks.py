"""The ranks of tests/groups/test_watched.py: collectives torch issues itself (DDP, FSDP2, DeviceMesh,
torch.distributed) on watched groups, bounded, diagnosed and recovered in place."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta

import fastdist
import torch
import torch.distributed as dist
from ranks_common import stop_for
from torch import nn

STEP = 2.0  # each training step's fail_after


def _train_with_a_stop(ctx, model, steps: int, stop_at: int) -> None:
    """Steps under fail_after(STEP); rank 2 is stopped for 5 s before its backward at ``stop_at``.
    A failed step is retried after recover() on every rank."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step, stopped = 0, False
    while step < steps:
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step * 7 + ctx.rank))
        t0 = time.monotonic()
        try:
            # Step 0 also absorbs the ranks' uneven start (FSDP2's lazy init, a loaded machine).
            with fastdist.fail_after(STEP if step else 30.0):
                opt.zero_grad()
                loss = model(x).pow(2).mean()
                if step == stop_at and ctx.rank == 2 and not stopped:
                    stopped = True
                    stop_for(5.0)
                loss.backward()
                opt.step()
            step += 1
        except fastdist.FastdistError as e:
            ctx.record(
                "error",
                kind=type(e).__name__,
                step=step,
                seconds=time.monotonic() - t0,
                missing=getattr(e, "missing_ranks", None),
                message=str(e),
            )
            t1 = time.monotonic()
            pg = dist.group.WORLD
            same = fastdist.recover(timeout=30) is pg
            ctx.record(
                "recovered", seconds=time.monotonic() - t1, same_group=same, world_size=dist.get_world_size()
            )


def watched_ddp(ctx) -> None:
    ctx.init()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    _train_with_a_stop(ctx, model, steps=5, stop_at=2)
    ctx.record("final", params=[float(p.detach().double().sum()) for p in model.parameters()])


def watched_fsdp2(ctx) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ctx.init()
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train_with_a_stop(ctx, model, steps=4, stop_at=2)
    full = [float(p.full_tensor().detach().double().sum()) for p in model.parameters()]
    ctx.record("final", params=full)


def watched_dist_ops(ctx) -> None:
    """4 ranks; torch.distributed calls on watched groups with rank 3 away: under a scope
    (all_reduce, barrier), under a subgroup's own timeout (all_gather_into_tensor, no scope), and on
    a subgroup of a 2-D DeviceMesh (2 x 2: rank 3 shares its "tp" group with rank 2). Every rank
    that waited gets CollectiveTimeoutError naming rank 3, and the groups recover in place."""
    from torch.distributed.device_mesh import init_device_mesh

    ctx.init()
    ws = ctx.world_size
    away = ws - 1
    sub = dist.new_group(list(range(ws)), timeout=timedelta(seconds=1.5))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh.get_group("tp")
    t = torch.ones(2)
    dist.all_reduce(t)
    dist.barrier()
    out = torch.zeros(2 * ws)
    dist.all_gather_into_tensor(out, torch.full((2,), float(ctx.rank)), group=sub)
    m = torch.full((1,), float(ctx.rank))
    dist.all_reduce(m, group=tp)
    ctx.record(
        "healthy", value=t.tolist(), gathered=out.tolist(), tp_size=dist.get_world_size(tp), tp_sum=m.item()
    )

    def phase(name, call, group, waits):
        if ctx.rank == away:
            time.sleep(2.2)  # away past the others' deadline
        elif waits:
            t0 = time.monotonic()
            try:
                call()
                ctx.record("no_error", phase=name)
            except fastdist.CollectiveTimeoutError as e:
                ctx.record(
                    "timeout",
                    phase=name,
                    seconds=time.monotonic() - t0,
                    missing=e.missing_ranks,
                    message=str(e),
                )
        back = fastdist.recover(group, timeout=30)
        ctx.record("recovered", phase=name, same=back is (group or dist.group.WORLD))

    def scoped_all_reduce():
        with fastdist.fail_after(1.0):
            dist.all_reduce(torch.ones(2))

    def scoped_barrier():
        with fastdist.fail_after(1.0):
            dist.barrier()

    def default_timeout_gather():
        dist.all_gather_into_tensor(torch.zeros(2 * ws), torch.ones(2), group=sub)  # no scope: sub's 1.5 s

    def mesh_all_reduce():
        with fastdist.fail_after(1.0):
            dist.all_reduce(torch.ones(2), group=tp)

    phase("all_reduce", scoped_all_reduce, None, True)
    phase("barrier", scoped_barrier, None, True)
    phase("sub_default", default_timeout_gather, sub, True)
    phase("mesh", mesh_all_reduce, tp, ctx.rank == 2)  # ranks 0 and 1 have a tp group of their own
    t = torch.full((1,), float(ctx.rank + 1))
    dist.all_reduce(t)
    t2 = torch.full((1,), float(ctx.rank + 1))
    dist.all_reduce(t2, group=tp)
    ctx.record("after", value=t.item(), mesh_value=t2.item())


def watched_ctrl_c(ctx) -> None:
    """2 ranks; rank 1 stays away. Rank 0 is interrupted (SIGINT) inside DDP's backward, then
    inside a fastdist.recv: KeyboardInterrupt within 0.5 s each time, and the process then exits
    promptly."""
    ctx.init()
    sub = dist.new_group([0, 1])
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(16, 4))
    for _ in range(2):  # DDP settles its buckets (a broadcast) at the start of the second step
        model(torch.ones(2, 16)).sum().backward()
    ctx.record("healthy")
    if ctx.rank == 1:
        ctx.wait_release()
        return
    loss = model(torch.ones(2, 16)).sum()

    def interrupt_in(seconds: float) -> float:
        sent = []
        timer = threading.Timer(
            seconds, lambda: (sent.append(time.monotonic()), os.kill(os.getpid(), signal.SIGINT))
        )
        timer.start()
        return sent  # type: ignore[return-value]

    sent = interrupt_in(1.0)
    try:
        loss.backward()  # DDP's all_reduce waits for rank 1: the group's 60 s default
        ctx.record("no_interrupt")
    except KeyboardInterrupt:
        ctx.record("interrupted", where="ddp_backward", after=time.monotonic() - sent[0])
    sent = interrupt_in(0.5)
    try:
        fastdist.recv(torch.zeros(1), src=1, group=sub, timeout=6)
        ctx.record("no_interrupt")
    except KeyboardInterrupt:
        ctx.record("interrupted", where="recv", after=time.monotonic() - sent[0])
    ctx.record("dead", default=fastdist.is_dead(), sub=fastdist.is_dead(sub))


def ctrl_c_before_the_op(ctx) -> None:
    """2 ranks; rank 1 stays away. Rank 0's backward computes one large gradient (about a second
    of C++: no Python runs) before DDP issues its one bucket's all_reduce, and Ctrl-C comes
    during that computation, when no op is in flight: the all_reduce, issued after it, raises
    the KeyboardInterrupt (it waited out the group's 60 s before, in a wait torch makes in C++)."""
    ctx.init()
    torch.manual_seed(0)
    net = nn.Linear(1024, 1024, bias=False)
    model = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=1024)
    x = torch.randn(4096, 1024)
    ctx.record("healthy")
    if ctx.rank == 1:
        ctx.wait_release()
        return
    loss = model(x).pow(2).sum()
    t0 = time.monotonic()
    (x @ net.weight).sum()  # (warm: the timer below must land in the backward's matmul)
    timer = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        loss.backward()
        ctx.record("no_interrupt")
    except KeyboardInterrupt:
        ctx.record("interrupted", after=time.monotonic() - t0)
    ctx.record("dead", default=fastdist.is_dead())


def ctrl_c_rings_peers(ctx) -> None:
    """3 ranks; rank 2 stays away. Ranks 0 and 1 wait in one all_reduce (60 s); rank 0 gets
    Ctrl-C: rank 1 raises at once, saying rank 0 was interrupted, not a timeout."""
    ctx.init()
    fastdist.barrier(timeout=20)
    if ctx.rank == 2:
        ctx.wait_release()
        return
    if ctx.rank == 0:
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    try:
        fastdist.all_reduce(torch.ones(1), timeout=60)
    except KeyboardInterrupt:
        ctx.record("interrupted", after=time.monotonic() - start)
    except fastdist.FastdistError as e:
        ctx.record("peer", type=type(e).__name__, message=str(e), after=time.monotonic() - start)
