"""fastdist under real torchrun (``python -m torch.distributed.run``): the static rendezvous
with --master-addr/--master-port, --standalone, --rdzv-backend c10d, a rank stopped mid-run,
and --max-restarts. Each launch costs a few seconds (the agent and every worker import torch), so
each run checks several things."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from mp import free_port, run_session

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.timeout(150)


def _torchrun(
    tmp_path: Path,
    scenario: str,
    nproc: int,
    launcher: list[str],
    env: dict[str, str] | None = None,
    timeout: float = 100.0,
) -> tuple[int, dict[str, Any], str]:
    """Runs torchrun; returns its exit code, the workers' records by "attempt-rank", and its output."""
    out = tmp_path / scenario
    out.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        *launcher,
        str(HERE / "torchrun_worker.py"),
        scenario,
    ]
    code, text = run_session(
        cmd,
        timeout,
        env={"FASTDIST_TEST_OUT": str(out), **(env or {})},
        unset=("TORCH_NCCL_ASYNC_ERROR_HANDLING",),
    )
    assert code is not None, f"torchrun did not finish within {timeout} s\n{text[-4000:]}"
    records = {p.name[: -len(".json")]: json.loads(p.read_text()) for p in out.glob("*.json")}
    return code, records, text


def test_static_rendezvous_a_stopped_worker_is_named_and_all_recover_in_place(tmp_path: Path) -> None:
    """fastdist.all_reduce on the gradients, then a DDP model (torch issues the collectives): each
    time one worker SIGSTOPs itself for 5 s mid-run."""
    port = free_port()
    code, recs, log = _torchrun(
        tmp_path, "train_sigstop", 3, ["--master-addr=127.0.0.1", f"--master-port={port}", "--max-restarts=0"]
    )
    info = f"{recs}\n{log[-4000:]}"
    assert code == 0, info
    assert sorted(recs) == ["0-0", "0-1", "0-2"], info
    for r in (0, 1):
        err = recs[f"0-{r}"]["errors"][0]
        assert err["kind"] == "CollectiveTimeoutError" and err["missing"] == [2] and err["step"] == 3, info
    # The stopped rank learns on waking that the others gave up, and joins their recovery.
    assert recs["0-2"]["errors"][0]["kind"] == "GroupAbortedError", info
    weights = [recs[f"0-{r}"]["weights"] for r in range(3)]
    assert all(recs[f"0-{r}"]["done"] and recs[f"0-{r}"]["world_size"] == 3 for r in range(3)), info
    assert weights[0] == weights[1] == weights[2], info
    # Then DDP, whose backward issues the collectives: the same story.
    for r in (0, 1):
        err = recs[f"0-{r}"]["ddp_errors"][0]
        assert err["kind"] == "CollectiveTimeoutError" and err["missing"] == [2] and err["step"] == 2, info
    ddp = [recs[f"0-{r}"]["ddp_weights"] for r in range(3)]
    assert ddp[0] == ddp[1] == ddp[2], info


def test_max_restarts_the_next_attempt_never_meets_the_last_ones_keys(tmp_path: Path) -> None:
    port = free_port()
    code, recs, log = _torchrun(
        tmp_path,
        "restart",
        3,
        ["--master-addr=127.0.0.1", f"--master-port={port}", "--max-restarts=1", "--monitor-interval=0.1"],
    )
    info = f"{recs}\n{log[-4000:]}"
    assert code == 0, info
    # Attempt 0 recovered once, then its timeout handler ended rank 0 or 1 with code 3.
    assert (
        "exitcode  : 3" in log
        or "exitcode: 3" in log.replace(" ", "")
        or "exitcode:3" in log.replace(" ", "")
    ), info
    for r in (0, 1):
        assert recs[f"0-{r}"]["recovered"] == [3], info
        assert not recs[f"0-{r}"].get("done"), info
    # Attempt 1: the same timeout and recovery again (generation 1 again), then to the end.
    for r in range(3):
        rec = recs[f"1-{r}"]
        assert rec["done"] and rec["recovered"] == [3], info
    for r in (0, 1):
        assert recs[f"1-{r}"]["errors"] == [{"kind": "CollectiveTimeoutError", "missing": [2]}], info
    assert recs["1-0"]["weights"] == recs["1-1"]["weights"] == recs["1-2"]["weights"], info


@pytest.mark.parametrize("launcher", ["standalone", "c10d"])
def test_standalone_and_c10d_rendezvous(tmp_path: Path, launcher: str) -> None:
    if launcher == "standalone":
        args, env = ["--standalone"], {}
    else:
        port = free_port()
        # A value the user set in the launching environment is theirs: kept, with a warning.
        args, env = (
            ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=fdtest"],
            {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},
        )
    code, recs, log = _torchrun(tmp_path, "smoke", 2, args, env)
    info = f"{recs}\n{log[-4000:]}"
    assert code == 0, info
    for r in range(2):
        rec = recs[f"0-{r}"]
        assert rec["barrier"] is True and rec["sum"] == 3.0, info
        # torchrun hands every worker TORCH_NCCL_ASYNC_ERROR_HANDLING=1 unless the user set it.
        assert rec["nccl_mode_before"] == "1", info
        if launcher == "standalone":
            assert rec["nccl_mode_after"] == "2" and not rec["nccl_warned"], (
                info
            )  # torchrun's default: replaced
        else:
            assert rec["nccl_mode_after"] == "1" and rec["nccl_warned"], (
                info
            )  # the user's: kept, with a warning
        # doctor inside a worker: the agent holds MASTER_PORT, as expected there.
        assert rec["doctor"]["code"] == 0 and rec["doctor"]["checks"].get("port") is True, info
