"""Frameworks on watched groups, in real jobs of 3 ranks on CPU where rank 2 stalls 3.5 s at step 3
against a 2 s step deadline: every rank must finish step 20 having redone the step once, with
parameters and momentum equal (within 1e-6) to an undisturbed run in the same processes.

- fastdist.lightning.DDPStrategy (tests/frameworks/lightning_job.py), launched by Lightning's own launcher
  and by torchrun: also the LR scheduler, Lightning's progress counters and the logged metrics,
  with ``accumulate_grad_batches`` 1 and 2, validation with ``sync_dist`` every 5 steps, dropout.
- fastdist.lightning.FabricDDPStrategy with a Fabric loop in fastdist.run_step
  (tests/frameworks/fabric_job.py), Fabric's own launcher, accumulation with ``no_backward_sync``.
- fastdist.accelerate (tests/frameworks/accelerate_job.py) under torchrun: ``accumulate()`` with 2
  micro-batches, ``InitProcessGroupKwargs(timeout=)`` reaching the group, ``gather`` after the
  step.
- fastdist.run_step, in process: its arguments, and a step that failed after its optimizer's
  update is not redone.
- A default group made by torch.distributed.init_process_group: the first deadline scope warns
  once, naming the fix."""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import fastdist
import pytest
import torch
from fastdist.steps import StepStart
from mp import describe, free_port, run_ranks, run_session

HERE = Path(__file__).resolve().parent


def _launch(cmd: list[str], timeout: float) -> str:
    """Runs ``cmd`` in a session of its own (tests/support/mp.py); it must succeed. Its output."""
    code, text = run_session(cmd, timeout, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    assert code == 0, f"exit {code}\n{text[-5000:]}"
    return text


def _torchrun(script: str, out: Path, *args: str) -> list[str]:
    """torchrun with 3 processes on a free port, running tests/SCRIPT --out OUT ARGS."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=3",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(HERE / script),
        "--out",
        str(out),
        *args,
    ]


def _fastdist_run(script: str, out: Path, *args: str) -> list[str]:
    """fastdist run with 3 workers on a free port, running tests/SCRIPT --out OUT ARGS."""
    cmd = [sys.executable, "-m", "fastdist.run", "--master-addr", "127.0.0.1", "--master-port"]
    return [*cmd, str(free_port()), "--nproc-per-node", "3", str(HERE / script), "--out", str(out), *args]


def _replacements(text: str) -> list[str]:
    """fastdist run's lines saying it started a replacement (not the summary's copies)."""
    return [ln for ln in text.splitlines() if ln.startswith("[fastdist run]") and "replacement started" in ln]


def _largest_difference(a: Any, b: Any) -> float:
    pairs = list(zip(a["params"].values(), b["params"].values())) + list(zip(a["momentum"], b["momentum"]))
    assert len(pairs) == len(a["params"]) + len(a["momentum"]) > 0
    return max((x - y).abs().max().item() for x, y in pairs)


def _check(out: Path, accums: list[int], text: str) -> None:
    assert "rank 2 never arrived" in text, text[-4000:]  # the stall was real and named
    assert "cannot bound the ops" not in text  # the group is watched: no warning
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
    text = _launch([sys.executable, str(HERE / "lightning_job.py"), "--out", str(out)], 100)
    _check(out, [1, 2], text)


@pytest.mark.timeout(120)
def test_trainer_under_torchrun_with_accumulation(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    cmd = _torchrun("lightning_job.py", out, "--accum", "2")
    _check(out, [2], _launch(cmd, 100))


@pytest.mark.timeout(150)
def test_trainer_fsdp2_under_torchrun_redoes_a_step_and_a_micro_batch(tmp_path: Path) -> None:
    """fastdist.lightning.ModelParallelStrategy, the model sharded with FSDP2 in configure_model:
    without accumulation the stall times out in the optimizer step; with accumulate_grad_batches=2
    in the window's first micro-batch, outside the optimizer step, where FSDP2 all-gathers: that
    micro-batch alone is redone."""
    out = tmp_path / "out"
    out.mkdir()
    cmd = _torchrun("lightning_job.py", out, "--accum", "1", "2", "--fsdp2")
    _check(out, [1, 2], _launch(cmd, 130))


@pytest.mark.timeout(150)
def test_trainer_under_fastdist_run_replaces_a_killed_worker(tmp_path: Path) -> None:
    """Rank 2 SIGKILLs itself at global step 7 (second epoch, shuffled data), once with
    accumulate_grad_batches=1 (in the optimizer step) and once with 2 (in the window's first
    micro-batch, before the step): fastdist run starts a replacement, which joins the live ranks'
    recovery, is handed the module, optimizer, scheduler and loop position, and runs the window's
    earlier micro-batch itself. Ranks 0 and 1 are never restarted; every rank ends equal to an
    undisturbed run in the same job, Lightning's counters included."""
    out = tmp_path / "out"
    out.mkdir()
    text = _launch(_fastdist_run("lightning_job.py", out, "--accum", "1", "2", "--kill"), 130)
    started = _replacements(text)
    assert len(started) == 2 and all("rank 2:" in ln for ln in started), text[-4000:]
    for accum in (1, 2):
        ref = torch.load(out / f"rank0-accum{accum}-undisturbed.pt", weights_only=False)
        for rank in range(3):
            clean = torch.load(out / f"rank{rank}-accum{accum}-undisturbed.pt", weights_only=False)
            got = torch.load(out / f"rank{rank}-accum{accum}-killed.pt", weights_only=False)
            where = f"rank {rank}, accumulate_grad_batches={accum}"
            if rank == 2:  # the replacement, which joined at the step it died in
                assert got["pid"] != clean["pid"] and got["joined_at"] == 7 and got["retries"] == 0, where
            else:  # never restarted: one process from the first fit to the last
                assert got["pid"] == clean["pid"] and got["joined_at"] is None and got["retries"] == 1, where
            assert got["world"] == 3 and got["global_step"] == clean["global_step"] == 20, where
            assert _largest_difference(ref, clean) <= 1e-6, where
            assert _largest_difference(ref, got) <= 1e-6, where
            assert got["lr"] == clean["lr"] and got["scheduler"] == clean["scheduler"], where
            assert got["fit_loop"] == clean["fit_loop"], where  # the joiner counts from where it joined
            # The last epoch's means: every rank, the replacement too, ran all of that epoch.
            assert got["metrics"].keys() == clean["metrics"].keys() >= {"train_loss_epoch", "val_loss"}, where
            for key, value in clean["metrics"].items():
                assert abs(got["metrics"][key] - value) <= 1e-6, (where, key)


