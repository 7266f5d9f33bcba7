"""Issue 28: metrics a monitoring system scrapes, and events a log shipper collects, from a 3-rank
job after a fault. The rank code is beside its assertions (tests/support/rank_main.py runs
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


# ---------------------------------------------------------------------------------------------
# Issue 40: metrics never block or stop training.


def _scrape(port: int, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as resp:
        return str(resp.read().decode())


@pytest.mark.timeout(30)
def test_an_idle_or_half_sent_connection_holds_up_no_scrape(monkeypatch: pytest.MonkeyPatch) -> None:
    """One connection that sends nothing and one that stops halfway through its request: the
    scrapes beside them are answered (one thread answered connections in turn, and waited on the
    first for ever), and the server closes each stalled connection after CONNECTION_SECONDS."""
    import fastdist
    from fastdist import metrics

    monkeypatch.setattr(metrics, "CONNECTION_SECONDS", 1.0)
    port = fastdist.serve_metrics(0, "127.0.0.1")
    idle = socket.create_connection(("127.0.0.1", port), timeout=10)
    half = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        half.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # no blank line: never complete
        time.sleep(0.2)  # both stalled connections are accepted before the scrapes
        for _ in range(3):
            assert "# HELP fastdist_ops_total" in _scrape(port, timeout=5)
        # Closed by the server after ~1 s: the read ends (b"") instead of timing out (10 s: a
        # bound for a loaded machine, not a measurement).
        for sock in (idle, half):
            assert sock.recv(4096) == b"", "the server answered a request that never came"
    finally:
        idle.close()
        half.close()


@pytest.mark.timeout(60)
def test_a_busy_metrics_port_is_named_and_training_goes_on(tmp_path: Path) -> None:
    """FASTDIST_METRICS_PORT taken by another process: init_process_group warns, naming the port,
    and the rank trains (the bind's OSError killed it); serve_metrics() on that port raises
    MetricsPortError (an OSError, errno EADDRINUSE) naming it."""
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = (
            "import errno, pickle, sys, torch, torch.distributed as dist, fastdist\n"
            "fastdist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
            "t = torch.ones(2)\n"
            "fastdist.all_reduce(t, timeout=10)\n"
            "print('trained', t.tolist(), flush=True)\n"
            "try:\n"
            "    fastdist.serve_metrics(int(sys.argv[1]))\n"
            "except fastdist.MetricsPortError as exc:\n"
            "    assert isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE, repr(exc)\n"
            "    assert str(pickle.loads(pickle.dumps(exc))) == str(exc)\n"
            "    print('refused:', exc, flush=True)\n"
        )
        env = {**__import__("os").environ, "FASTDIST_METRICS_PORT": str(port), "LOCAL_RANK": "0"}
        out = subprocess.run(
            [sys.executable, "-c", code, str(port)],
            env=env,
            capture_output=True,
            text=True,
            timeout=50,
            check=False,
        )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trained [1.0, 1.0]" in out.stdout, out.stdout + out.stderr[-3000:]
    assert f"fastdist metrics cannot listen on 0.0.0.0:{port}" in out.stderr, out.stderr[-3000:]
    assert "training goes on without metrics" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert f"refused: fastdist metrics cannot listen on 0.0.0.0:{port}: " in out.stdout, out.stdout
    assert f"port {port} is taken" in out.stdout, out.stdout


@pytest.mark.timeout(60)
def test_report_skips_damaged_event_and_dump_files_with_one_line_each(tmp_path: Path) -> None:
    """Issue 40: `fastdist report` printed a traceback on a binary events file, an event whose
    time is not a number, or a dump missing its history. Each damaged file is now one line on
    stderr, and the good records are still reported."""
    good = {"event": "timeout", "time": 1700000000.5, "rank": 0, "group": "default", "generation": 0}
    events = tmp_path / "events-0.jsonl"
    events.write_text(
        json.dumps(good) + "\n" + json.dumps({**good, "time": "soon"}) + "\n" + '{"event": "recov\n'
    )
    (tmp_path / "events-1.jsonl").write_bytes(b"\xff\xfe\x00 not text")
    dump = {"group": "default", "generation": 0, "rank": 1, "error": "x", "world_size": 2}
    (tmp_path / "fastdist-default-gen0-rank1.json").write_text(json.dumps(dump))  # no history
    (tmp_path / "fastdist-default-gen0-rank2.json").write_text('{"group": "default", "gen')  # cut short
    history = [{"seq": 1, "op": "all_reduce", "outcome": "ok", "start": 1.0, "end": 2.0}]
    (tmp_path / "fastdist-default-gen0-rank0.json").write_text(
        json.dumps({**dump, "rank": 0, "history": history})
    )
    out = subprocess.run(
        [sys.executable, "-m", "fastdist", "report", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    skipped = out.stderr.strip().splitlines()
    assert len(skipped) == 4, skipped
    assert (
        f"skipping {tmp_path}/fastdist-default-gen0-rank1.json: not a fastdist dump (history is missing"
        in (out.stderr)
    )
    assert (
        f"skipping {tmp_path}/fastdist-default-gen0-rank2.json: not a fastdist dump (not JSON" in out.stderr
    )
    assert f"skipping {tmp_path}/events-1.jsonl: not text (damaged?)" in out.stderr
    assert f"skipping 2 lines (the first: line 2) of {events}: not a fastdist event" in out.stderr
    assert "group 'default', generation 0: dumps from ranks 0" in out.stdout, out.stdout
    assert "events: 1 from ranks 0 (1 timeout)" in out.stdout, out.stdout
