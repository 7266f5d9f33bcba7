"""A node lost and replaced: two `fastdist run` agents on this host as two nodes (c10d rendezvous,
2 workers each, the DDP example, 30 steps); node B's rank 2 dies in its backward at step 8 and
B's agent with its other worker is SIGKILLed; a third agent takes node B's place. Prints the live
ranks' errors, what the new agent said, whether node A's workers kept their PIDs, and the largest
difference from an undisturbed 4-worker run of the same script.

    python scripts/node-loss-job.py /tmp/nodes
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from mp import free_port  # noqa: E402

from fastdist.examples.train_ddp import compare  # noqa: E402

root = Path(sys.argv[1])
root.mkdir(parents=True, exist_ok=True)
script = ["-m", "fastdist.examples.train_ddp", "--steps", "30"]


def start(log: Path, *flags: str) -> subprocess.Popen:
    with log.open("w") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "fastdist.run", *flags], stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )


ref = root / "ref"
ref.mkdir(exist_ok=True)
port = str(free_port())
assert start(root / "ref.log", "--master-addr", "127.0.0.1", "--master-port", port, "--nproc-per-node", "4",
             *script, "--out", str(ref)).wait(180) == 0

out, events = root / "lost", root / "events.jsonl"
out.mkdir(exist_ok=True)
with contextlib.suppress(FileNotFoundError):
    events.unlink()
endpoint = f"127.0.0.1:{free_port()}"
flags = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "nodes"]
job = [*script, "--out", str(out), "--events", str(events), "--kill-rank", "2", "--kill-step", "8"]
a = start(root / "a.log", *flags, "--nproc-per-node", "2", *job)
time.sleep(3)  # A hosts the rendezvous store
b = start(root / "b.log", *flags, "--max-replacements", "0", "--nproc-per-node", "2", *job)
procs = [a, b]
try:
    t0 = time.time()
    while time.time() - t0 < 120:
        lines = events.read_text().splitlines() if events.exists() else []
        if any(json.loads(x)["event"] == "kill" for x in lines if x.endswith("}")):
            break
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(b.pid, signal.SIGKILL)
    print(f"node B (agent pid {b.pid}) SIGKILLed with its workers", flush=True)
    c = start(root / "c.log", *flags, "--nproc-per-node", "2", *job)
    procs.append(c)
    print("agent A exit", a.wait(180), "; agent C exit", c.wait(60))
finally:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
for name in "ac":
    text = (root / f"{name}.log").read_text()
    print(f"--- agent {name.upper()}")
    print("\n".join(x[:300] for x in text.splitlines() if "failed:" in x or "in place of" in x or "joined" in x))
evs = [json.loads(x) for x in events.read_text().splitlines() if x.endswith("}")]
for r in (0, 1):
    print(f"rank {r}: processes {sorted({e['pid'] for e in evs if e['rank'] == r})}")
print("largest difference from the undisturbed run:", compare(str(ref), str(out), 4))
