"""``fastdist demo --kill``: a local DDP job under ``fastdist run`` in which one worker is
SIGKILLed mid-backward and replaced, the other ranks never restarted; the final model is compared
with an undisturbed run of the same script (fastdist.examples.train_ddp).

``fastdist demo``: a local DDP training job on gloo in which one rank stalls, and the job
recovers without restarting.

The parent starts a TCPStore on 127.0.0.1 (a free port) and N rank processes. Each rank trains
the same small model with ``torch.nn.parallel.DistributedDataParallel`` (so torch itself issues
the all_reduce in ``backward()``), every step inside ``fastdist.fail_after(TIMEOUT)``. At one
step the stalling rank stops for a while before its backward (as a rank stuck loading data
would): every other rank's step raises ``CollectiveTimeoutError`` naming it at about the
deadline; all ranks call ``fastdist.recover()`` (the stalled one once it wakes and finds the
group dead), redo the failed step and train on with the same model and optimizer. The parent
prints each rank's output whole, in rank order, then a summary: who was named, how long
detection took, and whether every rank ended with the same parameters.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import fastdist

from ..examples.train_ddp import compare

_PREFIX = "fastdist_demo"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the arguments of ``fastdist demo`` to ``parser``."""
    parser.add_argument("--nproc", type=int, default=3, help="number of local ranks (default 3)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=2.0,
        help="the fail_after deadline of each training step, seconds (default 2)",
    )
    parser.add_argument(
        "--hang-rank", type=int, default=None, help="the rank that stalls (default: the last)"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="healthy steps before the stall, and after (default 3)"
    )
    parser.add_argument(
        "--kill",
        action="store_true",
        help="kill a worker mid-step under fastdist run instead (it is replaced), compare with no kill",
    )


def run_kill(args: argparse.Namespace) -> int:
    """Two launches of the example script under ``fastdist run``: undisturbed, then with rank 1
    SIGKILLed in its backward at step 5. Prints the second launch's output and the comparison."""
    nproc = max(args.nproc, 2)
    steps = 20
    out = tempfile.mkdtemp(prefix="fastdist_demo_")

    def launch(name: str, *script: str, quiet: bool) -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.mkdir(os.path.join(out, name))
        cmd = [
            sys.executable,
            "-m",
            "fastdist.run",
            "--nproc-per-node",
            str(nproc),
            "--master-addr",
            "127.0.0.1",
        ]
        cmd += ["--master-port", str(port), "-m", "fastdist.examples.train_ddp", "--steps", str(steps)]
        cmd += ["--out", os.path.join(out, name), *script]
        print("$", " ".join(cmd[1:]), flush=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", LOGLEVEL="ERROR")
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL if quiet else None,
            stderr=subprocess.STDOUT if quiet else None,
            env=env,
            start_new_session=True,
        )
        try:
            return proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    print(f"fastdist demo --kill: {nproc} workers, {steps} DDP steps, each in fail_after(3)", flush=True)
    print("1. an undisturbed run (the reference)", flush=True)
    if launch("reference", quiet=True) != 0:
        print("the undisturbed run failed", flush=True)
        return 1
    print("2. the same job, rank 1 SIGKILLed in its backward at step 5:", flush=True)
    rc = launch("killed", "--kill-rank", "1", "--kill-step", "5", quiet=False)
    diff = compare(os.path.join(out, "reference"), os.path.join(out, "killed"), nproc)
    print(f"\nlauncher exit code {rc}; largest difference from the undisturbed run, over every rank's")
    verdict = "bit-identical" if diff == 0.0 else "equal within 1e-6" if diff <= 1e-6 else "NOT EQUAL"
    print(f"parameters and SGD momentum: {diff:.2e} ({verdict})")
    return 0 if rc == 0 and diff <= 1e-6 else 1


