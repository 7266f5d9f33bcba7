"""What each rank does in the multi-process tests (see mp.py). Ranks report through ctx.record;
the test in the parent process asserts. Every rank synchronises through collectives or the
store, never through sleeps, except where a sleep is the behaviour under test (a late rank)."""

from __future__ import annotations

import math
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


def _poll_until(done, seconds: float) -> bool:
    """Polls ``done()`` every 5 ms until it is true (True) or ``seconds`` passed (False): the
    scenario records what it saw either way, and the test asserts on that."""
    end = time.monotonic() + seconds
    while not done():
        if time.monotonic() >= end:
            return False
        time.sleep(0.005)
    return True


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


# ---------------------------------------------------------------------------------------------
# Issue 3: every op, faults, recovery


def every_op(ctx) -> None:
    """Every wrapper once on 3 ranks (and a subgroup), with the results torch would give."""
    ctx.init()
    rank, ws = ctx.rank, ctx.world_size
    T = 20
    t = torch.tensor([float(rank + 1)])
    fastdist.all_reduce(t, timeout=T)
    assert t.item() == sum(range(1, ws + 1)), t
    t = torch.tensor([float(rank + 1)])
    fastdist.all_reduce(t, dist.ReduceOp.MAX, timeout=T)
    assert t.item() == ws
    t = torch.tensor([float(rank + 1)])
    fastdist.reduce(t, dst=1, timeout=T)
    if rank == 1:
        assert t.item() == sum(range(1, ws + 1))
    t = torch.tensor([float(rank * 7)])
    fastdist.broadcast(t, src=2, timeout=T)
    assert t.item() == 14.0
    out = torch.zeros(ws * 2)
    fastdist.all_gather_into_tensor(out, torch.tensor([float(rank), float(rank)]), timeout=T)
    assert out.tolist() == [float(r) for r in range(ws) for _ in range(2)]
    out = torch.zeros(1)
    fastdist.reduce_scatter_tensor(out, torch.arange(ws, dtype=torch.float32), timeout=T)
    assert out.item() == float(rank * ws)
    gl = [torch.zeros(1) for _ in range(ws)] if rank == 0 else None
    fastdist.gather(torch.tensor([float(rank)]), gl, dst=0, timeout=T)
    if rank == 0:
        assert [g.item() for g in gl] == [0.0, 1.0, 2.0]
    mine = torch.zeros(1)
    fastdist.scatter(
        mine, [torch.tensor([float(r * 3)]) for r in range(ws)] if rank == 1 else None, src=1, timeout=T
    )
    assert mine.item() == rank * 3
    o = torch.zeros(ws)
    fastdist.all_to_all_single(o, torch.tensor([float(rank * 10 + r) for r in range(ws)]), timeout=T)
    assert o.tolist() == [float(r * 10 + rank) for r in range(ws)], o
    # point to point: a ring
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    got = torch.zeros(1)
    if rank % 2 == 0:
        fastdist.send(torch.tensor([float(rank)]), nxt, timeout=T)
        src = fastdist.recv(got, prv, timeout=T)
    else:
        src = fastdist.recv(got, prv, timeout=T)
        fastdist.send(torch.tensor([float(rank)]), nxt, timeout=T)
    assert got.item() == prv and src == prv
    got2 = torch.zeros(1)
    hs = fastdist.batch_isend_irecv(
        [dist.P2POp(dist.isend, torch.tensor([float(rank)]), nxt), dist.P2POp(dist.irecv, got2, prv)],
        timeout=T,
    )
    assert all(h.wait() for h in hs) and got2.item() == prv
    h1 = fastdist.isend(torch.tensor([5.0 + rank]), nxt, timeout=T)
    got3 = torch.zeros(1)
    h2 = fastdist.irecv(got3, prv, timeout=T)
    assert h2.wait() and h1.wait() and got3.item() == 5.0 + prv
    # async collectives and fastdist.wait on torch's own work
    t = torch.tensor([1.0])
    h = fastdist.all_reduce(t, async_op=True, timeout=T)
    assert h.wait(5) is True and t.item() == ws and h.is_completed() and h.exception() is None
    raw = dist.all_reduce(torch.ones(1), async_op=True)
    assert fastdist.wait(raw, timeout=T) is True
    # objects
    objs = [None] * ws
    fastdist.all_gather_object(objs, {"rank": rank, "data": "x" * rank}, timeout=T)
    assert objs == [{"rank": r, "data": "x" * r} for r in range(ws)]
    gathered = [None] * ws if rank == 2 else None
    fastdist.gather_object(("r", rank), gathered, dst=2, timeout=T)
    if rank == 2:
        assert gathered == [("r", r) for r in range(ws)]
    lst = [{"a": 1}, [1, 2, 3], "hello"] if rank == 0 else [None, None, None]
    fastdist.broadcast_object_list(lst, src=0, timeout=T)
    assert lst == [{"a": 1}, [1, 2, 3], "hello"]
    outo = [None]
    fastdist.scatter_object_list(
        outo, [f"for {r}" * (r + 1) for r in range(ws)] if rank == 0 else None, src=0, timeout=T
    )
    assert outo == [f"for {rank}" * (rank + 1)]
    # a subgroup of ranks 1 and 2 (every rank calls new_group)
    sub = dist.new_group([1, 2])
    if rank in (1, 2):
        t = torch.tensor([float(rank)])
        fastdist.all_reduce(t, group=sub, timeout=T)
        assert t.item() == 3.0
        t = torch.tensor([float(rank)])
        fastdist.broadcast(t, src=2, group=sub, timeout=T)
        assert t.item() == 2.0
    assert fastdist.barrier(timeout=T)
    ctx.record("ok")


