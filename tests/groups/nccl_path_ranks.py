"""The ranks of tests/groups/test_nccl_path.py: the NCCL path on the CPU double of ProcessGroupNCCL
(tests/support/fake_nccl.py): the C++ path real NCCL takes (WatchedBackend, polled completion)."""

from __future__ import annotations

import math
import time
from datetime import timedelta

import fastdist
import torch
import torch.distributed as dist
from fastdist import CollectiveTimeoutError, GroupAbortedError
from fastdist.groups import abort
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

    fake_nccl.register()
    fastdist.init_process_group(fake_nccl.NAME, store=dist.HashStore(), rank=0, world_size=1)
    t = torch.ones(1)
    # A blocking call returns when the "device" finished, not when the future did (at once).
    fake_nccl.configure(delay=0.3)
    t0 = time.monotonic()
    fastdist.all_reduce(t, timeout=5)
    fastdist.barrier(timeout=5)
    ctx.record("blocking", elapsed=time.monotonic() - t0)
    # Async: wait() returns once the op ran; a handle nobody waits on completes all the same
    # (fastdist's poller queries its end event).
    fake_nccl.configure(delay=0.2)
    t0 = time.monotonic()  # before the issue: the op takes DELAY from there
    h = fastdist.all_reduce(t, async_op=True, timeout=5)
    first = h.is_completed()
    ok = h.wait()
    elapsed = time.monotonic() - t0
    unwaited = fastdist.all_reduce(t, async_op=True, timeout=5)
    _poll_until(unwaited.is_completed, 3.0)
    ctx.record(
        "async",
        first=first,
        ok=ok,
        elapsed=elapsed,
        unwaited_done=unwaited.is_completed() and unwaited.exception() is None,
    )
    # A hang: the deadline fires, the communicators are aborted, the group is dead.
    fake_nccl.configure(delay=math.inf)
    t0 = time.monotonic()
    try:
        fastdist.all_reduce(t, timeout=0.5)
        ctx.record("no_timeout")
    except CollectiveTimeoutError as e:
        elapsed = time.monotonic() - t0
        ctx.record(
            "timeout",
            elapsed=elapsed,
            aborts_done=abort.wait_aborts(),
            aborted=fake_nccl.aborts(),
            message=str(e),
        )
    try:
        fastdist.all_reduce(t, timeout=5)
    except GroupAbortedError:
        ctx.record("refused")
    fake_nccl.configure(delay=0.0)  # the "GPU" runs again (the stalled op was aborted)
    new = fastdist.recover(timeout=5)
    t = torch.tensor([3.0])
    fastdist.all_reduce(t, timeout=5)
    ctx.record("recovered", value=t.item(), new_group=new is not None, dead=fastdist.is_dead())
    # An async handle nobody waits on still times out and aborts.
    fake_nccl.configure(delay=math.inf)
    aborted_before = fake_nccl.aborts()
    h = fastdist.all_reduce(t, async_op=True, timeout=0.3)
    _poll_until(lambda: h.is_completed() and fake_nccl.aborts() > aborted_before, 3.0)
    ctx.record(
        "unwaited",
        completed=h.is_completed(),
        error=type(h.exception()).__name__,
        dead=fastdist.is_dead(),
        aborted=fake_nccl.aborts(),
    )
    fake_nccl.configure(delay=0.0)
    fastdist.recover(timeout=5)
    # Finally, an abort that hangs: the caller still raises at its deadline, and the abort's own
    # deadline (FASTDIST_ABORT_TIMEOUT=0.5 in this run) ends the process while recover() waits.
    fake_nccl.configure(delay=math.inf, abort_hangs=True)
    ctx.record("before_hanging_abort")
    t0 = time.monotonic()
    try:
        fastdist.all_reduce(t, timeout=0.3)
    except CollectiveTimeoutError:
        ctx.record("raised_while_aborting", elapsed=time.monotonic() - t0)
    fastdist.recover(timeout=5)
    ctx.record("survived_hanging_abort")