def run(args: argparse.Namespace) -> int:
    """The parent: starts the store and the ranks, then prints their output and the outcome."""
    if args.kill:
        return run_kill(args)
    if args.nproc < 2:
        raise SystemExit("fastdist demo: --nproc must be at least 2")
    if not args.timeout > 0:
        raise SystemExit("fastdist demo: --timeout must be positive")
    if args.rounds < 1:
        raise SystemExit("fastdist demo: --rounds must be at least 1")
    hang = args.nproc - 1 if args.hang_rank is None else args.hang_rank
    if not 0 <= hang < args.nproc:
        raise SystemExit(f"fastdist demo: --hang-rank must be in 0..{args.nproc - 1}, got {hang}")

    from torch.distributed import TCPStore

    store = TCPStore(
        "127.0.0.1", 0, args.nproc + 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    stall = 3 * args.timeout
    print(
        f"fastdist demo: DDP on {args.nproc} gloo ranks (TCPStore on 127.0.0.1:{store.port}); each step in "
        f"fail_after({args.timeout:g});\nrank {hang} stalls {stall:g} s before its backward at step "
        f"{args.rounds}; everyone recovers and trains on.\n",
        flush=True,
    )
    procs: list[subprocess.Popen[bytes]] = []
    logs = [tempfile.TemporaryFile() for _ in range(args.nproc)]  # noqa: SIM115 - closed below
    try:
        for rank in range(args.nproc):
            cmd = [sys.executable, "-m", "fastdist.tools.demo", str(rank), str(args.nproc), str(store.port)]
            cmd += [str(args.timeout), str(hang), str(args.rounds)]
            procs.append(subprocess.Popen(cmd, stdout=logs[rank], stderr=subprocess.STDOUT))
        # Every rank imports torch (~1 s each on a small machine) before the clock starts.
        limit = time.monotonic() + 90 + 4 * args.nproc + 10 * args.timeout
        for p in procs:
            p.wait(timeout=max(1.0, limit - time.monotonic()))
        results = {}
        for r in range(args.nproc):
            key = f"{_PREFIX}/result/{r}"
            results[r] = json.loads(store.get(key)) if store.check([key]) else None
    except subprocess.TimeoutExpired:
        results = {}
        print("fastdist demo: the ranks did not finish in time", flush=True)
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
        for rank, log in enumerate(logs):
            log.seek(0)
            text = log.read().decode(errors="replace").rstrip()
            log.close()
            print(f"---- rank {rank} (exit {procs[rank].returncode if rank < len(procs) else '?'}) ----")
            print(text or "(no output)", flush=True)
    return _summarize(results, args.nproc, hang, args.timeout)


def _summarize(results: dict[int, dict[str, Any] | None], nproc: int, hang: int, timeout: float) -> int:
    print("\nrank  error in the stalled step   named missing  detected after  recovered  parameters")
    ok = len(results) == nproc and all(results.values())
    sums = set()
    for rank in range(nproc):
        res = results.get(rank)
        if not res:
            print(f"{rank:>4}  (no result)")
            continue
        sums.add(res["checksum"])
        named = ",".join(map(str, res["missing"])) if res["missing"] else "-"
        after = f"{res['elapsed']:.3f} s" if res["elapsed"] is not None else "-"
        recovered = "yes" if res["recovered"] else "NO"
        print(f"{rank:>4}  {res['error']:<26} {named:>13}  {after:>14}  {recovered:>9}  {res['checksum']}")
        if rank != hang:
            ok = ok and res["error"] == "CollectiveTimeoutError" and res["missing"] == [hang]
            ok = ok and res["elapsed"] is not None and res["elapsed"] < timeout + 1.5
        ok = ok and res["recovered"]
    ok = ok and len(sums) == 1
    print(
        f"\nEvery other rank's DDP step raised CollectiveTimeoutError naming rank {hang} at its deadline"
        "\n(plus the report window), instead of hanging; recover() rebuilt the group in place, and the"
        "\nsame DDP model trained on to identical parameters on every rank."
        if ok
        else "\nUNEXPECTED: see the ranks' output above."
    )
    return 0 if ok else 1


def _rank_main(rank: int, world_size: int, port: int, timeout: float, hang: int, rounds: int) -> None:
    # The library's own warnings ("group 'default' is aborted: ...") go with this rank's output,
    # in order, marked as the library's.
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="  (fastdist log) %(message)s")

    def say(text: str) -> None:
        print(text, flush=True)

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    fastdist.init_process_group(
        "gloo", store=dist.PrefixStore(f"{_PREFIX}/pg", store), rank=rank, world_size=world_size
    )
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    result: dict[str, Any] = {"error": "none", "missing": None, "elapsed": None, "recovered": False}
    step = 0
    stalled = False
    while step < 2 * rounds:
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step * world_size + rank))
        start = time.monotonic()
        try:
            with fastdist.fail_after(timeout):
                opt.zero_grad()
                loss = model(x).pow(2).mean()
                if rank == hang and step == rounds and not stalled:
                    stalled = True
                    say(f"step {step}: stalling {3 * timeout:g} s before backward (as if stuck loading data)")
                    time.sleep(3 * timeout)
                loss.backward()  # DDP's all_reduce of the gradients, issued by torch
                opt.step()
            say(f"step {step}: loss {loss.item():.4f}")
            step += 1
        except fastdist.FastdistError as err:
            elapsed = time.monotonic() - start
            say(f"step {step}: {type(err).__name__} after {elapsed:.3f} s:\n  {err}")
            if result["error"] == "none":
                missing = getattr(err, "missing_ranks", None)
                result.update(
                    error=type(err).__name__, missing=missing, elapsed=elapsed if rank != hang else None
                )
            t0 = time.monotonic()
            fastdist.recover(timeout=10 * timeout + 20)
            result["recovered"] = True
            say(f"recover(): the group is rebuilt in {time.monotonic() - t0:.3f} s; redoing step {step}")
    with torch.no_grad():
        result["checksum"] = f"{sum(float(p.double().sum()) for p in model.parameters()):.6f}"
    say(f"done: {2 * rounds} steps, parameter checksum {result['checksum']}")
    store.set(f"{_PREFIX}/result/{rank}", json.dumps(result))
    fastdist.barrier(timeout=30)  # nobody exits while another still reads the store


if __name__ == "__main__":
    # Started by run(): RANK WORLD_SIZE PORT TIMEOUT HANG_RANK ROUNDS
    _rank, _world, _port, _timeout, _hang, _rounds = sys.argv[1:7]
    _rank_main(int(_rank), int(_world), int(_port), float(_timeout), int(_hang), int(_rounds))
