"""Issue 28: metrics a monitoring system scrapes, and events a log shipper collects, from a 3-rank
job after a fault. The rank code is beside its assertions (tests/rank_main.py runs
``test_metrics:fault_job`` in each rank's process)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mp import describe, run_ranks


def fault_job(ctx) -> None:  # type: ignore[no-untyped-def]
    """Rank 0 serves its metrics from FASTDIST_METRICS_PORT (set by init_process_group), the others
    from fastdist.serve_metrics(0). Three all_reduces, rank 2 late for the fourth (ranks 0 and 1
    time out), recover(), one more; then each rank scrapes itself."""
    import os

    import fastdist
    import torch

    if ctx.rank != 0:
        os.environ.pop("FASTDIST_METRICS_PORT", None)
    os.environ["LOCAL_RANK"] = "0"
    ctx.init()
    port = int(os.environ["FASTDIST_METRICS_PORT"]) if ctx.rank == 0 else fastdist.serve_metrics(0)
    t = torch.ones(4)
    for _ in range(3):
        fastdist.all_reduce(t, timeout=10)
    if ctx.rank == 2:
        time.sleep(2.5)
    try:
        fastdist.all_reduce(t, timeout=1.5)
        ctx.record("no_fault")  # the test fails on it
    except fastdist.FastdistError as exc:
        ctx.record("fault", kind=type(exc).__name__)
    # Recovery numbers the group's ops afresh: the metrics count both generations.
    before = [h for h in fastdist.history() if h["end"] is not None]
    fastdist.recover(timeout=30)
    fastdist.all_reduce(t, timeout=10)
    after = [h for h in fastdist.history() if h["end"] is not None]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    ctx.record(
        "scraped",
        text=text,
        ops=max(int(h["seq"]) for h in before) + max(int(h["seq"]) for h in after),
        all_reduces=sum(1 for h in before + after if h["op"] == "all_reduce"),
    )
    fastdist.barrier(timeout=10)


def _value(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = (
        rf"^{re.escape(name)}(\{{{re.escape(want)}\}})? ([0-9.e+-]+)$"
        if want
        else rf"^{re.escape(name)} ([0-9.e+-]+)$"
    )
    m = re.search(pattern, text, re.MULTILINE)
    assert m, f"{name}{{{want}}} not in:\n{text}"
    return float(m.group(m.lastindex))


@pytest.mark.timeout(120)
def test_metrics_and_events_after_a_fault(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    events = tmp_path / "events-{rank}.jsonl"
    results = run_ranks(
        fault_job,
        3,
        timeout=90,
        env={"FASTDIST_METRICS_PORT": str(port), "FASTDIST_EVENTS": str(events)},
    )
    info = describe(results)
    assert all(r.returncode == 0 for r in results), info
    for r in results:
        scraped = r.record("scraped")
        text = scraped["text"]
        assert _value(text, "fastdist_ops_total", group="default") == scraped["ops"] >= 4, info
        count = _value(text, "fastdist_collective_duration_seconds_count", group="default", op="all_reduce")
        assert count == scraped["all_reduces"] >= 4, info
        assert _value(text, "fastdist_events_total", event="recovery", group="default", op="") == 1.0, info
        assert _value(text, "fastdist_generation", group="default") == 1.0, info
        assert _value(text, "fastdist_world_size", group="default") == 3.0, info
        records = [
            json.loads(line)
            for line in Path(str(events).replace("{rank}", str(r.rank))).read_text().splitlines()
        ]
        kinds = [rec["event"] for rec in records]
        assert kinds[-1] == "recovery" and records[-1]["generation"] == 1 and records[-1]["in_place"], records
        assert (
            records[-1]["rank"] == r.rank and records[-1]["world_size"] == 3 and records[-1]["recovery"] > 0
        ), records
        if r.rank in (0, 1):  # they timed out waiting for rank 2
            assert r.record("fault")["kind"] == "CollectiveTimeoutError", info
            assert (
                _value(text, "fastdist_events_total", event="timeout", group="default", op="all_reduce")
                == 1.0
            )
            assert _value(text, "fastdist_detection_seconds_count") == 1.0, info
            timeout = records[0]
            assert timeout["event"] == "timeout" and timeout["op"] == "all_reduce" and timeout["seq"] == 4, (
                records
            )
            assert timeout["missing_ranks"] == [2] and 1.4 < timeout["detection"] < 3.0, records
        else:
            assert kinds[0] in ("timeout", "abort"), records  # late: the group was dead under it
    # The same records, read by `fastdist report` as one timeline of the job.
    files = [str(events).replace("{rank}", str(r)) for r in range(3)]
    report = subprocess.run(
        [sys.executable, "-m", "fastdist", "report", *files], capture_output=True, text=True, check=False
    )
    assert report.returncode == 0, report.stdout + report.stderr
    text = report.stdout
    assert text.startswith("events: ") and "from ranks 0, 1, 2" in text and "3 recovery" in text, text
    for r in (0, 1):
        assert re.search(
            rf"rank {r} default gen 0: timeout in all_reduce #4: missing ranks \[2\]; detected after \d\.\d+",
            text,
        ), text
    for r in range(3):
        assert re.search(rf"rank {r} default gen 1: recovery: recovered in \d\.\d+ s", text), text
