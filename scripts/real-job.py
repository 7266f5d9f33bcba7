#!/usr/bin/env python3
"""Usage: .venv/bin/python scripts/real-job.py (about 1 min; prints the largest difference).
A user's job under fastdist run: train_ddp (DDP, torch issues the all_reduces) for 3000 steps,
an undisturbed run, then one where rank 1 is SIGSTOPped from outside and, after its replacement
joined, rank 2 is SIGKILLed from outside (wherever they are: mid-step or between steps)."""

import json
import os
import signal
import subprocess
import sys
import time

from fastdist.examples.train_ddp import compare

R = os.environ.get("FASTDIST_REAL_JOB_DIR", "/tmp/rj")
os.system(f"rm -rf {R} && mkdir -p {R}/ref {R}/dist")
STEPS = 3000


def launch(name, port):
    cmd = [
        sys.executable,
        "-m",
        "fastdist.run",
        "--nproc-per-node",
        "3",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--kill-missing-after",
        "5",
        "-m",
        "fastdist.examples.train_ddp",
        "--steps",
        str(STEPS),
        "--out",
        f"{R}/{name}",
        "--events",
        f"{R}/{name}.ev",
    ]
    return subprocess.Popen(
        cmd, stdout=open(f"{R}/{name}.log", "w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def events(name):
    try:
        return [json.loads(l) for l in open(f"{R}/{name}.ev")]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def wait_for(name, pred, timeout=120):
    end = time.time() + timeout
    while time.time() < end:
        got = [e for e in events(name) if pred(e)]
        if got:
            return got[-1]
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting in {name}")


t = time.time()
p = launch("ref", 29611)
print("ref rc", p.wait(300), f"{time.time() - t:.1f} s")
t = time.time()
p = launch("dist", 29612)
e = wait_for("dist", lambda e: e["event"] == "step" and e["rank"] == 1 and e["step"] >= 300)
os.kill(e["pid"], signal.SIGSTOP)
print("SIGSTOP rank 1 pid", e["pid"], "at its step", e["step"])
j = wait_for("dist", lambda e: e["event"] == "joined")
print("joined:", j["rank"], "at step", j["step"])
e = wait_for("dist", lambda e: e["event"] == "step" and e["rank"] == 2 and e["step"] >= j["step"] + 300)
os.kill(e["pid"], signal.SIGKILL)
print("SIGKILL rank 2 pid", e["pid"], "at its step", e["step"])
rc = p.wait(300)
print("dist rc", rc, f"{time.time() - t:.1f} s")
print("largest difference from the undisturbed run:", compare(f"{R}/ref", f"{R}/dist", 3))
log = open(f"{R}/dist.log").read()
print(
    "\n".join(
        l for l in log.splitlines() if l.startswith("[fastdist run]") or "joined" in l or "failed" in l
    )[-3000:]
)
