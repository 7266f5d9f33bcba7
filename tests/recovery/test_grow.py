"""Shrink, then grow back (issue 23, item 6): rank 2 of 3 is SIGKILLed mid-step with no spare;
ranks 0 and 1 shrink (``recover(allow_shrink=True)``) and train on; a process started for it
about 5 steps later joins (``sync_state``), the live ranks' ``fastdist.grow(state)`` admits it,
and the world is 3 again, every rank with the same model, momentum and step. Then rank 1 stalls
in a step: the grown world times out and recovers in place like any other (the newcomer's
listener, generation and groups are the live ranks').

Run as a script, this file is one process of the job: ``python tests/recovery/test_grow.py OUT_DIR`` with
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (FASTDIST_TEST_DIE_AT=STEP: die at that step).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

STEPS = 30
# At a world of 2 the survivors hold at this step (a barrier every 0.1 s) until the newcomer has
# joined: this test's job is too short to leave a starting process time otherwise.
HOLD_AT = 20
# Rank 1 stalls in these steps: at a world of 2 (after the shrink: the others' ring must reach
# its new inbox) and at 3 (after the growth).
STALLS = (12, 25)


def rank_main(out: Path) -> None:
    import fastdist
    import torch
    import torch.distributed as dist
    from fastdist.examples.train_ddp import Progress
    from torch.nn.parallel import DistributedDataParallel as DDP

    launch_rank = int(os.environ["RANK"])
    die_at = int(os.environ.get("FASTDIST_TEST_DIE_AT", "-1"))
    fastdist.init_process_group("gloo", timeout=30)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    progress = Progress()
    state = {"model": model, "opt": opt, "progress": progress}
    joined = fastdist.sync_state(state, timeout=60)
    log = out / f"launch{launch_rank}{'-joiner' if joined else ''}.jsonl"
    grew_at = None
    stalled: set[int] = set()
    recoveries: list[tuple[int, int, str]] = []
    while progress.step < STEPS:
        if fastdist.grow(state, timeout=20):
            grew_at = progress.step
        if dist.get_world_size() == 2 and progress.step >= HOLD_AT:
            time.sleep(0.1)
            with fastdist.fail_after(30):
                dist.barrier()
            continue
        g = torch.Generator().manual_seed(1000 * progress.step + dist.get_rank())
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        try:
            with fastdist.fail_after(5):
                loss = torch.nn.functional.mse_loss(model(x), y)
                if progress.step == die_at:
                    os.kill(os.getpid(), signal.SIGKILL)  # mid-step, before its backward
                if progress.step in STALLS and dist.get_rank() == 1 and progress.step not in stalled:
                    stalled.add(progress.step)
                    time.sleep(7)  # the others' deadline passes
                loss.backward()
            opt.step()
            opt.zero_grad()
            progress.step += 1
            time.sleep(0.05)
        except fastdist.FastdistError as exc:
            opt.zero_grad()
            fastdist.recover(timeout=20, allow_shrink=True)
            recoveries.append((progress.step, dist.get_world_size(), str(exc).splitlines()[0]))
            continue
        with log.open("a") as f:
            f.write(
                json.dumps({"step": progress.step, "world": dist.get_world_size(), "t": time.time()}) + "\n"
            )
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    momentum = torch.cat([opt.state[p]["momentum_buffer"].flatten() for p in model.parameters()])
    result = {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "joined": joined,
        "grew_at": grew_at,
        "params": flat.tolist(),
        "momentum": momentum.tolist(),
        "step": progress.step,
        "recoveries": recoveries,
    }
    (out / f"result-rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()


pytestmark = pytest.mark.timeout(150)


def test_shrink_then_grow_back_to_three() -> None:
    import subprocess
    import tempfile

    from mp import ROOT, free_port, kill_sessions

    out = Path(tempfile.mkdtemp(prefix="fastdist-grow-"))
    port = free_port()
    base = dict(
        os.environ, WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1"
    )
    procs: list[subprocess.Popen[bytes]] = []
    logs = []

    def start(rank: int, **extra: str) -> None:
        log = (out / f"stdout-{len(procs)}.txt").open("wb")
        logs.append(log)
        env = dict(base, RANK=str(rank), **extra)
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, str(out)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=str(ROOT),
                start_new_session=True,
            )
        )

    def last_step(path: Path) -> int:
        if not path.exists():
            return -1
        lines = path.read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else -1

    try:
        for rank in range(3):
            start(rank, **({"FASTDIST_TEST_DIE_AT": "5"} if rank == 2 else {}))
        end = time.monotonic() + 120
        # The replacement starts once the two survivors are 5 steps past the death.
        while last_step(out / "launch0.jsonl") < 10 and time.monotonic() < end:
            assert procs[0].poll() is None, (out / "stdout-0.txt").read_text()[-3000:]
            time.sleep(0.05)
        assert procs[2].poll() == -signal.SIGKILL
        start(2)
        codes = []
        for i in (0, 1, 3):
            try:
                codes.append(procs[i].wait(max(1.0, end - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        info = "\n".join(
            f"--- process {i}\n" + (out / f"stdout-{i}.txt").read_text()[-3000:] for i in range(4)
        )
        assert codes == [0, 0, 0], info
        results = [json.loads((out / f"result-rank{r}.json").read_text()) for r in range(3)]
        # The shrink happened: the survivors trained some steps at a world of 2.
        worlds = [json.loads(line)["world"] for line in (out / "launch0.jsonl").read_text().splitlines()]
        assert 2 in worlds and worlds[-1] == 3, (worlds, info)
        assert all(r["world"] == 3 and r["step"] == 30 for r in results), info
        joiner = results[2]
        assert joiner["joined"] is True and results[0]["joined"] is False, info
        assert results[0]["grew_at"] is not None and results[0]["grew_at"] >= 10, info
        assert results[0]["grew_at"] == results[1]["grew_at"], info
        # Each stall: every rank of that world recovered in place, once. The stalled rank learnt
        # of the others' timeout while it was away, through its listener (in its new inbox after
        # the shrink), not by finding the group closed when it came back.
        for r in results[:2]:
            assert [rec[:2] for rec in r["recoveries"]] == [[5, 2], [12, 2], [25, 3]], info
        assert [rec[:2] for rec in joiner["recoveries"]] == [[25, 3]], info
        for step, world, message in results[1]["recoveries"][1:]:
            assert "timed out in" in message and "while this rank was in no op on it" in message, info
        for r in results[1:]:
            assert r["params"] == results[0]["params"], info
            assert r["momentum"] == results[0]["momentum"], info
    finally:
        kill_sessions(procs)
        for log in logs:
            log.close()


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]))