def nccl_double_contract(ctx) -> None:
    """The double itself follows ProcessGroupNCCL's contract (what the watched backend must cope
    with), and torch.distributed's own calls on a watched group over it are bounded: a
    synchronous op, for which the backend hands back no work, included."""
    import fake_nccl

    fake_nccl.register()
    raw = fake_nccl.make(dist.HashStore(), 0, 1, timedelta(seconds=30))
    t = torch.ones(1)
    fake_nccl.configure(delay=0.3)
    sync = dist.AllreduceOptions()
    sync.asyncOp = False
    work = raw.allreduce([t], dist.AllreduceOptions())
    try:
        work.is_success()
        said = None
    except NotImplementedError as e:
        said = str(e).splitlines()[0]
    t0 = time.monotonic()
    future_done = work.get_future().done()  # at enqueue
    waited = work.wait()  # orders streams only: at once
    ctx.record(
        "double",
        sync_work=raw.allreduce([t], sync) is None,
        is_success=said,
        future_done_at_enqueue=future_done,
        completed_at_enqueue=work.is_completed(),
        wait_returned=waited,
        wait_seconds=time.monotonic() - t0,
    )
    _poll_until(work.is_completed, 3.0)
    fake_nccl.configure(delay=math.inf)
    stuck = raw.allreduce([t], dist.AllreduceOptions())
    raw.abort()
    # An aborted communicator's op reads as completed, with no error (WorkNCCL after ncclCommAbort).
    ctx.record("double_aborted", completed=stuck.is_completed(), error=not fake_nccl.has_error(stuck))

    fastdist.init_process_group(fake_nccl.NAME, store=dist.HashStore(), rank=0, world_size=1)
    fake_nccl.configure(delay=0.3)
    t0 = time.monotonic()
    dist.all_reduce(t)  # synchronous: no work from the backend; bounded through its stream
    w = dist.all_reduce(t, async_op=True)
    fut = w.get_future()
    fut_early = fut.done()
    fut.wait()
    ctx.record("torch_ops", elapsed=time.monotonic() - t0, future_done_at_issue=fut_early)
    fake_nccl.configure(delay=math.inf)
    t0 = time.monotonic()
    try:
        with fastdist.fail_after(0.5):
            dist.all_reduce(t)
        ctx.record("no_timeout")
    except CollectiveTimeoutError as e:
        ctx.record("sync_timeout", elapsed=time.monotonic() - t0, message=str(e))
    fake_nccl.configure(delay=0.0)
    fastdist.recover(timeout=5)
    w = dist.all_reduce(t, async_op=True)
    # The group aborted before recovery: none of the new group's ops is taken for cut short.
    ctx.record("after_recovery", ok=w.wait(), error=not fake_nccl.has_error(w))


def torch_side_abort(ctx) -> None:
    """ProcessGroupNCCL's own watchdog, not fastdist, aborts a communicator (its timeout, 1 s, as a
    user's pg_options may set it, is shorter than the op's 6 s deadline): its error lands on the
    watchdog's copy of the work, and the op the caller waits on reads as completed with no error.
    fastdist must fail it all the same. Then recover() while the old backend's destructor waits
    out the watchdog's 20 s dump sleep, and the rebuilt group keeps the group's timeout (30 s),
    not what was left of recover()'s budget."""
    import fake_nccl

    fake_nccl.register()
    fake_nccl.watchdog_timeout = 1.0
    fastdist.init_process_group(fake_nccl.NAME, store=dist.HashStore(), rank=0, world_size=1, timeout=30)
    fake_nccl.watchdog_timeout = None
    t = torch.ones(1)
    fastdist.all_reduce(t, timeout=5)
    fake_nccl.configure(delay=math.inf, dump_sleep=20.0)
    t0 = time.monotonic()
    try:
        with fastdist.fail_after(6):
            dist.all_reduce(t)  # synchronous: torch waits on fastdist's work
        ctx.record("taken_for_success", elapsed=time.monotonic() - t0)
    except fastdist.FastdistError as e:
        ctx.record("failed", elapsed=time.monotonic() - t0, kind=type(e).__name__, message=str(e))
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    ctx.record("torch_error", error=backend.inner.get_error())
    fake_nccl.configure(delay=0.0, dump_sleep=20.0)
    t0 = time.monotonic()
    fastdist.recover(timeout=5)
    elapsed = time.monotonic() - t0
    t = torch.tensor([3.0])
    fastdist.all_reduce(t, timeout=5)
    ctx.record("recovered", elapsed=elapsed, value=t.item(), timeout=backend.inner.timeout)


