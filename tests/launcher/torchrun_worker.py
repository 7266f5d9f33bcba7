"""A worker script launched by real torchrun (``python -m torch.distributed.run``) in
tests/launcher/test_torchrun.py. ``torchrun_worker.py SCENARIO``; each worker writes what it saw as JSON to
``$FASTDIST_TEST_OUT/<attempt>-<rank>.json``."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import fastdist
import torch
import torch.distributed as dist

RANK = int(os.environ["RANK"])
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
OUT = os.environ["FASTDIST_TEST_OUT"]
results: dict[str, Any] = {"rank": RANK, "attempt": ATTEMPT}


def save() -> None:
    with open(os.path.join(OUT, f"{ATTEMPT}-{RANK}.json.tmp"), "w") as f:
        json.dump(results, f)
    os.replace(os.path.join(OUT, f"{ATTEMPT}-{RANK}.json.tmp"), os.path.join(OUT, f"{ATTEMPT}-{RANK}.json"))


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from ranks_common import stop_for as stop_self_for


def train(steps: int, stop_at: int | None, timeout: float) -> None:
    """A small model, gradients averaged with fastdist.all_reduce; a timed-out step is retried
    after recover() on every rank."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = 0
    stopped = False
    while step < steps:
        x = torch.full((2, 8), float(step + 1))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if step == stop_at and RANK == 2 and not stopped:
            stopped = True
            stop_self_for(5.0)
        try:
            for p in model.parameters():
                fastdist.all_reduce(p.grad, timeout=timeout)
                p.grad /= dist.get_world_size()
        except (fastdist.CollectiveTimeoutError, fastdist.GroupAbortedError) as e:
            results.setdefault("errors", []).append(
                {
                    "kind": type(e).__name__,
                    "step": step,
                    "missing": getattr(e, "missing_ranks", None),
                    "message": str(e),
                }
            )
            fastdist.recover(timeout=30)
            continue  # the same step again, on the rebuilt group
        opt.step()
        step += 1
    results["weights"] = [p.detach().flatten().tolist() for p in model.parameters()]


def train_ddp(steps: int, stop_at: int) -> None:
    """The same, with DDP issuing the collectives in backward, each step in fail_after(2)."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step, stopped = 0, False
    while step < steps:
        x = torch.full((2, 8), float(step + 1 + RANK))
        try:
            with fastdist.fail_after(2.0):
                opt.zero_grad()
                loss = model(x).pow(2).mean()
                if step == stop_at and RANK == 2 and not stopped:
                    stopped = True
                    stop_self_for(5.0)
                loss.backward()
                opt.step()
            step += 1
        except fastdist.FastdistError as e:
            results.setdefault("ddp_errors", []).append(
                {"kind": type(e).__name__, "step": step, "missing": getattr(e, "missing_ranks", None)}
            )
            fastdist.recover(timeout=30)
    results["ddp_weights"] = [p.detach().flatten().tolist() for p in model.parameters()]


def train_sigstop() -> None:
    fastdist.init_process_group("gloo")
    results["world_size"] = dist.get_world_size()
    train(steps=6, stop_at=3, timeout=2.0)
    train_ddp(steps=4, stop_at=2)


def restart() -> None:
    """Attempt 0: a timeout, a recovery, then a second timeout whose handler exits with code 3, so
    torchrun restarts the group. Attempt 1: the same timeout and recovery (which would meet
    attempt 0's keys, were they shared), then training to the end."""
    fastdist.init_process_group("gloo")
    t = torch.ones(1)
    fastdist.all_reduce(t, timeout=30)
    rounds = 2 if ATTEMPT == 0 else 1
    for i in range(rounds):
        last = ATTEMPT == 0 and i == rounds - 1
        if last and RANK != 2:
            fastdist.set_timeout_handler(lambda err: sys.exit(3))
        if RANK == 2:
            time.sleep(2.5)  # hangs past the others' deadline
        try:
            fastdist.all_reduce(t, timeout=1.0)
            results.setdefault("no_error", []).append(i)
        except (fastdist.CollectiveTimeoutError, fastdist.GroupAbortedError) as e:
            results.setdefault("errors", []).append(
                {"kind": type(e).__name__, "missing": getattr(e, "missing_ranks", None)}
            )
            save()
        fastdist.recover(timeout=30)
        results.setdefault("recovered", []).append(dist.get_world_size())
        save()
    train(steps=3, stop_at=None, timeout=30)


def smoke() -> None:
    """Start, a barrier, an all_reduce; the NCCL error-handling rule; doctor inside a worker."""
    import contextlib
    import io

    from fastdist import process_group
    from fastdist.tools import cli

    fastdist.init_process_group("gloo")
    results["barrier"] = fastdist.barrier(timeout=30)
    t = torch.tensor([float(RANK + 1)])
    fastdist.all_reduce(t, timeout=30)
    results["sum"] = t.item()
    results["nccl_mode_before"] = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        process_group.configure_nccl_error_handling("nccl")
    results["nccl_mode_after"] = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    results["nccl_warned"] = any("was set explicitly" in str(w.message) for w in caught)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli.main(["doctor", "--json", "--timeout", "5"])
    report = json.loads(buf.getvalue())
    results["doctor"] = {"code": code, "checks": {c["name"]: c["ok"] for c in report["checks"]}}
    fastdist.barrier(timeout=30)


def gpu_stall() -> None:
    """One GPU under torchrun: an all_reduce behind a 3 s stream stall times out at 1 s; the process
    is still alive 10 s later (torch's watchdog left it alone) and recovers."""
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    fastdist.init_process_group("nccl")
    results["nccl_mode"] = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    t = torch.ones(16, device="cuda")
    fastdist.all_reduce(t, timeout=30)
    torch.cuda._sleep(int(3e9))  # a few seconds of stall on any current GPU
    t0 = time.monotonic()
    try:
        fastdist.all_reduce(t, timeout=1.0)
    except fastdist.CollectiveTimeoutError as e:
        results["detected"] = time.monotonic() - t0
        results["message"] = str(e)
    time.sleep(10.0)
    results["alive_after_10s"] = True
    fastdist.recover(timeout=60)
    t = torch.full((16,), 2.0, device="cuda")
    fastdist.all_reduce(t, timeout=30)
    results["value"] = t[0].item()


if __name__ == "__main__":
    globals()[sys.argv[1]]()
    results["done"] = True
    save()