@pytest.mark.timeout(150)
def test_trainer_fsdp2_with_snapshot_copies_replaces_a_worker_killed_in_the_snapshot_exchange(
    tmp_path: Path,
) -> None:
    """ModelParallelStrategy(snapshot_copies=1), the model sharded with FSDP2: rank 2 SIGKILLs
    itself at global step 7 (second epoch, shuffled) inside the exchange of that step's snapshot
    (its copy sent, at the closing barrier: the live ranks' exchange fails; it escaped the step as
    GroupAbortedError before). The recovery uses the step's snapshot, whose copies are all on live
    ranks, the replacement gets its predecessor's shards from it, every rank redoes step 7; then
    rank 1 dies in step 12's exchange before its copy left (RecoveryError ended the job before):
    every rank rolls back to step 11's start, the live ranks redo step 11 with the replacement
    (which catches up there, its strategy collectives local) and load their own state back, and
    the job ends equal to an undisturbed run (a launch of its own: each fit makes groups of its
    own, see tests/frameworks/lightning_job.py --only). A death inside the step is the Fabric test's below.
    Without the copies the replacement is refused at set-up
    (test_an_fsdp2_replacement_is_refused_at_set_up)."""
    out = tmp_path / "out"
    out.mkdir()
    flags = (
        "--accum",
        "1",
        "--fsdp2",
        "--kill",
        "--in-snapshot",
        "--only",
    )  # (--kill: its data in both fits)
    _launch(_fastdist_run("lightning_job.py", out, *flags, "undisturbed"), 120)
    text = _launch(_fastdist_run("lightning_job.py", out, *flags, "disturbed"), 120)
    started = _replacements(text)
    assert len(started) == 2 and "rank 2:" in started[0] and "rank 1:" in started[1], text[-4000:]
    assert "redid step 11 with the replacement" in text, text[-4000:]  # the roll-back was real
    ref = torch.load(out / "rank0-accum1-undisturbed.pt", weights_only=False)
    for rank in range(3):
        clean = torch.load(out / f"rank{rank}-accum1-undisturbed.pt", weights_only=False)
        got = torch.load(out / f"rank{rank}-accum1-killed.pt", weights_only=False)
        # Rank 2's replacement joined at step 7 and lived through the roll-back; rank 1's joined
        # at step 11 (the roll-back's); rank 0 recovered twice.
        joined, retries = {0: (None, 2), 1: (11, 0), 2: (7, 1)}[rank]
        assert (got["joined_at"], got["retries"]) == (joined, retries), (rank, got["joined_at"])
        assert got["world"] == 3 and got["global_step"] == clean["global_step"] == 20, rank
        assert _largest_difference(ref, clean) <= 1e-6 and _largest_difference(ref, got) <= 1e-6, rank
        assert got["lr"] == clean["lr"] and got["scheduler"] == clean["scheduler"], rank
        assert got["fit_loop"] == clean["fit_loop"], rank


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
    import lightning.fabric
    import lightning_fabric

    fabric_strategy = fl.FabricDDPStrategy(collective_timeout=9)
    assert isinstance(fabric_strategy, lightning.fabric.strategies.DDPStrategy)
    assert fabric_strategy._fastdist_collective_timeout == 9.0
    assert issubclass(
        fl.fabric_ddp_strategy_class("lightning_fabric"), lightning_fabric.strategies.DDPStrategy
    )
    with pytest.raises(ValueError, match="collective_timeout"):
        fl.FabricDDPStrategy(collective_timeout=-3)
    with pytest.raises(ValueError, match="package"):
        fl.fabric_ddp_strategy_class("lightning.pytorch")
    fabric_fsdp2 = fl.FabricModelParallelStrategy(parallelize_fn=lambda m, _: m, collective_timeout=4)
    assert isinstance(fabric_fsdp2, lightning.fabric.strategies.ModelParallelStrategy)
    assert fabric_fsdp2._fastdist_collective_timeout == 4.0 and fabric_fsdp2._fastdist_reset_seed
    assert issubclass(
        fl.fabric_model_parallel_strategy_class("lightning_fabric"),
        lightning_fabric.strategies.ModelParallelStrategy,
    )
    with pytest.raises(ValueError, match="package"):
        fl.fabric_model_parallel_strategy_class("pytorch_lightning")
    fsdp2 = fl.ModelParallelStrategy(data_parallel_size=3, tensor_parallel_size=1, step_timeout=7)
    assert isinstance(fsdp2, lightning.pytorch.strategies.ModelParallelStrategy)
    assert fsdp2._fastdist_step_timeout == 7.0 and fsdp2._fastdist_micro_batches
    assert not strategy._fastdist_micro_batches  # DDP's accumulating micro-batches issue no collective
    assert issubclass(
        fl.model_parallel_strategy_class("pytorch_lightning"),
        pytorch_lightning.strategies.ModelParallelStrategy,
    )
    with pytest.raises(ValueError, match="step_timeout"):
        fl.ModelParallelStrategy(step_timeout=0)
    with pytest.raises(TypeError, match="snapshot_copies must be an int"):
        fl.ModelParallelStrategy(snapshot_copies="1")
    with pytest.raises(ValueError, match="snapshot_copies must be >= 0"):
        fl.ModelParallelStrategy(snapshot_copies=-1)
    with pytest.raises(ValueError, match="snapshot_copies is for ModelParallelStrategy"):
        fl.DDPStrategy(snapshot_copies=1)


