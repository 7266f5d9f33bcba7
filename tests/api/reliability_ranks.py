"""The ranks of tests/api/test_reliability.py: threads, fork, a store host that dies, faults inside
recover()."""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time

import fastdist
import torch
import torch.distributed as dist


def reliability_single(ctx) -> None:
    """One rank (a world of 1 on the harness's store): huge timeouts, non-contiguous tensors,
    refused calls that must not skew the op numbers, and the message of a call made after its
    scope's deadline."""

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
    before = st.ctl.seq
    refused = []
    for call in (
        lambda: fastdist.all_gather([torch.zeros(1)] * 3, torch.zeros(1), timeout=5),
        lambda: fastdist.all_reduce(torch.ones(1), op="sum", timeout=5),
    ):
        try:
            call()
        except (ValueError, TypeError) as e:
            refused.append(type(e).__name__)
    ctx.record("seq", before=before, after=st.ctl.seq, refused=refused)
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
    # The handler runs while the timeout's error is built, a moment before the op ends with it:
    # wait for both (seeing only the first once made the handle read "not completed").
    while not (seen and h.is_completed()) and time.monotonic() < deadline:
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


def recover_from_two_threads(ctx) -> None:
    """2 ranks, 20 rounds: on every rank two threads call fastdist.recover() at once on the
    healthy default group; both return the group (one recovered it, the other shared its
    outcome), and a barrier and an all_reduce on it then work. "At once" is made sure of: the
    recovery that runs first starts only once the other thread waits for it (on a loaded machine
    a thread can start after a whole recovery of a healthy group has ended; its call is then a
    second recovery, which the other rank, whose calls overlapped, never makes)."""
    from fastdist.groups import pgstate
    from fastdist.recovery import recover as recovery

    ctx.init()
    real = recovery._recover

    def once_the_other_waits(pg, *args, **kwargs):
        turns, until = pgstate.state_of(pg).turns, time.monotonic() + 10
        while turns.waiting == 0 and time.monotonic() < until:
            time.sleep(0.002)
        return real(pg, *args, **kwargs)

    recovery._recover = once_the_other_waits
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


def recover_again_after_a_failed_agreement(ctx) -> None:
    """3 ranks, all alive: rank 2 comes to recover() only once ranks 0 and 1 gave up on it (their
    short recover() failed, naming rank 2). Then every rank calls recover() again, rank 2 for the
    first time: it succeeds on every rank, and no rank ever names itself as missing."""
    ctx.init()
    fastdist.barrier(timeout=20)
    attempts = []
    if ctx.rank == 2:
        ctx.store.wait(["failed_agreement/0", "failed_agreement/1"])
    else:
        try:
            fastdist.barrier(timeout=0.5)
        except fastdist.CollectiveTimeoutError:
            pass
        try:
            fastdist.recover(timeout=1.0)
            attempts.append({"ok": True})
        except fastdist.RecoveryError as e:
            attempts.append({"ok": False, "missing": e.missing_ranks, "message": str(e)})
        ctx.store.set(f"failed_agreement/{ctx.rank}", "1")
    for _ in range(3):
        t0 = time.monotonic()
        try:
            fastdist.recover(timeout=20)
            attempts.append({"ok": True, "seconds": time.monotonic() - t0})
            break
        except fastdist.RecoveryError as e:
            attempts.append({"ok": False, "missing": e.missing_ranks, "message": str(e)})
    t = torch.ones(1)
    if attempts[-1]["ok"]:
        fastdist.all_reduce(t, timeout=20)
    ctx.record("attempts", attempts=attempts, value=t.item(), world_size=dist.get_world_size())


def op_after_a_peer_left_between_ops(ctx) -> None:
    """Rank 1 leaves (os._exit) between two ops; rank 0 issues a recv from it, then an all_reduce,
    once gloo's connection to it has closed: the backend throws as the op is issued, and what
    rank 0 sees must be fastdist's error, not gloo's."""
    ctx.init()
    dist.barrier()
    if ctx.rank == 1:
        ctx.record("leaving")
        sys.stdout.flush()
        os._exit(0)
    time.sleep(1.5)  # gloo's pair has read the peer's close by now
    for name, op in (
        ("recv", lambda: dist.recv(torch.zeros(2), 1)),
        ("all_reduce", lambda: dist.all_reduce(torch.ones(2))),
    ):
        try:
            with fastdist.fail_after(10):
                op()
        except Exception as err:  # noqa: BLE001 - the test is which kind it is
            ctx.record(
                name,
                kind=type(err).__name__,
                fastdist=isinstance(err, fastdist.FastdistError),
                message=str(err)[:400],
            )