from fastdist.faults import Fault, inject

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


def _record_error(ctx, event: str, err, start: float) -> None:
    ctx.record(
        event,
        kind=type(err).__name__,
        elapsed=time.monotonic() - start,
        message=str(err),
        missing=getattr(err, "missing_ranks", None),
        desynced={str(k): v for k, v in (getattr(err, "desynced", None) or {}).items()},
    )


def _after_recovery(ctx, new_group, event: str = "recovered") -> None:
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


def _fault_run(ctx, faults, steps: int = 4, shrink: bool = True) -> None:
    ctx.init()
    start = time.monotonic()
    step, err = _train(ctx, faults, steps)
    if err is None:
        ctx.record("no_error")
        return
    _record_error(ctx, "error", err, start + 0)  # elapsed is measured from the loop's start
    ctx.record("failed_at", step=step)
    t0 = time.monotonic()
    new = fastdist.recover(timeout=3.0 if shrink else 20.0, allow_shrink=shrink)
    ctx.record("recover_time", seconds=time.monotonic() - t0)
    _after_recovery(ctx, new)


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
        _record_error(ctx, "error", e, start)
    new = fastdist.recover(timeout=3.0, allow_shrink=True)
    _after_recovery(ctx, new)


def fault_wrong_collective(ctx) -> None:
    """Rank 2 calls barrier where the others call all_reduce: everyone times out with the same
    desync report; recovery keeps all three; then, with checks on, a size mismatch is caught."""
    ctx.init()
    start = time.monotonic()
    _step, err = _train(ctx, [Fault("wrong_collective", rank=2, step=1)], 3)
    _record_error(ctx, "error", err, start)
    new = fastdist.recover(timeout=20)
    _after_recovery(ctx, new)
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
    _record_error(ctx, "error", err, start)
    new = fastdist.recover(timeout=20)
    _after_recovery(ctx, new)


def fault_straggler_left_out(ctx) -> None:
    """Rank 2 stalls until the others have rebuilt the group without it: it is refused at once by
    the dead group, and its recover() says it was left out."""
    ctx.init()
    start = time.monotonic()
    faults = [Fault("hang", rank=2, step=1, seconds=STEP_TIMEOUT + 3.0)]
    _step, err = _train(ctx, faults, 3)
    _record_error(ctx, "error", err, start)
    if ctx.rank == 2:
        try:
            fastdist.recover(timeout=5, allow_shrink=True)
            ctx.record("recovered_unexpectedly")
        except fastdist.RecoveryError as e:
            ctx.record("left_out", message=str(e))
        return
    new = fastdist.recover(timeout=1.0, allow_shrink=True)
    _after_recovery(ctx, new)


