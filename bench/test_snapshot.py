"""fastdist.PeerSnapshot on FSDP2, 3 CPU ranks (bench/snapshot_peer.py): the step time with a
snapshot every 10 steps against none (goal <= 1.03), a snapshot's exchange against raw gloo sends
of the same bytes, and rolling back to the snapshot against loading a DCP checkpoint from local
disk (the state part of a restart only: a restart also starts every process and imports torch)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SMOKE

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(900)
def test_snapshot_costs(benchmark, tmp_path: Path) -> None:
    world, megabytes, rounds, every = (3, 2, 1, 2) if SMOKE else (3, 24, 5, 10)
    out = tmp_path / "snapshot.json"
    port = _free_port()
    args = [str(port), str(world), str(megabytes), str(rounds), str(every), str(out)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "snapshot_peer.py"), str(r), *args],
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,
        )
        for r in range(world)
    ]
    try:
        for p in procs:
            assert p.wait(timeout=850) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    res = json.loads(out.read_text())
    step_ratio = res["block_snapshot_ms"] / res["block_plain_ms"]
    inline_ratio = res["block_inline_ms"] / res["block_plain_ms"]
    send_ratio = res["exchange_ms"] / res["raw_send_ms"]
    restore = res["dcp_load_ms"] / res["rollback_ms"]
    print(
        f"\nFSDP2, {world} ranks, {res['state_mb_per_rank']:.1f} MB of state per rank, a snapshot every "
        f"{every} steps: {res['block_plain_ms']:.0f} ms per {every} steps without, "
        f"{res['block_snapshot_ms']:.0f} ms with: ratio {step_ratio:.3f} (the exchange on the training "
        f"thread instead: {res['block_inline_ms']:.0f} ms, ratio {inline_ratio:.3f})\n"
        f"  exchange {res['exchange_ms']:.1f} ms against raw gloo sends {res['raw_send_ms']:.1f} ms: "
        f"ratio {send_ratio:.2f}\n"
        f"  roll back to the snapshot {res['rollback_ms']:.1f} ms against dcp.load from local disk "
        f"{res['dcp_load_ms']:.1f} ms: {restore:.1f}x faster"
    )
    benchmark.extra_info.update(
        {
            **res,
            "step_ratio": step_ratio,
            "inline_ratio": inline_ratio,
            "send_ratio": send_ratio,
            "restore_x": restore,
        }
    )
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
