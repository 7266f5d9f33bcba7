"""The ranks of tests/ops/test_rpc.py: fastdist.rpc's timeouts."""

from __future__ import annotations

import os
import time

import fastdist
import torch


def rpc_sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def rpc_add(a, b):
    return a + b


def rpc_timeouts(ctx) -> None:
    """2 ranks: rank 0 calls rank 1. A call that sleeps past its timeout raises RpcTimeoutError
    between the timeout and +0.5 s; a fast call then succeeds; rpc_async + fastdist.wait; a scope
    bounding several calls; remote().to_here(); bad arguments; a bounded shutdown."""

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
