"""The ranks of the benchmarks that run scenarios (run by tests/support/mp.run_ranks)."""

from __future__ import annotations

import os
import time

import fastdist
import torch
import torch.distributed as dist
from fastdist import CollectiveTimeoutError
from ranks_common import load_batch


def bench_recovery(ctx) -> None:
    """For bench/test_recovery_time.py: cycles of (the last rank skips a barrier, the others time
    out, everyone recovers); records each rank's time from timeout to a good barrier. Also
    records how long this process took from spawn to its first barrier (the restart cost)."""

    spawned = float(os.environ.get("FASTDIST_SPAWNED_AT", "0"))
    if os.environ.get("FASTDIST_TEST_ETCD_URL"):  # bench/test_etcd_store.py: the store in etcd
        url = os.environ["FASTDIST_TEST_ETCD_URL"]
        fastdist.init_process_group("gloo", url, rank=ctx.rank, world_size=ctx.world_size, timeout=60)
    else:
        ctx.init()
    fastdist.barrier(timeout=30)
    ctx.record("started", seconds_since_spawn=time.time() - spawned if spawned else -1)
    for _ in range(int(os.environ.get("FASTDIST_BENCH_CYCLES", "3"))):
        timed_out_at = None
        if ctx.rank != ctx.world_size - 1:
            try:
                fastdist.barrier(timeout=0.5)
            except CollectiveTimeoutError:
                timed_out_at = time.time()
        fastdist.recover(timeout=30)
        fastdist.barrier(timeout=30)
        ctx.record("cycle", timed_out_at=timed_out_at, recovered_at=time.time())


def gpu_bench(ctx) -> None:
    """For bench/: NCCL on one GPU. fastdist.all_reduce (returns once the GPU finished) against
    dist.all_reduce + torch.cuda.synchronize(), interleaved, at 1 element and 1 MB."""
    import statistics

    torch.cuda.set_device(0)
    fastdist.init_process_group("nccl", store=dist.PrefixStore("pg", ctx.store), rank=0, world_size=1)
    out = {}
    for label, numel in (("1", 1), ("1mb", 256 * 1024)):
        t = torch.ones(numel, device="cuda")
        raw, fd = [], []
        for i in range(600):
            for which in (0, 1) if i % 2 == 0 else (1, 0):
                t0 = time.perf_counter()
                if which == 0:
                    dist.all_reduce(t)
                    torch.cuda.synchronize()
                    raw.append(time.perf_counter() - t0)
                else:
                    fastdist.all_reduce(t, timeout=30)
                    fd.append(time.perf_counter() - t0)
        r, f = statistics.median(raw[50:]), statistics.median(fd[50:])
        out[label] = {"raw_sync_us": r * 1e6, "fastdist_us": f * 1e6, "ratio": f / r}
    # Issuing async all_reduces (500 in a row, then all waited), alternating raw and fastdist.
    t = torch.ones(1, device="cuda")
    issue: dict[str, list[float]] = {"raw": [], "fastdist": []}
    for _ in range(7):
        for which in ("raw", "fastdist"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if which == "raw":
                handles = [dist.all_reduce(t, async_op=True) for _ in range(500)]
            else:
                handles = [fastdist.all_reduce(t, async_op=True, timeout=60) for _ in range(500)]
            issue[which].append((time.perf_counter() - t0) / 500)
            for h in handles:
                h.wait()
    r, f = statistics.median(issue["raw"][1:]), statistics.median(issue["fastdist"][1:])
    out["async_issue"] = {"raw_us": r * 1e6, "fastdist_us": f * 1e6, "ratio": f / r}
    ctx.record("gpu_bench", **out)


def gpu_torch_ops_bench(ctx) -> None:
    """For bench/: torch.distributed's own calls on NCCL, one GPU, a watched group against a plain
    one in the same process (alternating): a synchronous all_reduce of 1 element and of 1 MB (the
    plain one followed by torch.cuda.synchronize(): a watched synchronous op returns once the GPU
    ran it), the issue cost of async ones, and a DDP step of a real model."""
    import statistics

    from fastdist.ops import watching

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.PrefixStore("pg", ctx.store), rank=0, world_size=1)
    plain = dist.group.WORLD
    watching.activate(None)  # groups made from now on are watched, as after fastdist.init_process_group
    watched = dist.new_group([0], backend="nccl")
    out: dict[str, dict[str, float]] = {}
    for label, numel in (("sync_1", 1), ("sync_1mb", 256 * 1024)):
        t = torch.ones(numel, device="cuda")
        times: dict[str, list[float]] = {"plain": [], "watched": []}
        for i in range(600):
            for which in ("plain", "watched") if i % 2 == 0 else ("watched", "plain"):
                t0 = time.perf_counter()
                dist.all_reduce(t, group=plain if which == "plain" else watched)
                torch.cuda.synchronize()
                times[which].append(time.perf_counter() - t0)
        p, w = statistics.median(times["plain"][50:]), statistics.median(times["watched"][50:])
        out[label] = {"plain_us": p * 1e6, "watched_us": w * 1e6, "ratio": w / p}
    t = torch.ones(1, device="cuda")
    issue: dict[str, list[float]] = {"plain": [], "watched": []}
    for _ in range(7):
        for which in ("plain", "watched"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            group = plain if which == "plain" else watched
            handles = [dist.all_reduce(t, group=group, async_op=True) for _ in range(500)]
            issue[which].append((time.perf_counter() - t0) / 500)
            for h in handles:
                h.wait()
    p, w = statistics.median(issue["plain"][1:]), statistics.median(issue["watched"][1:])
    out["async_issue"] = {"plain_us": p * 1e6, "watched_us": w * 1e6, "ratio": w / p}
    # A DDP step (forward, backward with its bucketed all_reduces, optimizer step) of an 8-layer
    # 4096-wide MLP (134M parameters), on the plain group and on the watched one, alternating.
    models = {}
    for which, group in (("plain", plain), ("watched", watched)):
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()
        ddp = torch.nn.parallel.DistributedDataParallel(net, process_group=group)
        models[which] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3))
    x = torch.randn(64, 4096, device="cuda")
    steps: dict[str, list[float]] = {"plain": [], "watched": []}
    for i in range(60):
        for which in ("plain", "watched") if i % 2 == 0 else ("watched", "plain"):
            ddp, opt = models[which]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad()
            ddp(x).pow(2).mean().backward()
            opt.step()
            torch.cuda.synchronize()
            steps[which].append(time.perf_counter() - t0)
    p, w = statistics.median(steps["plain"][10:]), statistics.median(steps["watched"][10:])
    out["ddp_step"] = {"plain_ms": p * 1e3, "watched_ms": w * 1e3, "ratio": w / p}
    ctx.record("gpu_torch_ops", **out)


