"""A step is applied on every live rank or on none, whatever moment a peer dies at.

A DDP job under ``fastdist run`` (tests/recovery/desync_job.py: the example script's model, data and loop)
has workers SIGKILLed at precise moments of a step: inside DDP's all-reduce (a rank kills itself
in its comm hook), between the all-reduce and the optimizer step (a rank's step pre-hook kills
another), and at the moment one survivor's all-reduce has completed while the other survivor's
has not (the victim, run in slow motion, stopped before it passed on its last chunk, then killed:
the first survivor applies the step's update, the other's all-reduce fails), once with the first
survivor's next op refused (never numbered) rather than failed; then at random moments. Every
rank's final parameters and SGD momentum must equal an undisturbed run's: ``recover(state=)``
hands the state of the live rank that got least far to every joiner and to every live rank that
got further. ``fastdist.run_step``, which cannot take a survivor back to the batch of a step it
had finished, says so on every rank instead."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fastdist.examples.train_ddp import compare
from mp import free_port, run_session

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.timeout(150)
STEPS = 50
# Inside DDP's all-reduce; split survivors (in gloo's ring the first rank receives from the
# third, the third from the victim); between the all-reduce and the update; a split whose first
# survivor's next op is refused. Each kill waits for the one before it.
PLAN = "hook:2:1:0,split:4:0:2,prestep:10:2:1,splitwait:12:1:0"
RANDOM_KILLS = 2


def _launch(out: Path, plan: str = "", replacements: int = 0, *flags: str) -> tuple[int, str]:
    out.mkdir()
    cmd = [sys.executable, "-m", "fastdist.run", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(free_port()), "--nproc-per-node", "3"]
    cmd += ["--max-replacements", str(replacements), str(HERE / "desync_job.py")]
    cmd += ["--steps", str(STEPS), "--step-sleep", "0.01", "--out", str(out)]
    cmd += ["--events", str(out / "events"), "--plan", plan, *flags]
    code, log = run_session(cmd, 100)
    assert code is not None, f"the job ran past 100 s\n{log[-6000:]}"
    return code, log


def _events(out: Path) -> list[dict[str, Any]]:
    path = out / "events"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


class RandomKills(threading.Thread):
    """Once every planned kill is done and its victim's replacement has joined, SIGKILLs a random
    rank at a random moment of the training (0 to 20 ms after a step), ``count`` times, each once
    the previous victim's replacement joined; never in the last steps (a rank that finished
    cannot be recovered with)."""

    def __init__(self, out: Path, planned: int, count: int, seed: int) -> None:
        super().__init__(daemon=True)
        self.out, self.planned, self.count = out, planned, count
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.done: list[str] = []

    def _wait(self, ready: Any) -> bool:
        while not self.stop.is_set():
            if ready(_events(self.out)):
                return True
            time.sleep(0.005)
        return False

    def run(self) -> None:
        for i in range(self.count):
            joined = self.planned + i

            def resumed(evs: list[dict[str, Any]], joined: int = joined) -> bool:
                joins = [e for e in evs if e["event"] == "joined"]
                if len(joins) < joined:
                    return False
                after = joins[-1]["time"] if joins else 0.0
                return any(e["event"] == "step" and e["time"] > after for e in evs)

            if not self._wait(resumed):
                return
            time.sleep(self.rng.uniform(0.0, 0.02))
            step = max(e["step"] for e in _events(self.out) if e["event"] == "step")
            if step > STEPS - 8:
                return
            victim = self.rng.randrange(3)
            pid = int((self.out / f"pid{victim}").read_text())
            os.kill(pid, signal.SIGKILL)
            self.done.append(f"rank {victim} (pid {pid}) near step {step}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("desync") / "reference"
    rc, log = _launch(out)
    assert rc == 0, log
    assert log.count(f"done at step {STEPS}") == 3, log
    return out


def test_kills_at_any_moment_leave_every_rank_equal_to_an_undisturbed_run(
    reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "killed"
    seed = random.randrange(1 << 30)
    planned = len(PLAN.split(","))
    killer = RandomKills(out, planned, RANDOM_KILLS, seed)
    killer.start()
    try:
        rc, log = _launch(out, PLAN, replacements=planned + RANDOM_KILLS + 2)
    finally:
        killer.stop.set()
        killer.join(5)
    events = _events(out)
    kills = [e for e in events if e["event"] == "kill"]
    misses = sum(e["event"] == "missed" for e in events)
    story = f"kills {kills} ({misses} split tries missed); random kills (seed {seed}): {killer.done}"
    story += f"\n{log[-12000:]}"
    assert rc == 0, story
    assert [e["kind"] for e in kills] == [spec.split(":")[0] for spec in PLAN.split(",")], story
    deaths = [ln for ln in log.splitlines() if ln.startswith("[fastdist run]") and "exit by SIGKILL" in ln]
    assert len(deaths) == planned + len(killer.done), story
    # The split kills did split the survivors (one applied the step's update, the other's
    # all-reduce failed): else this test would show nothing.
    assert any(e.get("split") for e in kills), story
    assert log.count(f"done at step {STEPS}") == 3, story
    worst = compare(str(reference), str(out), 3)
    assert worst <= 1e-6, f"max difference from the undisturbed run: {worst}\n{story}"
    # The survivor that had applied the update loaded the other's state (fastdist's INFO log).
    assert "when the group failed (it may have applied an update that rank" in log, story
    print(f"{len(deaths)} kills, max difference {worst}: {story[: story.index(chr(10))]}")


def test_run_step_refuses_to_redo_a_step_that_split_the_survivors(reference: Path, tmp_path: Path) -> None:
    """fastdist.run_step redoes the failed step in place, which a survivor that had applied it
    (and gone on to the next step's batch) cannot: every live rank raises RuntimeError saying so
    (the job then ends, as after the script's own error). Unsplit, the step is redone."""
    out = tmp_path / "run_step"
    rc, log = _launch(out, "split:2:0:2", 2, "--run-step")
    kills = [e for e in _events(out) if e["event"] == "kill"]
    assert len(kills) == 1, log
    if not kills[0]["split"]:  # (tried TRIES steps, and killed the victim anyway)
        assert rc == 0, log
        assert compare(str(reference), str(out), 3) <= 1e-6
        return
    assert rc != 0, log
    refused = {e["rank"]: e["error"] for e in _events(out) if e["event"] == "refused"}
    assert sorted(refused)[:2] == [0, 1], (refused, log)  # both survivors (the joiner may too)
    for r in (0, 1):
        assert refused[r].startswith("fastdist: the live ranks were split when the step failed"), refused
        assert "rank 0 had applied an optimizer update that rank 1 had not" in refused[r], refused
    print(f"run_step refused on ranks {sorted(refused)}: {refused[0]}")