@pytest.mark.timeout(60)
def test_spares_are_refused_before_lightning_splits_the_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under fastdist run --spares, WORLD_SIZE counts the spares; Lightning would shard the data
    for ranks that do not train. Every strategy refuses it when it is made, before the group."""
    import fastdist.lightning as fl

    strategies = (fl.DDPStrategy(), fl.FabricDDPStrategy())
    monkeypatch.setenv("FASTDIST_SPARES", "1")
    before = torch.distributed.is_initialized()
    refused = r"FASTDIST_SPARES=1 \(fastdist run --spares\) is not supported"
    for make in (fl.DDPStrategy, fl.FabricDDPStrategy, fl.ModelParallelStrategy):
        with pytest.raises(ValueError, match=refused):
            make()
    for strategy in strategies:  # made before the variable was set: set-up refuses it still
        with pytest.raises(ValueError, match=refused):
            fl._init_watched_group(strategy)
    assert torch.distributed.is_initialized() == before  # no group made by the refusal


@pytest.mark.timeout(120)
def test_spares_under_fastdist_run_end_the_job_once_without_replacements(tmp_path: Path) -> None:
    """The same refusal in a real job (fastdist run --nproc-per-node 4 --spares 1): every worker
    raises it when it makes the strategy; fastdist run takes that for the script's own error and
    ends the job non-zero, the refusal shown once, no worker replaced."""
    out = tmp_path / "out"
    out.mkdir()
    cmd = _fastdist_run("lightning_job.py", out, "--kill")
    cmd[cmd.index("--nproc-per-node") + 1 : cmd.index("--nproc-per-node") + 2] = ["4", "--spares", "1"]
    code, text = run_session(cmd, 100)
    assert code is not None and code != 0, text[-5000:]
    assert not _replacements(text), text[-5000:]
    assert text.count("FASTDIST_SPARES=1 (fastdist run --spares) is not supported") == 1, text[-5000:]
    assert "the script's own error, not a dead worker: no replacement" in text, text[-5000:]


@pytest.mark.timeout(60)
def test_a_lone_accelerate_cpu_launch_is_refused_naming_fastdist_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """``accelerate launch --cpu --num_processes 3`` starts one process with MASTER_ADDR and
    ACCELERATE_USE_CPU but no RANK or WORLD_SIZE (accelerate's simple launcher): refused in one
    line naming the launcher to use, before any group is made."""
    import fastdist.accelerate

    if torch.distributed.is_initialized():
        pytest.skip("this process has a group already")
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(ValueError) as refused:
        fastdist.accelerate.init_process_group()
    line = str(refused.value)
    assert "\n" not in line and "`accelerate launch --cpu` started this one process" in line, line
    assert "fastdist run --nproc-per-node N" in line, line
    assert not torch.distributed.is_initialized()


def accelerator_alone(ctx: Any) -> None:
    """Rank code: a 2-rank job whose Accelerator is made for GPUs (no cpu=True) on this CPU
    machine, as docs/frameworks.md's example is written: Accelerate runs each process alone."""
    import os

    import fastdist.accelerate
    from accelerate import Accelerator

    os.environ.update(RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size), LOCAL_RANK=str(ctx.rank))
    fastdist.accelerate.init_process_group()
    accelerator = Accelerator()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    calls = []
    try:
        fastdist.accelerate.step(accelerator, lambda: calls.append(1), timeout=10)
    except ValueError as err:
        ctx.record("refused", message=str(err), calls=len(calls), processes=accelerator.num_processes)


