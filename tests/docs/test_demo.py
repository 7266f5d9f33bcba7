"""The README's first command: `make demo` runs `python -m fastdist demo`, a DDP job on 3 gloo
ranks in which one rank stalls; the others must name it, everyone recovers and trains on."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.timeout(150)
def test_demo_names_the_stalled_rank_and_everyone_trains_on() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fastdist", "demo", "--nproc", "3", "--timeout", "2", "--rounds", "2"],
        capture_output=True,
        text=True,
        timeout=140,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    # Each rank's output arrives whole, in rank order, with the library's log lines marked.
    blocks = re.split(r"^---- rank (\d) \(exit (\d+)\) ----$", proc.stdout, flags=re.MULTILINE)
    assert [b for b in blocks[1::3]] == ["0", "1", "2"] and set(blocks[2::3]) == {"0"}, out
    for rank, text in zip(range(3), blocks[3::3]):
        assert "\ndone: 4 steps, parameter checksum" in text, text
        assert "recover(): the group is rebuilt" in text, text
        if rank < 2:
            assert "rank 2 never arrived" in text, text
            assert f"(fastdist log) rank {rank}: group 'default' is aborted" in text, text
    assert "Warning" not in out, out  # nothing of Python's last-resort printing
    rows = re.findall(
        r"^\s+(\d)\s+(\w+)\s+(\S+)\s+(\S+(?: s)?)\s+(yes|NO)\s+(-?\d+\.\d+)$", proc.stdout, flags=re.MULTILINE
    )
    assert len(rows) == 3 and {r[5] for r in rows} == {rows[0][5]}, out  # identical parameters
    for rank, err, named, after, recovered, _ in rows:
        assert recovered == "yes", out
        if rank != "2":
            assert err == "CollectiveTimeoutError" and named == "2", out
            # From the rank's own step start: a rank that began its step a few ms after the first
            # to time out is rung by it, and raises with it, that much before its own 2 s.
            assert 1.9 <= float(after.split()[0]) < 3.5, out
