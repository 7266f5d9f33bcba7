"""The ranks of tests/gpu/test_nccl_gpu.py: NCCL on a GPU."""

from __future__ import annotations

import os
import time

import fastdist
import torch
import torch.distributed as dist
from fastdist import CollectiveTimeoutError, FastdistError
from fastdist.groups import abort

# Two ranks on ONE GPU (../shared/notes/gpu.md): NCCL refuses two ranks of a communicator on one
# device unless each looks like a host of its own (NCCL_HOSTID, set per rank below); they then
# talk over sockets on loopback. Passed to every rank (tests/gpu/test_nccl_gpu.py).
SHARED_GPU_ENV = {
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_IB_DISABLE": "1",
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
}


def init_shared_gpu(ctx) -> torch.device:
    """NCCL with the ranks spread over the GPUs there are (both on GPU 0 when there is one)."""
    os.environ["NCCL_HOSTID"] = f"fastdist-test-host{ctx.rank}"
    device = torch.device("cuda", ctx.rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    fastdist.init_process_group(
        "nccl", store=dist.PrefixStore("pg", ctx.store), rank=ctx.rank, world_size=ctx.world_size
    )
    return device


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


def gpu_missing_rank(ctx) -> None:
    """The last rank skips an all_reduce; the others report it missing at the deadline."""
    init_shared_gpu(ctx)
    t = torch.ones(1024, device="cuda")
    fastdist.all_reduce(t, timeout=60)
    torch.cuda.synchronize()
    ctx.record("healthy", value=t[0].item())
    if ctx.rank == ctx.world_size - 1:
        ctx.wait_release()
        return
    t0 = time.monotonic()
    try:
        fastdist.all_reduce(t, timeout=2.0)
        ctx.record("no_timeout")
    except CollectiveTimeoutError as e:
        ctx.record("timeout", elapsed=time.monotonic() - t0, missing=e.missing_ranks, message=str(e))
    t0 = time.monotonic()
    abort.wait_aborts()  # torch's abort of the communicators, started at the deadline
    ctx.record("aborted", seconds=time.monotonic() - t0)


def gpu_killed_rank(ctx) -> None:
    """Rank 1 is SIGKILLed while rank 0's NCCL kernel waits for it in an all_reduce: rank 0 raises
    (by its deadline at the latest), stays alive, and trains on alone after recover(allow_shrink)."""
    import signal

    init_shared_gpu(ctx)
    t = torch.ones(1024, device="cuda")
    fastdist.all_reduce(t, timeout=60)
    torch.cuda.synchronize()
    ctx.record("healthy")
    if ctx.rank == 1:
        time.sleep(1.0)  # rank 0's kernel is in flight by now
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        fastdist.all_reduce(t, timeout=5.0)
        ctx.record("no_error")
    except FastdistError as e:
        ctx.record("error", kind=type(e).__name__, elapsed=time.monotonic() - t0, message=str(e))
    new = fastdist.recover(timeout=30, allow_shrink=True)
    t = torch.full((4,), 3.0, device="cuda")
    fastdist.all_reduce(t, group=new, timeout=30)
    torch.cuda.synchronize()
    ctx.record("alone", world=dist.get_world_size(), value=t[0].item())


def gpu_train_ddp(ctx) -> None:
    import nccl_path_ranks

    nccl_path_ranks.train_with_a_stall(ctx, "ddp", init=init_shared_gpu)


def gpu_train_fsdp2(ctx) -> None:
    import nccl_path_ranks

    nccl_path_ranks.train_with_a_stall(ctx, "fsdp2", init=init_shared_gpu)


def gpu_graph_capture(ctx) -> None:
    """A collective captured in a CUDA graph on a watched group: works as on plain NCCL (it is
    issued unwatched), or is refused with an error that says why."""
    init_shared_gpu(ctx)
    t = torch.ones(16, device="cuda")
    fastdist.all_reduce(t, timeout=60)  # communicators made before the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            dist.all_reduce(t)
        for _ in range(3):
            t.fill_(1.0)
            graph.replay()
        torch.cuda.synchronize()
        ctx.record("captured", value=t[0].item())
    except Exception as e:  # noqa: BLE001 - what the test asserts on
        ctx.record("refused", kind=type(e).__name__, message=str(e))
    t = torch.ones(16, device="cuda")
    fastdist.all_reduce(t, timeout=30)  # the group works after either
    torch.cuda.synchronize()
    ctx.record("after", value=t[0].item())


def gpu_device_id_subgroups(ctx) -> None:
    """``device_id`` (torch's eager init) with new_group and a 2-D DeviceMesh: torch would split
    them from the default group's backend, which on a watched group is fastdist's wrapper."""
    from torch.distributed.device_mesh import init_device_mesh

    os.environ["NCCL_HOSTID"] = f"fastdist-test-host{ctx.rank}"
    device = torch.device("cuda", ctx.rank % torch.cuda.device_count())
    fastdist.init_process_group(
        "nccl",
        store=dist.PrefixStore("pg", ctx.store),
        rank=ctx.rank,
        world_size=ctx.world_size,
        device_id=device,
    )
    g = dist.new_group([0, 1])
    t = torch.ones(1, device=device)
    dist.all_reduce(t, group=g)
    mesh = init_device_mesh("cuda", (1, 2))
    u = torch.ones(1, device=device)
    dist.all_reduce(u, group=mesh.get_group(1))
    torch.cuda.synchronize()
    ctx.record("subgroups", new_group=t.item(), mesh=u.item(), current=torch.cuda.current_device())


def gpu_torch_watchdog_abort(ctx) -> None:
    """ProcessGroupNCCL's own watchdog (the group's timeout, 2 s, through pg_options) fires before
    fastdist's 8 s deadline on a collective rank 1 never joins: the op must fail, not read as
    completed (its watchdog sets its error on its copy of the work and aborts the communicator)."""
    os.environ["NCCL_HOSTID"] = f"fastdist-test-host{ctx.rank}"
    device = torch.device("cuda", ctx.rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = __import__("datetime").timedelta(seconds=2)
    fastdist.init_process_group(
        "nccl",
        store=dist.PrefixStore("pg", ctx.store),
        rank=ctx.rank,
        world_size=ctx.world_size,
        timeout=30,
        pg_options=opts,
    )
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    if ctx.rank == 1:
        ctx.wait_release()
        return
    t0 = time.monotonic()
    try:
        with fastdist.fail_after(8):
            dist.all_reduce(t)
            torch.cuda.synchronize()
        ctx.record("taken_for_success", elapsed=time.monotonic() - t0)
    except FastdistError as e:
        ctx.record("failed", elapsed=time.monotonic() - t0, message=str(e))