def trainer_alone(ctx: Any) -> None:
    """Rank code: a 2-rank job whose TrainingArguments are made for GPUs (no use_cpu=True) on this
    CPU machine: the Trainer would run each process alone (world size 1)."""
    import os
    import tempfile

    import fastdist.transformers
    import transformers

    os.environ.update(RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size), LOCAL_RANK=str(ctx.rank))
    fastdist.transformers.init_process_group()
    args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), report_to=[], max_steps=1)
    try:
        fastdist.transformers.Trainer(model=torch.nn.Linear(4, 1), args=args, step_timeout=10)
    except ValueError as err:
        ctx.record("refused", message=str(err), world=args.world_size)


@pytest.mark.timeout(60)
def test_an_accelerator_that_runs_each_process_alone_is_refused_at_its_first_step() -> None:
    """Without cpu=True Accelerate leaves each CPU process of a distributed job to train alone
    (no all-reduce, every model different) and says nothing: fastdist.accelerate.step refuses
    before the step runs, naming the fix; so does the Trainer without use_cpu=True, as
    fastdist.transformers.Trainer is made."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    results = run_ranks(accelerator_alone, 2, timeout=50, env=env)
    for r in results:
        refused = r.record("refused")
        assert refused["processes"] == 1 and refused["calls"] == 0, describe(results)
        assert f"rank {r.rank} of a job of 2" in refused["message"], refused
        assert "Accelerator(cpu=True" in refused["message"], refused
    # The Hugging Face Trainer, the same mistake: refused as the Trainer is made.
    env["MASTER_PORT"] = str(free_port())
    results = run_ranks(trainer_alone, 2, timeout=50, env=env)
    for r in results:
        refused = r.record("refused")
        assert refused["world"] == 1, describe(results)
        assert f"rank {r.rank} of a job of 2" in refused["message"], refused
        assert "TrainingArguments(use_cpu=True" in refused["message"], refused


@pytest.mark.timeout(60)
def test_an_fsdp2_replacement_is_refused_at_set_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replacement under ModelParallelStrategy (FSDP2) stops at set-up saying why, before
    Lightning sets anything up: the dead rank's shards exist nowhere else."""
    import types

    import fastdist.lightning as fl
    from fastdist.recovery import joining

    strategy = fl.ModelParallelStrategy(data_parallel_size=3, tensor_parallel_size=1)
    monkeypatch.setattr(joining, "is_pending", lambda: True)
    with pytest.raises(RuntimeError, match="cannot bring a replacement of a dead rank up to date: its FSDP2"):
        strategy.setup(types.SimpleNamespace(lightning_module=None))


