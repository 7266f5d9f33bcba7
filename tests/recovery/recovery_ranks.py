"""The ranks of tests/recovery/test_recovery.py: recover() after faults, its init methods, no leaks
over cycles."""

from __future__ import annotations

import os
import sys
import threading
import time

import fastdist
import torch
import torch.distributed as dist
from fastdist import CollectiveTimeoutError
from ranks_common import after_recovery


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
    """2 ranks, groups made by plain torch (no fastdist.init_process_group): fastdist's own ops
    go through the same watched C++ path as on a group fastdist made. 100 healthy collectives make
    no store operation and are in fastdist.history(); rank 1 then skips a barrier on a subgroup:
    rank 0's raises CollectiveTimeoutError naming it; then an async all_reduce that nobody waits
    on times out, its handler runs on fastdist's thread and its sys.exit(7) ends the process with
    code 7."""

    counting = CountingStore(dist.PrefixStore("pg", ctx.store))
    dist.init_process_group("gloo", store=counting, rank=ctx.rank, world_size=ctx.world_size)
    sub = dist.new_group([0, 1])
    fastdist.barrier(timeout=20)
    before = counting.ops
    t = torch.ones(4)
    for _ in range(25):
        fastdist.all_reduce(t, timeout=20)
        fastdist.barrier(timeout=20)
        fastdist.broadcast(t, src=0, timeout=20)
        fastdist.all_gather([torch.zeros(4) for _ in range(2)], t, timeout=20)
    ctx.record("store_ops", during=counting.ops - before, at_init=before)
    ctx.record("history", ops=[r["op"] for r in fastdist.history()][-4:], n=len(fastdist.history()))
    if ctx.rank == 1:
        ctx.wait_release()
        return
    start = time.monotonic()
    try:
        fastdist.barrier(sub, timeout=1.0)
    except fastdist.CollectiveTimeoutError as err:
        ctx.record("sub_timeout", missing=err.missing_ranks, seconds=time.monotonic() - start, text=str(err))

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
    _told_in_a_subgroup(ctx, new_sub if ctx.rank < 2 else None)


def _told_in_a_subgroup(ctx, sub) -> None:
    """Then rank 0 waits in an all_reduce on the subgroup (30 s) that rank 1 never joins: rank 1
    times out on the default group (1 s), where rank 2 does not arrive. Rank 0 is told: its
    subgroup op ends within seconds naming the default group's fault (it waited out its own 30 s
    before, while the others' recovery waited for it), and every rank recovers the job."""
    start = time.monotonic()
    try:
        if ctx.rank == 0:
            fastdist.all_reduce(torch.ones(1), group=sub, timeout=30)
        elif ctx.rank == 1:
            fastdist.barrier(timeout=1.0)
        else:
            time.sleep(4)
            fastdist.barrier(timeout=20)  # rank 1's fault aborted it meanwhile
        ctx.record("told", seconds=None)
    except fastdist.FastdistError as e:
        ctx.record("told", seconds=time.monotonic() - start, message=str(e), kind=type(e).__name__)
    fastdist.recover(timeout=30)
    t = torch.ones(1)
    fastdist.all_reduce(t, timeout=20)
    s = torch.ones(1)
    if sub is not None:
        fastdist.all_reduce(s, group=sub, timeout=20)
    ctx.record("after_told", value=t.item(), sub=s.item())


def _thread_names() -> list[str]:
    """This process's threads by their kernel names (native ones too), sorted."""
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                out.append(f.read().strip())
        except OSError:
            pass  # ended as we read
    return sorted(out)


def _settled_counts(floor: tuple[int, int] | None) -> tuple[int, int]:
    """(threads, fds), the fewest seen while polling: the backend a recovery replaced is let go on
    a thread of its own (csrc/watched/backend.cpp, Reaper), which takes a moment after the
    recovery ends (measured: under 50 ms; its gloo loop thread, worker and sockets count until
    then). Polls up to 2 s, less once both are down to ``floor`` (the first cycles' counts)."""

    best = (1 << 30, 1 << 30)
    end = time.monotonic() + (2.0 if floor is not None else 1.0)
    while time.monotonic() < end:
        now = (len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd")))
        best = (min(best[0], now[0]), min(best[1], now[1]))
        if floor is not None and best[0] <= floor[0] and best[1] <= floor[1]:
            break
        time.sleep(0.02)
    return best


def leak_cycles(ctx) -> None:
    """2 ranks, 20 timeout -> recover cycles: thread and file descriptor counts stay flat."""

    ctx.init()
    counts, keys, names = [], [], []
    for _ in range(20):
        if ctx.rank == 0:
            try:
                fastdist.barrier(timeout=0.3)
                raise AssertionError("no timeout")
            except CollectiveTimeoutError:
                pass
        fastdist.recover(timeout=20)
        assert fastdist.barrier(timeout=20)
        counts.append(_settled_counts(counts[2] if len(counts) > 2 else None))
        keys.append(dist.distributed_c10d._get_default_store().num_keys())
        names.append(_thread_names())
    # The threads by name in the third cycle and the last (what a failure shows).
    ctx.record("counts", counts=counts, keys=keys, names=[names[2], names[-1]])


def init_methods_then_recover(ctx) -> None:
    """fastdist.init_process_group through env:// (as torchrun sets it) or file://, then a
    timeout and a recovery that works with what it kept."""

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
    after_recovery(ctx, new)