class CountingStore(dist.Store):
    """Wraps a store and counts every operation made through it."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner
        self.ops = 0

    def _count(self, name, *args):
        self.ops += 1
        return getattr(self.inner, name)(*args)

    def set(self, key, value):
        return self._count("set", key, value)

    def get(self, key):
        return self._count("get", key)

    def add(self, key, value):
        return self._count("add", key, value)

    def check(self, keys):
        return self._count("check", keys)

    def wait(self, keys, timeout=None):
        return self._count("wait", keys) if timeout is None else self._count("wait", keys, timeout)

    def compare_set(self, key, expected, desired):
        return self._count("compare_set", key, expected, desired)

    def delete_key(self, key):
        return self._count("delete_key", key)

    def num_keys(self):
        return self._count("num_keys")

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)


def store_quiet_and_async_handler_exit(ctx) -> None:
    """2 ranks. 100 healthy collectives make no store operation; then an async all_reduce that
    nobody waits on times out, its handler runs on fastdist's thread and its sys.exit(7) ends the
    process with code 7."""
    import threading

    counting = CountingStore(dist.PrefixStore("pg", ctx.store))
    dist.init_process_group("gloo", store=counting, rank=ctx.rank, world_size=ctx.world_size)
    fastdist.barrier(timeout=20)
    before = counting.ops
    t = torch.ones(4)
    for _ in range(25):
        fastdist.all_reduce(t, timeout=20)
        fastdist.barrier(timeout=20)
        fastdist.broadcast(t, src=0, timeout=20)
        fastdist.all_gather([torch.zeros(4) for _ in range(2)], t, timeout=20)
    ctx.record("store_ops", during=counting.ops - before, at_init=before)
    if ctx.rank == 1:
        ctx.wait_release()
        return

    def handler(err):
        ctx.record(
            "handler",
            thread=threading.current_thread().name,
            main=threading.current_thread() is threading.main_thread(),
            message=str(err),
        )
        sys.exit(7)

    fastdist.set_timeout_handler(handler)
    h = fastdist.all_reduce(torch.ones(1), async_op=True, timeout=0.5)
    ctx.record("issued", repr=repr(h))
    time.sleep(30)  # nobody waits on h; the process must end from the handler
    ctx.record("still_alive")


def subgroup_dies_alone(ctx) -> None:
    """3 ranks; subgroup {0, 1}. Rank 1 skips a subgroup barrier: rank 0 times out on the
    subgroup alone; the default group keeps working; ranks 0 and 1 rebuild the subgroup."""
    ctx.init()
    sub = dist.new_group([0, 1])
    fastdist.barrier(timeout=20)
    if ctx.rank == 0:
        try:
            fastdist.barrier(sub, timeout=1.0)
            ctx.record("no_timeout")
        except CollectiveTimeoutError as e:
            ctx.record("sub_timeout", message=str(e), missing=e.missing_ranks, group=e.group)
    t = torch.tensor([float(ctx.rank + 1)])
    fastdist.all_reduce(t, timeout=20)  # the default group is untouched
    ctx.record(
        "default_ok",
        value=t.item(),
        default_dead=fastdist.is_dead(),
        sub_dead=fastdist.is_dead(sub) if ctx.rank < 2 else None,
    )
    if ctx.rank < 2:
        new_sub = fastdist.recover(sub, timeout=20)
        t = torch.tensor([float(ctx.rank + 1)])
        fastdist.all_reduce(t, group=new_sub, timeout=20)
        ctx.record(
            "sub_recovered",
            value=t.item(),
            size=dist.get_world_size(new_sub),
            default_still=dist.get_world_size(),
        )
    fastdist.barrier(timeout=20)


def leak_cycles(ctx) -> None:
    """2 ranks, 20 timeout -> recover cycles: thread and file descriptor counts stay flat."""
    import os

    ctx.init()
    counts, keys = [], []
    for _ in range(20):
        if ctx.rank == 0:
            try:
                fastdist.barrier(timeout=0.3)
                raise AssertionError("no timeout")
            except CollectiveTimeoutError:
                pass
        fastdist.recover(timeout=20)
        assert fastdist.barrier(timeout=20)
        counts.append((len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))))
        keys.append(dist.distributed_c10d._get_default_store().num_keys())
    ctx.record("counts", counts=counts, keys=keys)


def bench_recovery(ctx) -> None:
    """For bench/test_recovery_time.py: cycles of (the last rank skips a barrier, the others time
    out, everyone recovers); records each rank's time from timeout to a good barrier. Also
    records how long this process took from spawn to its first barrier (the restart cost)."""
    import os

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


def init_methods_then_recover(ctx) -> None:
    """fastdist.init_process_group through env:// (as torchrun sets it) or file://, then a
    timeout and a recovery that works with what it kept."""
    import os

    method = os.environ["FASTDIST_TEST_INIT"]
    if method == "env":
        # MASTER_PORT (a free port picked by the test) is served by rank 0, as under torchrun.
        os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size))
        fastdist.init_process_group("gloo", "env://", timeout=30)
    else:
        fastdist.init_process_group(
            "gloo",
            f"file://{os.environ['FASTDIST_TEST_FILE']}",
            rank=ctx.rank,
            world_size=ctx.world_size,
            timeout=30,
        )
    assert fastdist.get_rank() == ctx.rank and fastdist.get_world_size() == ctx.world_size
    fastdist.barrier(timeout=20)
    if ctx.rank == 0:
        try:
            fastdist.barrier(timeout=0.5)
        except CollectiveTimeoutError as e:
            ctx.record("timeout", missing=e.missing_ranks)
    new = fastdist.recover(timeout=20)
    _after_recovery(ctx, new)


# ---------------------------------------------------------------------------------------------
# Issue 6: RPC


def rpc_sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def rpc_add(a, b):
    return a + b


def rpc_timeouts(ctx) -> None:
    """2 ranks: rank 0 calls rank 1. A call that sleeps past its timeout raises RpcTimeoutError
    between the timeout and +0.5 s; a fast call then succeeds; rpc_async + fastdist.wait; a scope
    bounding several calls; remote().to_here(); bad arguments; a bounded shutdown."""
    import os

    import fastdist.rpc as frpc

    frpc.init_rpc(
        f"w{ctx.rank}",
        rank=ctx.rank,
        world_size=2,
        rpc_timeout=20,
        init_method=f"tcp://127.0.0.1:{os.environ['FASTDIST_RPC_PORT']}",
    )
    if ctx.rank == 0:
        seen = []
        fastdist.set_timeout_handler(seen.append)
        t0 = time.monotonic()
        try:
            frpc.rpc_sync("w1", rpc_sleep, args=(3.0,), timeout=1.0)
            ctx.record("no_timeout")
        except fastdist.RpcTimeoutError as e:
            ctx.record(
                "sync_timeout",
                elapsed=time.monotonic() - t0,
                to=e.to,
                func=e.func,
                timeout=e.timeout,
                is_timeout=isinstance(e, TimeoutError),
                handler=len(seen) == 1 and seen[0] is e,
                message=str(e),
            )
        ctx.record("fast_after", value=frpc.rpc_sync("w1", rpc_add, args=(2, 3), timeout=5))
        t0 = time.monotonic()
        fut = frpc.rpc_async("w1", rpc_sleep, args=(2.0,), timeout=0.5)
        try:
            fastdist.wait(fut)
            ctx.record("no_timeout")
        except fastdist.RpcTimeoutError:
            ctx.record("async_timeout", elapsed=time.monotonic() - t0)
        ok = frpc.rpc_async("w1", rpc_add, args=(torch.ones(2), 1), timeout=5)
        ctx.record("async_ok", value=fastdist.wait(ok, timeout=5).tolist())
        t0 = time.monotonic()
        try:
            with fastdist.fail_after(1.2):
                frpc.rpc_sync("w1", rpc_sleep, args=(0.5,))
                frpc.rpc_sync("w1", rpc_sleep, args=(0.5,))
                frpc.rpc_sync("w1", rpc_sleep, args=(0.5,))  # the scope runs out during this one
            ctx.record("no_timeout")
        except fastdist.RpcTimeoutError as e:
            ctx.record("scope_timeout", elapsed=time.monotonic() - t0, budget=e.timeout)
        rref = frpc.remote("w1", rpc_sleep, args=(2.0,), timeout=10)
        t0 = time.monotonic()
        try:
            rref.to_here(timeout=0.5)  # its own timeout, counted from this call
            ctx.record("no_timeout")
        except fastdist.RpcTimeoutError:
            ctx.record("to_here_timeout", elapsed=time.monotonic() - t0)
        ctx.record("remote_ok", value=frpc.remote("w1", rpc_add, args=(1, 1)).to_here())
        errors = []
        for call in (
            lambda: frpc.rpc_sync("w1", rpc_add, args=(1, 2), timeout=0),
            lambda: frpc.rpc_sync("w1", rpc_add, args=(1, 2), timeout="5"),
            lambda: frpc.rpc_sync("w1", "rpc_add", args=(1, 2)),
            lambda: frpc.rpc_sync("w1", rpc_add, args=[1, 2]),
            lambda: frpc.rpc_sync(3.5, rpc_add, args=(1, 2)),
        ):
            try:
                call()
                errors.append("no error")
            except (TypeError, ValueError) as e:
                errors.append(f"{type(e).__name__}: {e}")
        ctx.record("bad_args", errors=errors)
        fastdist.set_timeout_handler(None)
        # Leave rank 1 running a call whose caller gave up, then both shut down.
        try:
            frpc.rpc_async("w1", rpc_sleep, args=(3.0,), timeout=0.2).wait()
        except fastdist.RpcTimeoutError:
            pass
        ctx.store.set("rpc_done", "1")
    else:
        ctx.store.wait(["rpc_done"])
    t0 = time.monotonic()
    done = frpc.shutdown(timeout=1.5)
    ctx.record("shutdown", seconds=time.monotonic() - t0, done=done)


# ---------------------------------------------------------------------------------------------
# Issue 4: the NCCL code path against a test double (tests/fake_nccl.py)


def fake_nccl_logic(ctx) -> None:
    import fake_nccl
    from fastdist.ops import polled

    fake_nccl.register()
    fastdist.init_process_group(fake_nccl.NAME, store=dist.HashStore(), rank=0, world_size=1)
    t = torch.ones(1)
    # A blocking call returns when the "device" finished, not when the future did (at once).
    fake_nccl.DELAY = 0.3
    t0 = time.monotonic()
    fastdist.all_reduce(t, timeout=5)
    fastdist.barrier(timeout=5)
    ctx.record("blocking", elapsed=time.monotonic() - t0)
    # Async: wait() polls the work itself; a handle nobody waits on is released by the reaper.
    fake_nccl.DELAY = 0.2
    reaped = polled.reaper.reaped
    t0 = time.monotonic()  # before the issue: the op takes DELAY from there
    h = fastdist.all_reduce(t, async_op=True, timeout=5)
    first = h.is_completed()
    ok = h.wait()
    elapsed = time.monotonic() - t0
    unwaited = fastdist.all_reduce(t, async_op=True, timeout=5)
    # The reaper releases it (DELAY after its issue): poll for that, bounded.
    _poll_until(lambda: polled.reaper.pending() == 0 and unwaited.is_completed(), 3.0)
    ctx.record(
        "async",
        first=first,
        ok=ok,
        elapsed=elapsed,
        reaped=polled.reaper.reaped - reaped,
        pending=polled.reaper.pending(),
        unwaited_done=unwaited.is_completed() and unwaited.exception() is None,
    )
    # A hang: the deadline fires, the communicators are aborted, the group is dead.
    fake_nccl.DELAY = math.inf
    t0 = time.monotonic()
    try:
        fastdist.all_reduce(t, timeout=0.5)
        ctx.record("no_timeout")
    except CollectiveTimeoutError as e:
        elapsed = time.monotonic() - t0
        ctx.record(
            "timeout",
            elapsed=elapsed,
            aborts_done=polled.wait_aborts(),
            aborted=len(fake_nccl.aborted_groups),
            message=str(e),
        )
    try:
        fastdist.all_reduce(t, timeout=5)
    except GroupAbortedError:
        ctx.record("refused")
    new = fastdist.recover(timeout=5)
    fake_nccl.DELAY = 0.0
    t = torch.tensor([3.0])
    fastdist.all_reduce(t, timeout=5)
    ctx.record("recovered", value=t.item(), new_group=new is not None, dead=fastdist.is_dead())
    # An async handle nobody waits on still times out and aborts.
    fake_nccl.DELAY = math.inf
    aborted_before = len(fake_nccl.aborted_groups)
    h = fastdist.all_reduce(t, async_op=True, timeout=0.3)
    _poll_until(lambda: h.is_completed() and len(fake_nccl.aborted_groups) > aborted_before, 3.0)
    ctx.record(
        "unwaited",
        completed=h.is_completed(),
        error=type(h.exception()).__name__,
        dead=fastdist.is_dead(),
        aborted=len(fake_nccl.aborted_groups),
    )
    fastdist.recover(timeout=5)
    # Finally, an abort that hangs: the caller still raises at its deadline, and the abort's own
    # deadline (FASTDIST_ABORT_TIMEOUT=0.5 in this run) ends the process while recover() waits.
    fake_nccl.ABORT_HANGS = True
    ctx.record("before_hanging_abort")
    t0 = time.monotonic()
    try:
        fastdist.all_reduce(t, timeout=0.3)
    except CollectiveTimeoutError:
        ctx.record("raised_while_aborting", elapsed=time.monotonic() - t0)
    fastdist.recover(timeout=5)
    ctx.record("survived_hanging_abort")


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
        _record_error(ctx, "error", e, start)
    try:
        fastdist.barrier(timeout=5)
    except GroupAbortedError:
        ctx.record("refused")


# ---------------------------------------------------------------------------------------------
# Issue 4 on real GPUs (tests/gpu): NCCL, one process per GPU


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
    import os

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


def bench_reaping(ctx) -> None:
    """For bench/: what reaping costs per op with 10,000 async works in flight, on the fake NCCL
    double (CPU) or on real NCCL (FASTDIST_BENCH_BACKEND=nccl, one GPU)."""
    import os
    import statistics

    from fastdist.deadlines import engine
    from fastdist.ops.polled import Reaper

    backend = os.environ.get("FASTDIST_BENCH_BACKEND", "fake")
    if backend == "nccl":
        torch.cuda.set_device(0)
        fastdist.init_process_group("nccl", store=dist.PrefixStore("pg", ctx.store), rank=0, world_size=1)
        t = torch.ones(1, device="cuda")
    else:
        import fake_nccl

        fake_nccl.register()
        fastdist.init_process_group(fake_nccl.NAME, store=dist.HashStore(), rank=0, world_size=1)
        t = torch.ones(1)
    pg = dist.distributed_c10d._get_default_group()
    from torch.distributed.distributed_c10d import AllreduceOptions

    n = int(os.environ.get("FASTDIST_BENCH_INFLIGHT", "10000"))
    import collections

    per_op: dict[bool, list[float]] = {True: [], False: []}
    for ordered in (True, False):  # collectives (in issue order) / queried one by one (p2p)
        for _ in range(5):
            reaper = Reaper()  # private and not started: time its passes alone
            eng = engine()
            works = [pg.allreduce([t], AllreduceOptions()) for _ in range(n)]
            if backend == "nccl":
                torch.cuda.synchronize()
            tokens = [eng.add(eng.now() + 3600) for _ in range(n)]
            reaper._queues[(0, ordered)] = collections.deque(zip(works, tokens))
            t0 = time.perf_counter()
            done = reaper.reap_once()
            per_op[ordered].append((time.perf_counter() - t0) / max(done, 1))
            assert done == n, done
            assert all(tok.state == 1 for tok in tokens)
    # The same through the public API: n async all_reduces in flight, then waited.
    t0 = time.perf_counter()
    handles = [fastdist.all_reduce(t, async_op=True, timeout=60) for _ in range(n)]
    issued = time.perf_counter() - t0
    for h in handles:
        h.wait()
    ctx.record(
        "reaping",
        backend=backend,
        inflight=n,
        reap_per_op_us=statistics.median(per_op[True]) * 1e6,
        reap_each_per_op_us=statistics.median(per_op[False]) * 1e6,
        issue_per_op_us=issued / n * 1e6,
        total_s=time.perf_counter() - t0,
    )


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


# ---------------------------------------------------------------------------------------------
# Issue 5: rendezvous through fastdist.init_process_group


def rdzv_init(ctx) -> None:
    """3 ranks: the last never calls init; the others' rendezvous names it within the timeout."""
    import os

    if ctx.rank == ctx.world_size - 1:
        ctx.wait_release()
        return
    t0 = time.monotonic()
    try:
        fastdist.init_process_group(
            "gloo",
            f"tcp://127.0.0.1:{os.environ['FASTDIST_RDZV_PORT']}",
            rank=ctx.rank,
            world_size=ctx.world_size,
            connect_timeout=10,
            rendezvous_timeout=fastdist.RendezvousTimeout(1.5),
        )
        ctx.record("no_error")
    except fastdist.RendezvousTimeoutError as e:
        ctx.record(
            "rdzv_timeout",
            elapsed=time.monotonic() - t0,
            missing=e.missing_ranks,
            joined=e.joined,
            message=str(e),
        )


def bench_detection(ctx) -> None:
    """For bench/: time from the deadline to the error in the caller over N hangs on a 2-rank
    subgroup, with the missing-rank report (the default) and without it."""
    import os
    import statistics

    from fastdist.diagnostics import board

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
    _after_recovery(ctx, new)
