"""Scenarios for watched groups (see mp.py): collectives that torch issues itself (DDP, FSDP2,
DeviceMesh, torch.distributed) are bounded, diagnosed and recovered in place by fastdist."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from datetime import timedelta

import fastdist
import torch
import torch.distributed as dist
from torch import nn

STEP = 2.0  # each training step's fail_after


def _stop_for(seconds: float) -> None:
    """SIGSTOP this process; a detached shell resumes it ``seconds`` later."""
    subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"], start_new_session=True)
    os.kill(os.getpid(), signal.SIGSTOP)


def _train(ctx, model, steps: int, stop_at: int) -> None:
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
                    _stop_for(5.0)
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
    _train(ctx, model, steps=5, stop_at=2)
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
    _train(ctx, model, steps=4, stop_at=2)
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


def reliability_single(ctx) -> None:
    """One rank (a world of 1 on the harness's store): huge timeouts, non-contiguous tensors,
    refused calls that must not skew the op numbers, and the message of a call made after its
    scope's deadline."""
    import math

    from fastdist.groups import pgstate

    fastdist.init_process_group(
        "gloo", store=dist.PrefixStore("pg", ctx.store), rank=0, world_size=1, timeout=60
    )
    st = pgstate.state_of(dist.group.WORLD)
    huge = {}
    for value in (8e9, 1e10, 1e18, 10**30, math.inf):
        t0 = time.monotonic()
        ok = fastdist.barrier(timeout=value)
        t = torch.ones(1)
        fastdist.broadcast(t, src=0, timeout=value)  # per-call options carry the timeout
        huge[str(value)] = ok is True and time.monotonic() - t0 < 5
    fastdist.set_default_timeout(1e18)
    huge["default_1e18"] = fastdist.barrier() is True
    fastdist.set_default_timeout(None)
    ctx.record("huge", ok=huge)
    errors = {}
    wide = torch.ones(4, 4)
    for name, call in (
        ("all_reduce", lambda: fastdist.all_reduce(wide.t()[0], timeout=5)),
        ("all_gather", lambda: fastdist.all_gather([torch.zeros(4)], wide[:, 0], timeout=5)),
        ("broadcast", lambda: fastdist.broadcast(wide[:, 1], src=0, timeout=5)),
        ("all_gather_list", lambda: fastdist.all_gather([wide[:, 0]], torch.zeros(4), timeout=5)),
    ):
        try:
            call()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    ctx.record("contiguous", errors=errors)
    before = st.watched.seq
    refused = []
    for call in (
        lambda: fastdist.all_gather([torch.zeros(1)] * 3, torch.zeros(1), timeout=5),
        lambda: fastdist.all_reduce(torch.ones(1), op="sum", timeout=5),
    ):
        try:
            call()
        except (ValueError, TypeError) as e:
            refused.append(type(e).__name__)
    ctx.record("seq", before=before, after=st.watched.seq, refused=refused)
    with fastdist.fail_after(0.05):
        time.sleep(0.2)
        try:
            fastdist.barrier()
            ctx.record("no_error")
        except fastdist.CollectiveTimeoutError as e:
            ctx.record("expired", message=str(e), timeout=e.timeout)
    fastdist.recover(timeout=10)
    ctx.record("after", ok=fastdist.barrier(timeout=5))


def two_threads_one_group(ctx) -> None:
    """2 ranks: on rank 0, a second thread's blocking call on the group while the first thread's
    is still running is refused, naming both threads; the first call completes correctly."""
    ctx.init()
    fastdist.barrier(timeout=20)
    if ctx.rank == 1:
        time.sleep(1.0)
        t = torch.ones(1)
        fastdist.all_reduce(t, timeout=20)
        return
    result = {}

    def first():
        t = torch.ones(1)
        fastdist.all_reduce(t, timeout=20)
        result["first"] = t.item()

    th = threading.Thread(target=first, name="trainer")
    th.start()
    time.sleep(0.3)
    try:
        fastdist.barrier(timeout=5)
        result["second"] = "no error"
    except RuntimeError as e:
        result["second"] = str(e)
    th.join(20)
    ctx.record("threads", **result)


def every_op_times_out(ctx) -> None:
    """2 ranks; rank 1 stays away. Rank 0 calls every public op, each on a watched subgroup of its
    own (made while both ranks were there), with a short timeout: each raises
    CollectiveTimeoutError naming rank 1, within the timeout plus the report window and slack."""
    ctx.init()
    ops = [
        "all_reduce",
        "reduce",
        "broadcast",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "gather",
        "scatter",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "send",
        "recv",
        "isend",
        "irecv",
        "batch_isend_irecv",
        "all_gather_object",
        "gather_object",
        "broadcast_object_list",
        "scatter_object_list",
    ]
    groups = {name: dist.new_group([0, 1]) for name in ops}
    fastdist.barrier(timeout=20)
    if ctx.rank == 1:
        ctx.wait_release()
        return
    T = 0.3
    big = torch.zeros(16 * 1024 * 1024)  # 64 MB: more than the socket buffers take without a reader
    one = torch.ones(2)

    def calls(name, g):
        two = [torch.zeros(2), torch.zeros(2)]
        return {
            "all_reduce": lambda: fastdist.all_reduce(one, group=g, timeout=T),
            "reduce": lambda: fastdist.reduce(one, dst=1, group=g, timeout=T),
            "broadcast": lambda: fastdist.broadcast(one, src=1, group=g, timeout=T),
            "all_gather": lambda: fastdist.all_gather(two, one, g, timeout=T),
            "all_gather_into_tensor": lambda: fastdist.all_gather_into_tensor(
                torch.zeros(4), one, g, timeout=T
            ),
            "reduce_scatter": lambda: fastdist.reduce_scatter(torch.zeros(2), two, group=g, timeout=T),
            "reduce_scatter_tensor": lambda: fastdist.reduce_scatter_tensor(
                torch.zeros(2), torch.ones(4), group=g, timeout=T
            ),
            "gather": lambda: fastdist.gather(one, two, dst=0, group=g, timeout=T),
            "scatter": lambda: fastdist.scatter(torch.zeros(2), None, src=1, group=g, timeout=T),
            "all_to_all": lambda: fastdist.all_to_all(two, [torch.ones(2), torch.ones(2)], g, timeout=T),
            "all_to_all_single": lambda: fastdist.all_to_all_single(
                torch.zeros(4), torch.ones(4), group=g, timeout=T
            ),
            "barrier": lambda: fastdist.barrier(g, timeout=T),
            "send": lambda: fastdist.send(big, dst=1, group=g, timeout=T),
            "recv": lambda: fastdist.recv(torch.zeros(2), src=1, group=g, timeout=T),
            "isend": lambda: fastdist.isend(big, dst=1, group=g, timeout=T).wait(),
            "irecv": lambda: fastdist.irecv(torch.zeros(2), src=1, group=g, timeout=T).wait(),
            "batch_isend_irecv": lambda: [
                h.wait()
                for h in fastdist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.zeros(2), 1, g)], timeout=T)
            ],
            "all_gather_object": lambda: fastdist.all_gather_object([None, None], {"a": 1}, g, timeout=T),
            "gather_object": lambda: fastdist.gather_object(
                {"a": 1}, [None, None], dst=0, group=g, timeout=T
            ),
            "broadcast_object_list": lambda: fastdist.broadcast_object_list(
                [None], src=1, group=g, timeout=T
            ),
            "scatter_object_list": lambda: fastdist.scatter_object_list(
                [None], None, src=1, group=g, timeout=T
            ),
        }[name]

    out = {}
    for name in ops:
        t0 = time.monotonic()
        try:
            calls(name, groups[name])()
            out[name] = {"kind": "no error"}
        except fastdist.FastdistError as e:
            out[name] = {
                "kind": type(e).__name__,
                "missing": getattr(e, "missing_ranks", None),
                "seconds": time.monotonic() - t0,
                "dead": fastdist.is_dead(groups[name]),
            }
    ctx.record("ops", results=out, timeout=T)