def gpu_abort_bench(ctx) -> None:
    """For bench/: two ranks on one GPU (each a host of its own to NCCL), rank 1 never joins an
    all_reduce: how late rank 0's error comes after its 1 s deadline, and how long torch's abort of
    the communicators takes with that kernel in flight."""
    os.environ["NCCL_HOSTID"] = f"fastdist-bench-host{ctx.rank}"
    torch.cuda.set_device(0)
    fastdist.init_process_group("nccl", store=dist.PrefixStore("pg", ctx.store), rank=ctx.rank, world_size=2)
    t = torch.ones(1024, device="cuda")
    fastdist.all_reduce(t, timeout=60)
    torch.cuda.synchronize()
    if ctx.rank == 1:
        ctx.wait_release()
        return
    from fastdist.groups import abort

    t0 = time.monotonic()
    try:
        fastdist.all_reduce(t, timeout=1.0)
    except CollectiveTimeoutError:
        raised = time.monotonic() - t0
    t1 = time.monotonic()
    abort.wait_aborts()
    waited = time.monotonic() - t1
    ctx.record("abort", error_after_deadline_ms=(raised - 1.0) * 1e3, abort_wait_ms=waited * 1e3)


def bench_detection(ctx) -> None:
    """For bench/: time from the deadline to the error in the caller over N hangs on a 2-rank
    subgroup, with the missing-rank report (the default) and without it."""
    import statistics

    from fastdist.store import board

    ctx.init()
    n = int(os.environ.get("FASTDIST_BENCH_HANGS", "50"))
    timeout = 0.2
    sub = dist.new_group([0, 1])
    out = {}
    for mode in ("with_report", "without_report"):
        if mode == "without_report":
            board.report = lambda *a, **k: None  # what a timeout costs before any store traffic
        late = []
        for _ in range(n):
            if ctx.rank == 0:
                start = fastdist.current_time()
                try:
                    fastdist.barrier(sub, timeout=timeout)
                except CollectiveTimeoutError:
                    late.append(fastdist.current_time() - (start + timeout))
            sub = fastdist.recover(sub, timeout=30)
        if late:
            late.sort()
            out[mode] = {
                "median_ms": statistics.median(late) * 1e3,
                "p99_ms": late[min(len(late) - 1, int(0.99 * len(late)))] * 1e3,
                "n": len(late),
            }
    ctx.record("detection", **out)


def bench_propagation(ctx) -> None:
    """For bench/test_propagation.py: cycles in which rank 0's barrier times out at 0.5 s while the
    middle ranks wait in the same barrier with a 60 s deadline and the last rank computes
    elsewhere; records when rank 0's deadline passed, when each middle rank raised, and the CPU
    time each spent in the call (``cpu``), and in a barrier that the last rank joins 0.5 s late
    (``idle_cpu``: what waiting costs without a fault)."""

    ctx.init()
    fastdist.barrier(timeout=30)
    for i in range(int(os.environ.get("FASTDIST_BENCH_CYCLES", "5"))):
        cpu = time.process_time()
        if ctx.rank == ctx.world_size - 1:
            time.sleep(0.5)
        fastdist.barrier(timeout=30)
        idle_cpu = time.process_time() - cpu
        if ctx.rank == ctx.world_size - 1:
            load_batch(ctx, f"go_{i}")
        else:
            timeout = 0.5 if ctx.rank == 0 else 60.0
            start, cpu = time.time(), time.process_time()
            try:
                fastdist.barrier(timeout=timeout)
            except fastdist.FastdistError:
                # CPU time: this process's (every thread's) over the whole call
                spent = time.process_time() - cpu
                ctx.record(
                    "raised", cycle=i, deadline=start + timeout, at=time.time(), cpu=spent, idle_cpu=idle_cpu
                )
            if ctx.rank == 0:
                ctx.store.set(f"go_{i}", "1")
        fastdist.recover(timeout=30)
        fastdist.barrier(timeout=30)