def comm_error_between_ops(ctx) -> None:
    """NCCL notices a peer's death between two ops (an asynchronous error on the communicator,
    none of fastdist's ops in flight); ProcessGroupNCCL's watchdog aborts the communicator, and
    the next op throws as it is issued ("NCCL communicator was aborted"): fastdist raises its own
    error for it, and recover() gives a working group."""
    import fake_nccl

    fake_nccl.register()
    fake_nccl.configure(dump_sleep=0.2)
    fastdist.init_process_group(fake_nccl.NAME, store=dist.HashStore(), rank=0, world_size=1, timeout=30)
    t = torch.ones(1)
    fastdist.all_reduce(t, timeout=5)
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    backend.inner.comm_error()
    time.sleep(0.5)  # the watchdog's round (100 ms) and its dump sleep
    try:
        with fastdist.fail_after(5):
            dist.all_reduce(t)
        ctx.record("issued")
    except Exception as e:  # noqa: BLE001 - the test is which kind it is
        ctx.record(
            "failed", kind=type(e).__name__, fastdist=isinstance(e, fastdist.FastdistError), message=str(e)
        )
    ctx.record("torch_error", error=backend.inner.get_error())
    fastdist.recover(timeout=10)
    t = torch.tensor([3.0])
    fastdist.all_reduce(t, timeout=5)
    ctx.record("recovered", value=t.item())


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _net(device: torch.device) -> torch.nn.Module:
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(device)


def _reference(world_size: int, steps: int, device: torch.device) -> list[torch.Tensor]:
    """The undisturbed run, on one process: each step's gradient is the ranks' gradients
    averaged (what DDP's and FSDP2's reductions compute), applied by the same optimizer."""
    model = _net(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        grads = []
        for rank in range(world_size):
            model.zero_grad()
            model(_batch(step, rank).to(device)).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] / world_size for g in grads)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def init_double(ctx) -> torch.device:
    import fake_nccl

    fake_nccl.register()
    fastdist.init_process_group(
        fake_nccl.NAME, store=dist.PrefixStore("pg", ctx.store), rank=ctx.rank, world_size=ctx.world_size
    )
    return torch.device("cpu")


def train_with_a_stall(ctx, kind: str, init=init_double) -> None:
    """2 ranks, DDP or FSDP2, on the CPU double of NCCL (``init``: tests/gpu passes real NCCL on a
    GPU): rank 1 sleeps 4 s before its backward at step 2 inside fail_after(1.5). Rank 0's
    backward waits on the gradients' reduction, which never runs without rank 1: it must raise at
    its deadline (not go on to opt.step() with gradients that were never reduced), both ranks
    recover and redo the step with the same model objects, and the final model equals the
    undisturbed run's."""
    from torch import nn

    device = init(ctx)
    net = _net(device)
    if kind == "ddp":
        model: nn.Module = nn.parallel.DistributedDataParallel(net)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (ctx.world_size,))
        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    steps = 5
    step, slept, applied = 0, False, 0
    while step < steps:
        t0 = time.monotonic()
        try:
            with fastdist.fail_after(1.5 if step else 60.0):
                opt.zero_grad()
                loss = model(_batch(step, ctx.rank).to(device)).pow(2).mean()
                if step == 2 and ctx.rank == 1 and not slept:
                    slept = True
                    time.sleep(4.0)
                loss.backward()
                opt.step()
                applied += 1
            step += 1
        except fastdist.FastdistError as e:
            record_error(ctx, "error", e, t0)
            ctx.record("at_error", step=step, applied=applied)
            same = fastdist.recover(timeout=30) is dist.group.WORLD
            ctx.record("recovered", same_group=same)
    if kind == "ddp":
        final = [p.detach() for p in model.parameters()]
    else:
        final = [p.full_tensor().detach() for p in model.parameters()]
    ref = _reference(ctx.world_size, steps, device)
    diff = max(float((a - b).abs().max()) for a, b in zip(final, ref))
    ctx.record("done", steps=step, applied=applied, diff=diff)


def nccl_double_ddp(ctx) -> None:
    train_with_a_stall(ctx, "ddp")


def nccl_double_fsdp2(ctx) -> None:
    train_with_a_stall(ctx, "fsdp2")


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