def _check_loop(out: Path, text: str, optimizer_steps: int) -> None:
    """A hand-written loop's results (Fabric's, Accelerate's): the stall was real, every rank
    redid one step, and the disturbed run equals the undisturbed one."""
    assert "rank 2 never arrived" in text, text[-4000:]
    assert "cannot bound the ops" not in text
    ref = torch.load(out / "rank0-undisturbed.pt", weights_only=False)
    for rank in range(3):
        clean = torch.load(out / f"rank{rank}-undisturbed.pt", weights_only=False)
        got = torch.load(out / f"rank{rank}-stalled.pt", weights_only=False)
        assert clean["retries"] == 0 and got["retries"] == 1, rank
        assert got["world"] == 3, rank
        assert _largest_difference(ref, clean) <= 1e-6 and _largest_difference(ref, got) <= 1e-6, rank
        assert got["optimizer_steps"] == clean["optimizer_steps"] == optimizer_steps, rank
        assert got["lr"] == clean["lr"] and len(got["losses"]) == 40, rank
        assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) <= 1e-6, rank


@pytest.mark.timeout(120)
def test_fabric_loop_in_run_step_under_fabrics_launcher(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    text = _launch([sys.executable, str(HERE / "fabric_job.py"), "--out", str(out)], 100)
    _check_loop(out, text, 20)


@pytest.mark.timeout(120)
def test_accelerate_under_torchrun_with_accumulate(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    cmd = _torchrun("accelerate_job.py", out)
    _check_loop(out, _launch(cmd, 100), 60)  # 20 steps x 3 (Accelerate's scheduler rule)
    for rank in range(3):  # InitProcessGroupKwargs(timeout=) reached the group fastdist made
        assert torch.load(out / f"rank{rank}-stalled.pt", weights_only=False)["group_timeout"] == 77.0


def _check_replaced_loop(out: Path, text: str, replacements: int = 1) -> None:
    """A hand-written loop stepping per accumulation window under fastdist run
    (tests/frameworks/fabric_job.py, tests/frameworks/accelerate_job.py with --kill): rank 2,
    SIGKILLed in window 3's first micro-batch, was replaced; ranks 0 and 1 were never restarted;
    every rank ends equal to an undisturbed run in the same job, and the replacement's gathered
    losses from window 3 on equal it too."""
    started = _replacements(text)
    assert len(started) == replacements and all("rank 2:" in s for s in started), text[-4000:]
    ref = torch.load(out / "rank0-undisturbed.pt", weights_only=False)
    for rank in range(3):
        clean = torch.load(out / f"rank{rank}-undisturbed.pt", weights_only=False)
        got = torch.load(out / f"rank{rank}-killed.pt", weights_only=False)
        if rank == 2:  # the replacement: from window 3 on
            assert got["pid"] != clean["pid"] and got["joined"] == 3, got["joined"]
        else:
            assert got["pid"] == clean["pid"] and got["joined"] is None, rank
        assert got["world"] == 3 and got["optimizer_steps"] == clean["optimizer_steps"], rank
        assert _largest_difference(ref, clean) <= 1e-6 and _largest_difference(ref, got) <= 1e-6, rank
        assert got["lr"] == clean["lr"], rank
        skipped = got["joined"] or 0
        assert len(got["losses"]) == 20 - skipped, rank
        assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"][skipped:])) <= 1e-6, rank


@pytest.mark.timeout(120)
def test_accelerate_under_fastdist_run_replaces_a_killed_worker(tmp_path: Path) -> None:
    """One fastdist.accelerate.step per accumulation window (both micro-batches inside, each in
    accumulate()), a shuffled loader; the replacement takes the epoch's order from the live ranks
    (fastdist.accelerate.LoaderState in state=: its iterator broadcast Accelerate's RNG state
    alone before, and every replacement died on it) and skips the windows done with
    accelerator.skip_first_batches. The first replacement dies too, while it loads that state in
    the hand-over: the live ranks' recovery fails (retryable) and fastdist.accelerate.step
    recovers again, with a second replacement (it raised RecoveryError out of the step, and
    the job ended, before)."""
    out = tmp_path / "out"
    out.mkdir()
    text = _launch(_fastdist_run("accelerate_job.py", out, "--kill", "--joiner-dies"), 110)
    assert "recovering again (" in text, text[-4000:]
    _check_replaced_loop(out, text, replacements=2)


@pytest.mark.timeout(120)
def test_fabric_loop_under_fastdist_run_replaces_a_killed_worker(tmp_path: Path) -> None:
    """One fastdist.run_step per accumulation window, no_backward_sync for the first micro-batch;
    the replacement draws the windows done from its loader."""
    out = tmp_path / "out"
    out.mkdir()
    _check_replaced_loop(out, _launch(_fastdist_run("fabric_job.py", out, "--kill"), 100))


@pytest.mark.timeout(160)
def test_fabric_fsdp2_under_fastdist_run_replaces_a_killed_worker_from_a_snapshot(tmp_path: Path) -> None:
    """FabricModelParallelStrategy (FSDP2), one run_step per window with snapshot= and
    step_number=: rank 2 SIGKILLed in window 3, its replacement gets its shards from the copy of
    the step's start another rank holds, every rank redoes window 3; then rank 1 stalls in window
    6 and the recovery rolls nothing back (a roll-back of step 3 remembered there would end the
    job with RuntimeError); rank 1 dies in the exchange of window 9's snapshot after its copy left
    (window 9 redone from its start); rank 2 dies in window 12's before its copy left: every rank
    rolls back to window 11's start (the newest whole snapshot), the live ranks redo window 11
    with the replacement and put their own state back, and window 12 goes on (it ended the job
    with RecoveryError before). Equal to an undisturbed run (the same processes, run after it)."""
    out = tmp_path / "out"
    out.mkdir()
    text = _launch(_fastdist_run("fabric_job.py", out, "--kill", "--fsdp2"), 130)
    started = _replacements(text)
    assert len(started) == 3 and ["rank 2:" in s for s in started] == [True, False, True], text[-4000:]
    assert "rank 1 never arrived" in text, text[-4000:]  # the stall was real
    assert "redid step 11 with the replacement" in text, text[-4000:]  # the roll-back was real
    ref = torch.load(out / "rank0-undisturbed.pt", weights_only=False)
    for rank in range(3):
        clean = torch.load(out / f"rank{rank}-undisturbed.pt", weights_only=False)
        got = torch.load(out / f"rank{rank}-killed.pt", weights_only=False)
        # The live ranks never restarted; rank 1's last process joined at window 9 (its step's
        # start), rank 2's at window 11 (the roll-back).
        assert got["joined"] == {0: None, 1: 9, 2: 11}[rank], (rank, got["joined"])
        assert got["world"] == 3 and got["optimizer_steps"] == clean["optimizer_steps"] == 20, rank
        assert _largest_difference(ref, clean) <= 1e-6 and _largest_difference(ref, got) <= 1e-6, rank
        assert got["lr"] == clean["lr"], rank
        skipped = got["joined"] or 0
        assert len(got["losses"]) == 20 - skipped, rank
        # (A replacement that rolled back reduces the loss of the step it redoes alone: the live
        # ranks reduced theirs before the death.)
        own = 1 if rank == 2 else 0
        losses = zip(got["losses"][own:], ref["losses"][skipped + own :])
        assert max(abs(a - b) for a, b in losses) <= 1e-6, rank


@pytest.mark.timeout(150)
def test_hugging_face_trainer_survives_a_stall_and_three_deaths_equal_to_an_undisturbed_run(
    tmp_path: Path,
) -> None:
    """fastdist.transformers.Trainer (a tiny GPT-2 from its config, accumulation 2, a linear LR
    schedule, the Trainer's shuffled sampler, logging, evaluation and saving) under fastdist run:
    rank 1 stalls in step 3 (recovered in place, the step redone once), rank 2 is SIGKILLed in step
    6 and its replacement SIGKILLed in the evaluation after step 8 (the second replacement joins
    the live ranks' redo of that evaluation), and rank 0 inside the save of step 10's checkpoint
    (the live ranks' barrier after the save fails; the saving is redone with rank 0's
    replacement, and the checkpoint loads, whole: it was left without its RNG states and the
    Trainer's state before). With GPT-2's dropout on: each replacement takes the random state its
    predecessor published at the start of the step redone (the job differed by 0.033 before).
    Every rank ends with the parameters and momentum of
    an undisturbed run (0.0: the same reduction order) and the same evaluations."""
    out = tmp_path / "out"
    out.mkdir()
    text = _launch(_fastdist_run("trainer_job.py", out), 140)
    started = _replacements(text)
    assert [re.search(r"rank (\d+): replacement", s).group(1) for s in started] == ["2", "2", "0"], text[
        -4000:
    ]
    assert "rank 1 never arrived" in text, text[-4000:]  # the stall was real
    assert "the checkpoint of step 10 was cut short" in text, text[-4000:]  # rank 0 died in the save
    assert "was not kept (it died before it was sent)" not in text, text[-4000:]  # each took it
    for rank in range(3):
        clean = torch.load(out / f"rank{rank}-undisturbed.pt", weights_only=False)
        got = torch.load(out / f"rank{rank}-faulted.pt", weights_only=False)
        assert got["joined"] == {0: 10, 1: None, 2: 8}[rank], (rank, got["joined"])
        assert (got["pid"] == clean["pid"]) == (rank == 1), rank  # the live ranks never restarted
        assert got["world"] == 3 and got["optimizer_steps"] == clean["optimizer_steps"] == 10, rank
        assert _largest_difference(clean, got) == 0.0, (rank, _largest_difference(clean, got))
        assert got["lr"] == clean["lr"] and got["evals"] == clean["evals"] and len(clean["evals"]) == 3
        # Each step exactly once, plus one redo each of steps 3 and 6 (2 micro-batches each); the
        # last replacement ran steps 8 and 9.
        assert got["calls"] == {0: 0, 1: 24, 2: 4}[rank], (rank, got["calls"])
        # The losses logged at steps 8 and 10 had a dead rank's share, lost with it (it died in
        # what follows those updates); the others are equal.
        differ = [i for i, (a, b) in enumerate(zip(got["losses"], clean["losses"])) if a != b]
        assert len(got["losses"]) == len(clean["losses"]) == 5 and set(differ) <= {3, 4}, (rank, differ)
    # The checkpoint rank 0 died writing is whole: the same files as the undisturbed run's, the
    # Trainer's state at step 10, and the optimizer's and scheduler's states equal to that run's.
    ckpt, ref = out / "trainer-faulted" / "checkpoint-10", out / "trainer-undisturbed" / "checkpoint-10"
    files = sorted(p.name for p in ckpt.iterdir())
    assert files == sorted(p.name for p in ref.iterdir()), files
    assert {"optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state_0.pth"} <= set(files), files
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == 10
    for name in ("optimizer.pt", "scheduler.pt"):
        got_state, ref_state = (torch.load(d / name, weights_only=False) for d in (ckpt, ref))
        assert str(got_state) == str(ref_state), name


@pytest.mark.timeout(30)
def test_a_trainer_of_an_untested_transformers_release_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """fastdist.transformers replaces the Trainer's private _run_epoch: on a release it was not
    checked against, the Trainer refuses to be made, naming the ones it was; bad arguments are
    named too."""
    import fastdist.transformers as fdt
    import transformers

    fdt.check_release()  # the installed one (tests: 5.25) is tested
    monkeypatch.setattr(transformers, "__version__", "5.99.0")
    with pytest.raises(RuntimeError, match=r"checked against transformers 5\.25; this is 5\.99\.0"):
        fdt.Trainer(model=torch.nn.Linear(1, 1), step_timeout=5)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="step_timeout must be positive"):
        fdt.Trainer(model=torch.nn.Linear(1, 1), step_timeout=0)
    with pytest.raises(TypeError, match="max_retries must be an int"):
        fdt.Trainer(model=torch.nn.Linear(1, 1), step_timeout=5, max_retries=1.5)


@pytest.mark.timeout(30)
def test_run_step_arguments_and_a_step_that_already_updated_is_not_redone() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5)
    for kwargs, kind, name in [
        ({"timeout": None}, TypeError, "timeout"),
        ({"timeout": 0}, ValueError, "timeout"),
        ({"timeout": 1, "max_retries": -2}, ValueError, "max_retries"),
        ({"timeout": 1, "keep_grads": 1}, TypeError, "keep_grads"),
        ({"timeout": 1, "optimizers": [object()]}, TypeError, "optimizers"),
        ({"timeout": 1, "recover_timeout": -1}, ValueError, "recover_timeout"),
        ({"timeout": 1, "snapshot": object()}, TypeError, "step_number must be an int when snapshot"),
        ({"timeout": 1, "snapshot": object(), "step_number": 1}, TypeError, "snapshot must be a fastdist"),
    ]:
        with pytest.raises(kind, match=name):
            fastdist.run_step(lambda: None, **kwargs)
    assert fastdist.run_step(lambda: 7, timeout=5) == 7

    def step() -> None:
        p.grad = torch.ones(2)
        opt.step()
        raise fastdist.GroupAbortedError(op="all_reduce", group="default", rank=0, reason="a test")

    with pytest.raises(RuntimeError, match="apply the update twice") as info:
        fastdist.run_step(step, timeout=5, optimizers=[opt])
    assert isinstance(info.value.__cause__, fastdist.GroupAbortedError)
    assert not isinstance(info.value, fastdist.FastdistError)
    assert torch.equal(p.detach(), torch.full((2,), 0.5))  # updated once, not redone
    assert not opt._optimizer_step_post_hooks  # the counting hook is gone


