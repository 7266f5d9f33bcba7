"""fastdist.PeerSnapshot on FSDP2, 3 CPU ranks (bench/snapshot_peer.py): the step time with a
snapshot every 10 steps against none (goal <= 1.03), a snapshot's exchange against raw gloo sends
of the same bytes, and rolling back to the snapshot against loading a DCP checkpoint from local
disk (the state part of a restart only). And death to training again (bench/snapshot_recovery.py
under ``fastdist run``): rank 1 SIGKILLed at step 15 with a waiting spare and snapshots every 10
steps, against a restart of the job that loads a DCP checkpoint of step 10 from local disk (goal:
>= 10x faster)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from conftest import SMOKE

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
from mp import free_port, run_processes, run_session

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(900)
def test_snapshot_costs(benchmark, tmp_path: Path) -> None:
    world, megabytes, rounds, every = (3, 2, 1, 2) if SMOKE else (3, 24, 5, 10)
    out = tmp_path / "snapshot.json"
    port = free_port()
    args = [str(port), str(world), str(megabytes), str(rounds), str(every), str(out)]
    cmds = [[sys.executable, str(ROOT / "bench" / "snapshot_peer.py"), str(r), *args] for r in range(world)]
    assert run_processes(cmds, timeout=850) == [0] * world
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


@pytest.mark.timeout(600)
def test_death_to_training_again_against_a_restart_from_disk(benchmark, tmp_path: Path) -> None:
    """From rank 1's death (its own timestamp) to rank 0's first step after the roll-back, against
    a restart: from launching the job again (3 processes) to its first step after loading the
    checkpoint. The restart's side leaves out noticing the death and stopping the old processes
    (torchrun's agent: seconds), so the ratio is a floor."""
    megabytes = 2 if SMOKE else 24
    out = tmp_path / "job"
    out.mkdir()
    launcher = [sys.executable, "-m", "fastdist.run", "--master-addr", "127.0.0.1", "--master-port"]
    script = [str(ROOT / "bench" / "snapshot_recovery.py"), str(out), str(megabytes)]
    code, log = run_session(
        [*launcher, str(free_port()), "--nproc-per-node", "4", "--spares", "1", *script, "17"]
        + ["--kill-step", "15", "--save-at", "10"],
        300,
        env={"LOGLEVEL": "ERROR"},
    )
    assert code == 0, log[-4000:]
    snapshot_s = float((out / "trained").read_text()) - float((out / "death").read_text())
    (out / "trained").unlink()
    started = time.time()
    code, log = run_session(
        [*launcher, str(free_port()), "--nproc-per-node", "3", *script, "11", "--resume"],
        300,
        env={"LOGLEVEL": "ERROR"},
    )
    assert code == 0, log[-4000:]
    restart_s = float((out / "trained").read_text()) - started
    print(
        f"\nFSDP2, 3 ranks, {megabytes} MB of parameters (and as much momentum): death to training again "
        f"{snapshot_s:.2f} s with a spare and a peer snapshot, against {restart_s:.2f} s for a restart "
        f"that loads a DCP checkpoint from local disk: {restart_s / snapshot_s:.1f}x faster"
    )
    benchmark.extra_info.update({"snapshot_s": snapshot_s, "restart_s": restart_s})
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
