"""A real job: fastdist run, DDP example, rank 2 SIGKILLed in its backward at step 8 and rank 1
SIGSTOPped for STOP_SECONDS (default 5) at the same moment (SIGCONT after, if it still lives:
past --kill-missing-after, 10 s, the agent kills and replaces it); compared with an undisturbed
run. Usage: [STOP_SECONDS=30] python scripts/stop-and-kill-job.py OUT_DIR"""
import json, os, signal, subprocess, sys, time, socket
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from mp import free_port
from fastdist.examples.train_ddp import compare
root = Path(sys.argv[1]); root.mkdir(parents=True, exist_ok=True)
def launch(out, *flags, extra=()):
    out.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "fastdist.run", "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *flags,
           "-m", "fastdist.examples.train_ddp", "--steps", "30", "--out", str(out), *extra]
    return subprocess.Popen(cmd, stdout=open(out / "log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
p = launch(root / "ref", "--nproc-per-node", "3"); assert p.wait(120) == 0
ev = root / "events.jsonl"
t0 = time.time()
p = launch(root / "dis", "--nproc-per-node", "4", "--spares", "1",
           extra=("--kill-rank", "2", "--kill-step", "8", "--events", str(ev)))
stopped = None
try:
    while time.time() - t0 < 120 and stopped is None:
        if ev.exists() and any(json.loads(l).get("event") == "kill" for l in ev.read_text().splitlines() if l.strip()):
            for pid in os.listdir("/proc"):
                if not pid.isdigit(): continue
                try:
                    env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                except OSError: continue
                if b"RANK=1" in env and any(e.startswith(b"TORCHELASTIC_RUN_ID") for e in env) and b"LOCAL_RANK=1" in env:
                    os.kill(int(pid), signal.SIGSTOP); stopped = int(pid)
                    print(f"SIGSTOP rank 1 (pid {pid}) {time.time()-t0:.2f} s after launch", flush=True)
                    break
        time.sleep(0.005)
    time.sleep(float(os.environ.get("STOP_SECONDS", "5")))
    if stopped:
        try: os.kill(stopped, signal.SIGCONT); print("SIGCONT rank 1", flush=True)
        except ProcessLookupError: print("rank 1 was killed while stopped", flush=True)
    rc = p.wait(120)
finally:
    try: os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError: pass
log = (root / "dis" / "log").read_text()
print("launcher exit", rc)
print("\n".join(l for l in log.splitlines() if "failed" in l or "recovered" in l or "joined" in l or "died" in l or "spare" in l or "done" in l)[:4000])
print("largest difference from the undisturbed run:", compare(str(root / "ref"), str(root / "dis"), 3))