@pytest.mark.timeout(30)
def test_a_redone_step_starts_from_the_gradients_it_started_with_by_default() -> None:
    """A step that does not zero its gradients (an accumulation window's micro-batch, a Trainer's
    training_step) and failed halfway through its backward: the default puts back the gradients
    of its start (a copy where one existed, none where none did); False, for a step that zeroes
    its own, leaves them."""
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([a, b], lr=0.5)
    a.grad = torch.full((2,), 3.0)  # the window's earlier micro-batches
    start = StepStart([opt])
    a.grad += 5.0  # the failed attempt's partial backward
    b.grad = torch.ones(2)
    start.restore()
    assert torch.equal(a.grad, torch.full((2,), 3.0)) and b.grad is None
    kept = StepStart([opt], keep_grads=False)
    a.grad += 1.0
    kept.restore()
    assert torch.equal(a.grad, torch.full((2,), 4.0)) and not kept.grads


@pytest.mark.timeout(30)
def test_a_shuffled_loader_without_its_loader_state_is_said_once() -> None:
    """Issue 50: without LoaderState an Accelerate job with a shuffled loader spent all its
    replacements (each broadcast the loader's RNG state alone) with nothing pointing to it. Now
    fastdist.accelerate.step says so on the first step, once per loader; not for an unshuffled
    one (no synchronized generator: what Accelerate prepares for one process or without
    shuffle=True), nor once the loader's LoaderState is in state=."""
    import warnings

    from fastdist import accelerate as fa

    class Loader:  # what the check reads of Accelerate's DataLoaderShard
        def __init__(self, shuffled: bool) -> None:
            self.rng_types = ["generator"] if shuffled else []
            self.synchronized_generator = torch.Generator() if shuffled else None

    class Acc:
        def __init__(self, *loaders: Loader) -> None:
            self._dataloaders = list(loaders)

    shuffled, plain, handed = Loader(True), Loader(False), Loader(True)
    acc = Acc(shuffled, plain, handed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            fa._hint_loader_state(acc, {"model": object(), "data": fa.LoaderState(handed)})
    said = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert len(said) == 1, said
    assert "Add fastdist.accelerate.LoaderState(loader) to state" in said[0], said


UNWATCHED = """
import sys, warnings, torch, torch.distributed as dist, fastdist
with fastdist.fail_after(5):  # no group yet: nothing to say
    pass
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(3):
        with fastdist.fail_after(5):
            dist.all_reduce(torch.ones(1))
for w in caught:
    print(w.category.__name__, w.filename.rsplit("/", 1)[-1], w.message)
dist.destroy_process_group()
"""


@pytest.mark.timeout(60)
def test_a_scope_over_a_group_torch_made_warns_once_naming_the_fix() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", UNWATCHED, str(free_port())],
        check=False,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, lines  # once, not per scope
    assert lines[0].startswith("RuntimeWarning <string> fastdist:"), lines  # pointing at the user's line
    assert "fastdist.init_process_group" in lines[0] and "fastdist.lightning.DDPStrategy" in lines[0]
