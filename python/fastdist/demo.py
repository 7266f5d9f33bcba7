"""``fastdist demo``: a local multi-rank job on gloo in which one rank hangs.

The parent starts a TCPStore on 127.0.0.1 (a free port) and N rank processes. The ranks run a
few healthy barriers and all_gathers, then one rank stops taking part (it "hangs": it stays
alive but never enters the next collective) and every other rank gets CollectiveTimeoutError at
about the timeout. Each rank prints what happened; the parent prints how long detection took.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

_PREFIX = "fastdist_demo"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=3, help="number of local ranks (default 3)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=2.0,
        help="deadline of the collective that hangs, seconds (default 2)",
    )
    parser.add_argument("--hang-rank", type=int, default=None, help="the rank that hangs (default: the last)")
    parser.add_argument("--rounds", type=int, default=3, help="healthy rounds before the hang (default 3)")


def run(args: argparse.Namespace) -> int:
    """The parent: starts the store and the ranks, collects and prints the outcome."""
    if args.nproc < 2:
        raise SystemExit("fastdist demo: --nproc must be at least 2")
    if not args.timeout > 0:
        raise SystemExit("fastdist demo: --timeout must be positive")
    hang = args.nproc - 1 if args.hang_rank is None else args.hang_rank
    if not 0 <= hang < args.nproc:
        raise SystemExit(f"fastdist demo: --hang-rank must be in 0..{args.nproc - 1}, got {hang}")

    from torch.distributed import TCPStore

    store = TCPStore(
        "127.0.0.1", 0, args.nproc + 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    print(
        f"fastdist demo: {args.nproc} ranks on gloo, TCPStore on 127.0.0.1:{store.port}; "
        f"rank {hang} will hang, timeout {args.timeout:g} s",
        flush=True,
    )
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(args.nproc):
            cmd = [
                sys.executable,
                "-m",
                "fastdist.demo",
                str(rank),
                str(args.nproc),
                str(store.port),
                str(args.timeout),
                str(hang),
                str(args.rounds),
            ]
            procs.append(subprocess.Popen(cmd))
        waiting = [r for r in range(args.nproc) if r != hang]
        # Every rank imports torch (~1 s each on a small machine) before the clock starts.
        store.wait(
            [f"{_PREFIX}/result/{r}" for r in waiting],
            timedelta(seconds=60 + 4 * args.nproc + 2 * args.timeout),
        )
        results = {r: json.loads(store.get(f"{_PREFIX}/result/{r}")) for r in waiting}
        store.set(f"{_PREFIX}/release", "1")
        for p in procs:
            p.wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
    return _summarize(results, hang, args.timeout)


def _summarize(results: dict[int, dict[str, Any]], hang: int, timeout: float) -> int:
    print("\nrank  outcome                  detected after  past the deadline (with the report)")
    ok = True
    for rank, res in sorted(results.items()):
        if res["outcome"] == "CollectiveTimeoutError":
            late_ms = (res["elapsed"] - timeout) * 1000
            print(f"{rank:>4}  {res['outcome']:<24} {res['elapsed']:>12.3f} s  {late_ms:>13.1f} ms")
            ok = ok and -1 <= late_ms < 1000
        else:
            print(f"{rank:>4}  {res['outcome']:<24}")
            ok = False
    print(f"{hang:>4}  hung (never entered the barrier)")
    print(
        "\nEvery waiting rank got a typed, catchable error at its deadline instead of hanging, naming the"
        "\nmissing rank. The report waits min(1 s, 10% of the timeout) for the missing rank's status."
        if ok
        else "\nUNEXPECTED: not every waiting rank detected the hang in time."
    )
    return 0 if ok else 1


def _rank_main(rank: int, world_size: int, port: int, timeout: float, hang: int, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    import fastdist

    def say(text: str) -> None:
        print(f"[rank {rank}] {text}", flush=True)

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"{_PREFIX}/pg", store), rank=rank, world_size=world_size
    )
    for i in range(rounds):
        fastdist.barrier(timeout=30)
        out = [torch.zeros(1) for _ in range(world_size)]
        fastdist.all_gather(out, torch.tensor([float(rank * 10 + i)]), timeout=30)
        assert [int(t.item()) for t in out] == [r * 10 + i for r in range(world_size)]
    say(f"{rounds} healthy rounds of barrier + all_gather: ok")

    if rank == hang:
        say("hanging now (alive, but never entering the next barrier)")
        store.wait([f"{_PREFIX}/release"], timedelta(seconds=300))
        return
    start = time.monotonic()
    try:
        fastdist.barrier(timeout=timeout)
        result: dict[str, Any] = {"outcome": "returned"}
    except fastdist.CollectiveTimeoutError as e:
        elapsed = time.monotonic() - start
        say(f"CollectiveTimeoutError after {elapsed:.3f} s: {e}")
        result = {"outcome": "CollectiveTimeoutError", "elapsed": elapsed}
    try:
        fastdist.barrier(timeout=timeout)
    except fastdist.GroupAbortedError as e:
        say(f"next call refused at once: GroupAbortedError: {e}")
    store.set(f"{_PREFIX}/result/{rank}", json.dumps(result))


if __name__ == "__main__":
    # Started by run(): RANK WORLD_SIZE PORT TIMEOUT HANG_RANK ROUNDS
    _rank, _world, _port, _timeout, _hang, _rounds = sys.argv[1:7]
    _rank_main(int(_rank), int(_world), int(_port), float(_timeout), int(_hang), int(_rounds))
