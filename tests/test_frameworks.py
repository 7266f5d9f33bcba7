"""fastdist.lightning.DDPStrategy in real Lightning jobs (tests/lightning_job.py): 3 ranks on CPU,
launched by Lightning's own launcher and by torchrun; rank 2 stalls 3.5 s at step 3 against a 2 s
step deadline. Every rank must finish step 20 having redone the step once, with parameters,
momentum, LR scheduler, Lightning's progress counters and logged metrics equal to an undisturbed
fit in the same processes (with ``accumulate_grad_batches`` 1 and 2, validation with
``sync_dist`` every 5 steps, dropout)."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(cmd: list[str], tmp_path: Path, timeout: float) -> str:
    """Runs ``cmd`` in a session of its own; every process of it is killed at the end."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    log = tmp_path / "job.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(HERE.parent), start_new_session=True
        )
        try:
            code: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher's workers share its session
            except ProcessLookupError:
                pass
            proc.wait()
    text = log.read_text(errors="replace")
    assert code == 0, f"exit {code}\n{text[-5000:]}"
    return text


def _largest_difference(a: Any, b: Any) -> float:
    pairs = list(zip(a["params"].values(), b["params"].values())) + list(zip(a["momentum"], b["momentum"]))
    assert len(pairs) == len(a["params"]) + len(a["momentum"]) > 0
    return max((x - y).abs().max().item() for x, y in pairs)


def _check(out: Path, accums: list[int], text: str) -> None:
    assert "rank 2 never arrived" in text, text[-4000:]  # the stall was real and named
    for accum in accums:
        ref = torch.load(out / f"rank0-accum{accum}-undisturbed.pt", weights_only=False)
        for rank in range(3):
            clean = torch.load(out / f"rank{rank}-accum{accum}-undisturbed.pt", weights_only=False)
            got = torch.load(out / f"rank{rank}-accum{accum}-stalled.pt", weights_only=False)
            where = f"rank {rank}, accumulate_grad_batches={accum}"
            assert clean["retries"] == 0 and got["retries"] == 1, where
            assert got["world"] == 3 and got["global_step"] == clean["global_step"] == 20, where
            assert _largest_difference(ref, clean) <= 1e-6, where  # the ranks agree
            assert _largest_difference(ref, got) <= 1e-6, where  # and the stall changed nothing
            assert got["lr"] == clean["lr"] and got["scheduler"] == clean["scheduler"], where
            assert got["fit_loop"] == clean["fit_loop"], where  # Lightning counted every step once
            assert got["metrics"].keys() == clean["metrics"].keys() >= {"train_loss_epoch", "val_loss"}, where
            for key, value in clean["metrics"].items():
                assert abs(got["metrics"][key] - value) <= 1e-6, (where, key)  # no step logged twice


@pytest.mark.timeout(120)
def test_trainer_under_lightnings_launcher_redoes_the_stalled_step_exactly_once(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    text = _launch([sys.executable, str(HERE / "lightning_job.py"), "--out", str(out)], tmp_path, 100)
    _check(out, [1, 2], text)


@pytest.mark.timeout(120)
def test_trainer_under_torchrun_with_accumulation(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=3",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        str(HERE / "lightning_job.py"),
        "--out",
        str(out),
        "--accum",
        "2",
    ]
    _check(out, [2], _launch(cmd, tmp_path, 100))


@pytest.mark.timeout(60)
def test_strategy_arguments_and_both_lightning_packages() -> None:
    import fastdist.lightning as fl

    for kwargs, kind, name in [
        ({"step_timeout": "3"}, TypeError, "step_timeout"),
        ({"step_timeout": -1}, ValueError, "step_timeout"),
        ({"collective_timeout": 0}, ValueError, "collective_timeout"),
        ({"recover_timeout": None}, TypeError, "recover_timeout"),
        ({"max_retries": 1.5}, TypeError, "max_retries"),
        ({"max_retries": -1}, ValueError, "max_retries"),
    ]:
        with pytest.raises(kind, match=name):
            fl.DDPStrategy(**kwargs)
    with pytest.raises(ValueError, match="package"):
        fl.ddp_strategy_class("lightning.fabric")
    strategy = fl.DDPStrategy(step_timeout=datetime.timedelta(seconds=5), max_retries=0)
    assert strategy._fastdist_step_timeout == 5.0 and strategy.retries == 0

    import lightning.pytorch
    import pytorch_lightning

    assert isinstance(strategy, lightning.pytorch.strategies.DDPStrategy)
    assert issubclass(fl.ddp_strategy_class("pytorch_lightning"), pytorch_lightning.strategies.DDPStrategy)
    assert not issubclass(
        fl.ddp_strategy_class("pytorch_lightning"), lightning.pytorch.strategies.DDPStrategy
    )