def member_dies_inside_recover(ctx) -> None:
    """3 ranks: rank 2 hangs past a timeout, then joins recover() and is SIGKILLed right after the
    agreement, while the group is rebuilt. Ranks 0 and 1 get RecoveryError within recover's
    timeout plus a second; their next recover(allow_shrink=True) leaves rank 2 out and works."""
    from fastdist.recovery import recover as recovery

    ctx.init()
    fastdist.barrier(timeout=20)
    if ctx.rank == 2:
        time.sleep(1.5)
        original = recovery._rebuild_in_place

        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        recovery._rebuild_in_place = die
        fastdist.recover(timeout=10)
        return
    try:
        fastdist.barrier(timeout=0.5)
    except fastdist.CollectiveTimeoutError as e:
        ctx.record("timeout", missing=e.missing_ranks)
    t0 = time.monotonic()
    try:
        fastdist.recover(timeout=4)
        ctx.record("no_error")
    except fastdist.RecoveryError as e:
        ctx.record("recovery_error", seconds=time.monotonic() - t0, message=str(e))
    new = fastdist.recover(timeout=5, allow_shrink=True)
    t = torch.ones(1)
    fastdist.all_reduce(t, group=new, timeout=10)
    ctx.record("recovered", world_size=dist.get_world_size(), value=t.item())


