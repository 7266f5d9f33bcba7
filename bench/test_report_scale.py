"""The fault report and the recovery agreement at scale (issue 14): 1,024 and 4,096 simulated
ranks, as store clients spread over processes (256 each) against one TCPStore, run fastdist's own
protocols (report, ring tree, status board and summary; the agreement with everyone in, and with
one rank gone and ``allow_shrink``): store operations per rank, and how long until the last
rank holds the result. Goals: at most 8 operations per rank for each; the report done within its
window plus 100 ms at 1,024 ranks; the agreement within 100 ms of the last rank's arrival."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import SMOKE
from fastdist.store import board

pytestmark = pytest.mark.timeout(900)
# 256 simulated ranks (threads) per process: 4 processes at 1,024 ranks, 16 at 4,096 (at 1,024
# threads a process, its threads' contention for the GIL, not the protocol, set the pace).
RANKS_PER_PROC = 256


# 4,096 takes a few minutes here (and 8,192 connections): FASTDIST_BENCH_RANKS=1024,4096 runs it.
RANKS = [16] if SMOKE else [int(x) for x in os.environ.get("FASTDIST_BENCH_RANKS", "1024").split(",")]


# torch's TCPStore server looks up each new client's name (getnameinfo on ::ffff:127.0.0.1) in
# its one event-loop thread, and so does the client; where no DNS server answers (this machine)
# glibc waits 5 s a try, and the whole store, every other client's operations included, waits with
# it. 4 x 2,048 connections did not finish in 500 s; with one 1 s try (glibc's RES_OPTIONS, read
# by each new thread, the server's loop included) they take 2-7 s. Only the simulated ranks'
# set-up is affected: the protocols run on connections made before they start, with no connect
# during them. A value set by the caller is kept.
_RES_OPTIONS = os.environ.get("RES_OPTIONS", "timeout:1 attempts:1")


def _gather(store: Any, counter: str, target: int, seconds: float) -> None:
    """Waits until every simulated rank (or process) has added itself to ``counter``."""
    deadline = time.monotonic() + seconds
    while store.add(counter, 0) < target and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.add(counter, 0) == target, (counter, store.add(counter, 0), target)


@pytest.mark.parametrize("world", RANKS)
def test_report_scale(benchmark, monkeypatch, world: int) -> None:
    import torch.distributed as dist

    monkeypatch.setenv("RES_OPTIONS", _RES_OPTIONS)  # before the server's thread starts; inherited
    store = dist.TCPStore(
        "127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=300)
    )
    procs_n = max(1, world // RANKS_PER_PROC)
    per = world // procs_n
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).with_name("sim_report.py")),
                str(store.port),
                str(i * per),
                str(per),
                str(world),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(procs_n)
    ]
    try:
        _gather(store, "ready", procs_n, 500)
        store.set("fire", "1")
        # (4,096 simulated ranks are 4,096 threads on 2 cores: a minute or two here)
        patience = 120 * max(1, world // 1024)
        _gather(store, "reported", world, patience)
        store.set("agree", "1")
        _gather(store, "agreed", world, patience)
        shrink_deadline = time.time() + 1.0
        store.set("shrink_deadline", repr(shrink_deadline))
        store.set("shrink", "1")
        outs = [p.communicate(timeout=300) for p in procs]
    except AssertionError as exc:  # a phase did not complete: say what the processes said
        for p in procs:
            p.kill()
        errs = [p.communicate()[1] for p in procs]
        said = ["\n".join(ln for ln in e.splitlines() if "c10d" not in ln)[-1500:] for e in errs]
        raise AssertionError(f"{exc}; the processes' stderr: {said}") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))

    def merged(phase: str, what: str) -> dict[int, float]:
        return {int(r): v for res in results for r, v in res[phase][what].items()}

    answered = next(r["answered"] for r in results if r["answered"] is not None)
    rep_done, agree_done, shrink_done = (
        merged("report", "done"),
        merged("agree", "done"),
        merged("shrink", "done"),
    )
    assert len(rep_done) == world - 1 and len(agree_done) == world and len(shrink_done) == world - 1
    t0 = merged("report", "start")[0]
    report_ms = (max(rep_done.values()) - t0) * 1000
    first_ms = (min(rep_done.values()) - t0) * 1000  # about when the summary was published
    ring_ms = (max(merged("report", "rung").values()) - t0) * 1000
    agree_ms = (max(agree_done.values()) - max(merged("agree", "start").values())) * 1000
    shrink_ms = (max(shrink_done.values()) - shrink_deadline) * 1000
    ops = {p: list(merged(p, "ops").values()) for p in ("report", "agree", "shrink")}
    extra = {
        "ranks": world,
        "answered_in_window": answered,
        "window_ms": board.window(1.0, world) * 1000,
        "last_holds_report_ms": report_ms,
        "first_holds_report_ms": first_ms,
        "ring_reached_all_ms": ring_ms,
        "agreement_after_last_arrival_ms": agree_ms,
        "shrink_after_deadline_ms": shrink_ms,
    }
    for p, n in ops.items():
        extra[f"{p}_ops_per_rank_median"] = statistics.median(n)
        extra[f"{p}_ops_per_rank_max"] = max(n)
    benchmark.extra_info.update(extra)
    lines = [
        (
            f"report at {world} ranks: the last rank held it {report_ms:.0f} ms after the first timeout "
            f"(window {extra['window_ms']:.0f} ms; the ring reached the last rank at {ring_ms:.0f} ms, the "
            f"first held it at {first_ms:.0f} ms); {answered} of {world - 1} live ranks posted in time"
        ),
        f"agreement at {world} ranks, all in: the last rank held it {agree_ms:.0f} ms after the last arrival",
        f"agreement at {world} ranks, one gone: the last rank held it {shrink_ms:.0f} ms past the deadline",
    ]
    for line, n in zip(lines, ops.values()):
        print(f"\n{line}; store ops per rank: median {statistics.median(n):.0f}, max {max(n)}", end="")
    print()
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
