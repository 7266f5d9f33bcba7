"""The ranks of tests/diagnostics/test_netfaults.py: each rank in its own network namespace,
the job's store on a node of its own, faults made with nftables and link state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import fastdist
import torch
import torch.distributed as dist
from fastdist import CollectiveTimeoutError, FastdistError, GroupAbortedError, RecoveryError


def _ops(ctx, n: int, timeout: float) -> tuple[int, float]:
    """``n`` healthy all_reduces of 1 MB and a barrier; (errors, slowest seconds)."""
    errors, slowest = 0, 0.0
    for _ in range(n):
        t0 = time.monotonic()
        try:
            t = torch.ones(256 * 1024)
            fastdist.all_reduce(t, timeout=timeout)
            assert t[0].item() == dist.get_world_size()
        except FastdistError:
            errors += 1
        slowest = max(slowest, time.monotonic() - t0)
    fastdist.barrier(timeout=timeout)
    return errors, slowest


def _error(e: BaseException, t0: float) -> dict:
    return {
        "type": type(e).__name__,
        "message": str(e),
        "elapsed": time.monotonic() - t0,
        "missing": getattr(e, "missing_ranks", None),
    }


def net_faults(ctx) -> None:
    """3 ranks and a store host, each on its own node.

    L: 10% of what rank 1 sends is lost: 10 healthy all_reduces under a 30 s deadline, no false
       timeouts (TCP's retransmissions back off: a few losses in a row cost seconds).
    F: rank 1's link goes down for 2 s mid-collectives and comes back: the same, 10 s deadline.
    P: rank 2's node drops off the network (every packet vanishes) mid all_reduce: ranks 0 and 1
       raise naming it within the deadline plus the report window; recover(allow_shrink=True)
       leaves it out and they go on. While cut off, rank 2 runs `fastdist doctor` (unreachable
       within its timeout) and a rendezvous connect (cause "unreachable"). When its link is back,
       its next call fails fast with a typed error and its recover() says it was left out.
    S: the store's host drops off: rank 0's timeout report and recover() give the diagnosed
       "store cannot be reached" error within their bounds, not a hang; healed, they go on."""
    store_ip, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    fastdist.init_process_group("gloo", "env://", timeout=60)
    fastdist.barrier(timeout=30)
    ctx.record("up", world=dist.get_world_size())

    # L
    if ctx.rank == 1:
        ctx.net.loss(ctx.me, 10)
    fastdist.barrier(timeout=30)
    errors, slowest = _ops(ctx, 10, timeout=30.0)
    ctx.record("loss", errors=errors, slowest=slowest)
    fastdist.barrier(timeout=30)
    if ctx.rank == 1:
        ctx.net.heal(ctx.me)

    # F
    fastdist.barrier(timeout=30)
    if ctx.rank == 0:
        ctx.net.link("r1", False)
        threading.Timer(2.0, ctx.net.link, ("r1", True)).start()
    t0 = time.monotonic()
    errors, slowest = _ops(ctx, 3, timeout=10.0)
    ctx.record("flap", errors=errors, slowest=slowest, seconds=time.monotonic() - t0)

    # P
    fastdist.barrier(timeout=30)
    big = torch.ones(8 * 1024 * 1024)
    if ctx.rank == 2:
        side = threading.Thread(target=_cut_off_checks, args=(ctx, store_ip, port))
        h = fastdist.all_reduce(big, async_op=True, timeout=3)
        ctx.signal("r2_issued")
        ctx.net.partition(ctx.me)  # mid all_reduce: every packet in and out vanishes
        ctx.record("cut_off")
        side.start()
        t0 = time.monotonic()
        try:
            h.wait()
            ctx.record("p_own_no_error")
        except FastdistError as e:
            ctx.record("p_own", **_error(e, t0))
        side.join()
        t0 = time.monotonic()
        try:
            fastdist.barrier(timeout=5)
            ctx.record("p_next_no_error")
        except FastdistError as e:
            ctx.record("p_next", **_error(e, t0))
        t0 = time.monotonic()
        try:
            fastdist.recover(timeout=5, allow_shrink=True)
            ctx.record("p_recover_no_error")
        except RecoveryError as e:
            ctx.record("p_recover", **_error(e, t0))
        ctx.signal("r2_done")
        ctx.wait_for("done", 60)
        return
    # Joined once rank 2 is cut off: else the op could end before its partition is in place.
    ctx.wait_for("r2_issued", 30)
    limit = time.monotonic() + 30
    while not ctx.net.partitioned("r2") and time.monotonic() < limit:
        time.sleep(0.05)
    t0 = time.monotonic()
    try:
        fastdist.all_reduce(big, timeout=3)
        ctx.record("p_no_error")
    except (CollectiveTimeoutError, GroupAbortedError) as e:
        ctx.record("p", **_error(e, t0))
    fastdist.recover(timeout=3, allow_shrink=True)
    t = torch.tensor([float(dist.get_rank() + 1)])
    fastdist.all_reduce(t, timeout=10)
    ctx.record("shrunk", world=dist.get_world_size(), sum=t.item())
    ctx.signal(f"shrunk{ctx.rank}")
    ctx.wait_for("r2_done", 60)  # rank 2's recover() runs on a reachable store

    # S
    fastdist.barrier(timeout=30)
    if ctx.rank == 0:
        ctx.net.partition("store")
        t0 = time.monotonic()
        try:
            fastdist.barrier(timeout=1)  # rank 1 stays away: a timeout, whose report needs the store
            ctx.record("s_no_error")
        except FastdistError as e:
            ctx.record("s", **_error(e, t0))
        t0 = time.monotonic()
        try:
            fastdist.recover(timeout=3)
            ctx.record("s_recover_no_error")
        except FastdistError as e:
            ctx.record("s_recover", **_error(e, t0))
        ctx.net.heal("store")
        ctx.signal("store_back")
    else:
        ctx.wait_for("store_back", 60)
    fastdist.recover(timeout=30)
    t = torch.ones(1)
    fastdist.all_reduce(t, timeout=10)
    ctx.record("after_store", sum=t.item())
    if ctx.rank == 0:
        ctx.signal("done")


def _cut_off_checks(ctx, store_ip: str, port: int) -> None:
    """Rank 2, cut off: doctor and a rendezvous connect from here, then its link comes back once
    the others have recovered without it."""
    from fastdist.errors import RendezvousConnectionError
    from fastdist.store import rendezvous

    t0 = time.monotonic()
    doctor = subprocess.run(
        [sys.executable, "-m", "fastdist", "doctor", "--master-addr", store_ip, "--master-port", str(port)]
        + ["--timeout", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    try:
        checks = json.loads(doctor.stdout)["checks"]
    except ValueError:
        checks = [{"name": "unparsed", "detail": doctor.stdout + doctor.stderr}]
    ctx.record("doctor", rc=doctor.returncode, checks=checks, seconds=time.monotonic() - t0)
    t0 = time.monotonic()
    try:
        rendezvous.connect_store(
            store_ip, port, is_master=False, connect_timeout=1.5, retries=None, backoff=0.1
        )
        ctx.record("connect_no_error")
    except RendezvousConnectionError as e:
        ctx.record("connect", cause=e.cause, seconds=time.monotonic() - t0, message=str(e))
    ctx.wait_for("shrunk0", 60)
    ctx.wait_for("shrunk1", 60)
    ctx.net.heal(ctx.me)
    ctx.record("link_back")