def store_host_dies(ctx) -> None:
    """3 ranks on tcp://, the store hosted by rank 0; rank 0 is SIGKILLed while the others are in
    an all_reduce. Ranks 1 and 2 get a typed error saying the store (at HOST:PORT, in rank 0) is
    gone; recover() raises RecoveryError saying so at once."""
    port = int(os.environ["FASTDIST_RDZV_PORT"])  # a free port the test picked: rank 0 hosts the store
    fastdist.init_process_group(
        "gloo", f"tcp://127.0.0.1:{port}", rank=ctx.rank, world_size=ctx.world_size, timeout=30
    )
    t = torch.ones(8 * 1024 * 1024)
    fastdist.all_reduce(torch.ones(1), timeout=20)
    if ctx.rank == 0:
        time.sleep(0.3)  # the others are inside their all_reduce by now
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        fastdist.all_reduce(t, timeout=2)
        ctx.record("no_error")
    except fastdist.FastdistError as e:
        ctx.record("error", kind=type(e).__name__, message=str(e))
    t0 = time.monotonic()
    try:
        fastdist.recover(timeout=5)
        ctx.record("recovered")
    except fastdist.RecoveryError as e:
        ctx.record("recovery_error", seconds=time.monotonic() - t0, message=str(e))


def unwaited_handler_raises(ctx) -> None:
    """2 ranks, rank 1 away: an async op nobody waits on times out; the timeout handler, run on
    fastdist's thread, raises; the exception reaches sys.unraisablehook (it has nowhere else to
    go), and the handle still holds the timeout."""
    import sys

    ctx.init()
    fastdist.barrier(timeout=20)
    if ctx.rank == 1:
        ctx.wait_release()
        return
    seen = []
    sys.unraisablehook = lambda args: seen.append(repr(args.exc_value))

    def handler(err):
        raise ValueError(f"handler saw {type(err).__name__}")

    fastdist.set_timeout_handler(handler)
    h = fastdist.all_reduce(torch.ones(1), async_op=True, timeout=0.3)
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.05)
    ctx.record("unraisable", seen=seen, completed=h.is_completed(), error=type(h.exception()).__name__)


def fork_child_exits(ctx) -> None:
    """2 ranks: after using the group, rank 0 forks; the child exits normally (atexit hooks,
    finalization, destructors) and must do so promptly, with code 0."""
    ctx.init()
    fastdist.all_reduce(torch.ones(1), timeout=20)
    if ctx.rank == 0:
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            raise SystemExit(0)
        _, status = os.waitpid(pid, 0)
        ctx.record("child", seconds=time.monotonic() - t0, status=status)
    fastdist.barrier(timeout=20)


def load_batch(ctx, key: str) -> int:
    """Rank 2's stand-in for a data loader that never returns: a Python loop, in no collective,
    until the test lets it go (the report must name this function and its line)."""
    n = 0
    while not ctx.store.check([key]):
        n += sum(range(2000))
    return n


def where_stuck(ctx) -> None:
    """3 ranks. A: rank 2 loops in load_batch; rank 0's barrier(timeout=1) times out while rank 1
    waits in an all_reduce with a 60 s deadline: rank 1 must raise at once with rank 0, and rank
    0's error must say where ranks 1 and 2 are. B: rank 2 is stopped (SIGSTOP) for 4 s: the
    report says it did not answer. Everyone recovers after each."""
    ctx.init()
    fastdist.barrier(timeout=30)
    if ctx.rank == 2:
        load_batch(ctx, "go_a")
    else:
        t0 = time.monotonic()
        try:
            if ctx.rank == 0:
                fastdist.barrier(timeout=1)
            else:
                fastdist.all_reduce(torch.ones(1), timeout=60)
            ctx.record("a_no_error")
        except fastdist.FastdistError as e:
            ctx.record(
                "a",
                type=type(e).__name__,
                message=str(e),
                elapsed=time.monotonic() - t0,
                stacks={str(k): v for k, v in (getattr(e, "stacks", None) or {}).items()},
                missing=getattr(e, "missing_ranks", None),
            )
        ctx.record(
            "history_a", ops=[(o["seq"], o["op"], o["outcome"], o["shape"]) for o in fastdist.history()]
        )
        if ctx.rank == 0:
            ctx.store.set("go_a", "1")
    fastdist.recover(timeout=30)
    fastdist.barrier(timeout=30)
    ctx.record("recovered_a")
    if ctx.rank == 2:
        _stop_for(4.0)
    else:
        try:
            fastdist.barrier(timeout=1)
            ctx.record("b_no_error")
        except fastdist.CollectiveTimeoutError as e:
            ctx.record("b", message=str(e), missing=e.missing_ranks)
    fastdist.recover(timeout=30)
    fastdist.barrier(timeout=30)
    ctx.record("recovered_b")
    # C: rank 2 comes 50 ms late to each of 6 all_reduces, then stays away: the timed-out ranks'
    # error names it as the straggler, from the waits each rank posted (the fresh group of
    # generation 2 has these 6 ops and the barrier after recover() in its history).
    for _ in range(6):
        if ctx.rank == 2:
            time.sleep(0.05)
        fastdist.all_reduce(torch.ones(1), timeout=30)
    if ctx.rank == 2:
        load_batch(ctx, "go_c")
    else:
        try:
            fastdist.barrier(timeout=1)
            ctx.record("c_no_error")
        except fastdist.CollectiveTimeoutError as e:
            ctx.record("c", message=str(e), straggler=e.straggler)
        if ctx.rank == 0:
            ctx.store.set("go_c", "1")
    fastdist.recover(timeout=30)
    fastdist.barrier(timeout=30)
    ctx.record("recovered_c")


