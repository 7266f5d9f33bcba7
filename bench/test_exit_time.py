"""Issue 25, item 6: how long a process takes to exit after Ctrl-C in DDP's backward (a peer that
never comes, fastdist's watched groups), against torch's own exit in the same run: a process that
only imports torch, and a gloo + DDP process that trains a step and exits normally. Measured from
the process's last line to its end, as its parent sees it (tests/support/mp.py polls every 10 ms)."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SMOKE

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path[:0] = [str(TESTS / "support"), str(TESTS / "groups")]  # the harness; watched_ranks
import watched_ranks
from mp import free_port, run_ranks

TORCH_ONLY = "import torch, time; print(time.time(), flush=True)"
TORCH_DDP = (
    "import os, sys, time, torch, torch.distributed as dist\n"
    "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=sys.argv[1])\n"
    "dist.init_process_group('gloo', rank=0, world_size=1)\n"
    "m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4))\n"
    "m(torch.ones(2, 16)).sum().backward()\n"
    "print(time.time(), flush=True)\n"
)


def _exit_seconds(code: str, *args: str) -> float:
    with subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True) as proc:
        try:
            last = float(proc.stdout.readline())  # type: ignore[union-attr]
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return time.time() - last


@pytest.mark.timeout(300)
def test_exit_after_ctrl_c_against_torchs_own_exit(benchmark) -> None:
    rounds = 1 if SMOKE else 3
    torch_only = [_exit_seconds(TORCH_ONLY) for _ in range(rounds)]
    torch_ddp = [_exit_seconds(TORCH_DDP, str(free_port())) for _ in range(rounds)]
    interrupted = []
    for _ in range(rounds):
        r0 = run_ranks(watched_ranks.watched_ctrl_c, 2, absent=(1,), timeout=60)[0]
        assert r0.returncode == 0 and r0.exited_at is not None, r0.stderr[-3000:]
        interrupted.append(r0.exited_at - r0.record("ending")["wall"])
    a, b, c = (statistics.median(x) for x in (torch_only, torch_ddp, interrupted))
    print(
        f"\nexit: import torch only {a:.2f} s; gloo + DDP, a normal exit {b:.2f} s; fastdist, Ctrl-C in "
        f"DDP's backward with a peer that never comes {c:.2f} s: ratio {c / b:.2f} against torch's "
        f"normal exit (median of {rounds})"
    )
    benchmark.extra_info.update({"torch_only_s": a, "torch_ddp_s": b, "ctrl_c_s": c, "ratio": c / b})
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