def bench_propagation(ctx) -> None:
    """For bench/test_propagation.py: cycles in which rank 0's barrier times out at 0.5 s while the
    middle ranks wait in the same barrier with a 60 s deadline and the last rank computes
    elsewhere; records when rank 0's deadline passed and when each middle rank raised."""
    import os

    ctx.init()
    fastdist.barrier(timeout=30)
    for i in range(int(os.environ.get("FASTDIST_BENCH_CYCLES", "5"))):
        if ctx.rank == ctx.world_size - 1:
            load_batch(ctx, f"go_{i}")
        else:
            timeout = 0.5 if ctx.rank == 0 else 60.0
            start = time.time()
            try:
                fastdist.barrier(timeout=timeout)
            except fastdist.FastdistError:
                ctx.record("raised", cycle=i, deadline=start + timeout, at=time.time())
            if ctx.rank == 0:
                ctx.store.set(f"go_{i}", "1")
        fastdist.recover(timeout=30)
        fastdist.barrier(timeout=30)


def recover_from_two_threads(ctx) -> None:
    """2 ranks, 20 rounds: on every rank two threads call fastdist.recover() at once on the
    healthy default group; both return the group (one recovered it, the other shared its
    outcome), and a barrier and an all_reduce on it then work."""
    ctx.init()
    outcomes = []
    for _ in range(20):
        fastdist.barrier(timeout=20)
        got: dict[str, str] = {}

        def call(name: str, got: dict[str, str] = got) -> None:
            try:
                pg = fastdist.recover(timeout=20)
                got[name] = "ok" if pg is dist.distributed_c10d._get_default_group() else "other group"
            except (RuntimeError, ValueError) as e:  # recorded, so the test shows what it was
                got[name] = f"{type(e).__name__}: {e}"

        threads = [threading.Thread(target=call, args=(n,)) for n in ("a", "b")]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        t = torch.ones(1)
        fastdist.all_reduce(t, timeout=20)
        outcomes.append({**got, "sum": t.item()})
    ctx.record("two_threads_recover", outcomes=outcomes)


def side_thread_waits_here(ctx, sub, release: threading.Event) -> None:
    """A side thread that issues the subgroup's ops, then waits (for the test: where it is)."""
    t = torch.ones(1)
    fastdist.all_reduce(t, group=sub, timeout=20)
    release.wait(30)


def subgroup_report_names_issuer(ctx) -> None:
    """2 ranks and a subgroup of both, whose ops come from a side thread. Rank 0 issues a subgroup
    op that rank 1 never joins (rank 1's side thread waits elsewhere, its main thread sleeps in a
    barrier-free loop): rank 0's error shows rank 1's side thread, not its main thread."""
    ctx.init()
    sub = dist.new_group([0, 1])
    release = threading.Event()
    side = threading.Thread(target=side_thread_waits_here, args=(ctx, sub, release), name="side")
    side.start()
    if ctx.rank == 0:
        time.sleep(1.0)
        try:
            fastdist.barrier(group=sub, timeout=2)
        except fastdist.CollectiveTimeoutError as e:
            ctx.record("sub", message=str(e), stacks={str(k): v for k, v in (e.stacks or {}).items()})
        release.set()
    else:
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:  # the main thread, busy elsewhere
            time.sleep(0.01)
        release.set()
    side.join(30)


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
