"""The example DDP script (fastdist.examples.train_ddp) with faults in the fault, for
tests/recovery/test_replace.py:

- ``FAULT=joiner-mid-transfer``: the first replacement SIGKILLs itself after the state's header
  arrived, before the tensors (a marker file keeps the next one alive); then, in the hand-over to
  the second replacement, the source (rank 0) SIGKILLs itself after posting the state's size and
  header, before the tensors (a death on each side of one hand-over);
- ``FAULT=spare-dies-waiting``: the spare SIGKILLs itself 1 s after its start, while it waits for
  a rank in init_process_group;
- ``FAULT=dies-in-init``: rank 1's first process SIGKILLs itself as it enters torch's
  init_process_group (a marker file keeps the next one alive);
- ``FAULT=frozen``: the rank killed at ``--kill-step`` SIGSTOPs itself instead, mid-backward (a
  hung process: the agent must kill it once the live ranks name it);
- ``FAULT=other-shape``: the replacement of the rank killed at ``--kill-step`` builds a model with
  one layer more (a script that builds other objects on a joiner);
- ``FAULT=dies-in-recover``: rank 2's first process SIGKILLs itself 0.5 s into its first
  recover() (after rank 1's death at ``--kill-step``);
- ``FAULT=dies-and-freezes``: as rank 1 dies at ``--kill-step``, rank 2's first process SIGSTOPs
  itself entering that step (its peers' step fails on the death, not on a timeout: the frozen
  rank is named from the recovery, where it never comes);
- ``FAULT=busy``: the rank killed at ``--kill-step`` is busy instead, mid-backward: about 7 s in
  one C call holding the GIL (its heartbeat thread cannot run: only its CPU time shows it is
  alive), then 6 s asleep (no CPU: only its heartbeat shows it); then it goes on (the agent must
  not kill it: a long evaluation or checkpoint write looks like this);
- ``FAULT=forge`` (or ``busy,forge``, both): rank 0 writes, at step 2, what only the job's
  processes may: unsigned (no FASTDIST_JOB_SECRET tag) records naming rank 1 missing to the
  agent, and a timeout of another rank's in the fault inboxes of ranks 1 and 2; every reader
  must ignore them (no abort, no kill);
- ``FAULT=agent-frozen``: the rank killed at ``--kill-step`` first SIGSTOPs the agent, which
  hosts the job's store (a frozen or lost node): the live ranks must still raise in time.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch.distributed as dist
from fastdist.examples import train_ddp

fault = os.environ.get("FAULT", "")
if fault == "busy,forge":  # both in one launch
    fault, forge = "busy", True
else:
    forge = fault == "forge"
out = sys.argv[sys.argv.index("--out") + 1]

if fault == "joiner-mid-transfer":
    marker = os.path.join(out, ".joiner-killed")
    original_irecv = dist.irecv  # (fastdist's state transfer posts each receive, then waits)
    calls = [0]

    def irecv(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        if calls[0] == 3 and not os.path.exists(marker):  # 1: size, 2: header, 3: the tensors
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return original_irecv(*args, **kwargs)  # type: ignore[arg-type]

    dist.irecv = irecv  # type: ignore[assignment]

    source_marker = os.path.join(out, ".source-killed")
    if os.environ["RANK"] == "0" and not os.path.exists(source_marker):
        from fastdist.recovery import state_sync

        real_send_dicts, original_send = state_sync.send_dicts, dist.send
        hand_overs, sends = [0], [0]

        def send(*args: object, **kwargs: object) -> object:
            sends[0] += 1  # 1: the size, 2: the header, 3: the tensors
            if hand_overs[0] == 2 and sends[0] == 3:
                open(source_marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            return original_send(*args, **kwargs)  # type: ignore[arg-type]

        def send_dicts(*args: object, **kwargs: object) -> object:
            hand_overs[0] += 1  # the second: to the second replacement
            sends[0] = 0
            return real_send_dicts(*args, **kwargs)  # type: ignore[arg-type]

        state_sync.send_dicts = send_dicts  # type: ignore[assignment]
        dist.send = send  # type: ignore[assignment]

if fault == "spare-dies-waiting":
    spares = int(os.environ.get("FASTDIST_SPARES", "0"))
    if int(os.environ["RANK"]) >= int(os.environ["WORLD_SIZE"]) - spares:
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()

if fault == "dies-in-init" and os.environ["RANK"] == "1":
    marker = os.path.join(out, ".died-in-init")
    original_init = dist.init_process_group

    def init_process_group(*args: object, **kwargs: object) -> None:
        if not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)  # before it has connected to anyone
        original_init(*args, **kwargs)  # type: ignore[arg-type]

    dist.init_process_group = init_process_group

killed_marker = os.path.join(out, f".killed-{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}")
if fault == "other-shape" and os.path.exists(killed_marker):
    import torch

    real_sequential = torch.nn.Sequential

    def sequential(*modules: torch.nn.Module) -> torch.nn.Module:
        return real_sequential(*modules, torch.nn.Linear(4, 4))

    torch.nn.Sequential = sequential  # type: ignore[misc,assignment]

if fault == "dies-in-recover" and os.environ["RANK"] == "2":
    import fastdist

    recover_marker = os.path.join(out, ".died-in-recover")
    real_recover = fastdist.recover

    def recover(*args: object, **kwargs: object) -> object:
        if not os.path.exists(recover_marker):
            open(recover_marker, "w").close()
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
        return real_recover(*args, **kwargs)

    fastdist.recover = recover

if fault == "dies-and-freezes" and os.environ["RANK"] == "2":
    import fastdist

    freeze_marker = os.path.join(out, ".frozen")
    kill_step = int(sys.argv[sys.argv.index("--kill-step") + 1])
    real_fail_after = fastdist.fail_after
    steps = [0]

    def fail_after(*args: object, **kwargs: object) -> object:
        if steps[0] == kill_step and not os.path.exists(freeze_marker):
            open(freeze_marker, "w").close()
            os.kill(os.getpid(), signal.SIGSTOP)
        steps[0] += 1
        return real_fail_after(*args, **kwargs)

    fastdist.fail_after = fail_after

if forge and os.environ["RANK"] == "0":
    import json

    import fastdist
    from fastdist.store import job, ring
    from fastdist.store.job import JOB

    real_scope = fastdist.fail_after
    scopes = [0]

    def forging_scope(*args: object, **kwargs: object) -> object:
        scopes[0] += 1
        if scopes[0] == 3:  # step 2
            now = time.time()
            suspect = {
                "rank": 1,
                "by": 0,
                "what": "all_reduce #9 on group 'default'",
                "since": now - 1,
                "time": now,
            }
            JOB.store.append(job.suspects_key(), json.dumps(suspect) + "\n")
            fault = {"kind": "fault", "group": "default", "gen": 0, "root": 0, "rank": 0, "op": "all_reduce"}
            fault.update(seq=99, state="timed_out", t=now)
            store = dist.distributed_c10d._get_default_store()
            for r in (1, 2):
                ring.deliver(store, r, json.dumps(fault))
            print("rank 0: forged records written", flush=True)
        return real_scope(*args, **kwargs)

    fastdist.fail_after = forging_scope

if fault in ("agent-frozen", "frozen", "busy"):
    real_kill = os.kill
    busied: list[bool] = []

    def kill(pid: int, sig: int) -> None:
        if pid == os.getpid() and sig == signal.SIGKILL:  # train_ddp's death mid-backward
            if fault == "busy":
                if busied:
                    return  # (the step is redone: the hook runs again)
                busied.append(True)
                t = time.perf_counter()
                sum(range(10**6))
                n = int(7.0 / max(time.perf_counter() - t, 1e-4) * 10**6)
                print(f"rank {os.environ['RANK']}: busy in one C call", flush=True)
                sum(range(n))  # one call: the GIL is not released until it returns
                print(f"rank {os.environ['RANK']}: asleep", flush=True)
                time.sleep(6.0)
                print(f"rank {os.environ['RANK']}: back", flush=True)
                return
            if fault == "frozen":
                sig = signal.SIGSTOP
            else:
                real_kill(int(os.environ["FASTDIST_AGENT_PID"]), signal.SIGSTOP)
        real_kill(pid, sig)

    os.kill = kill

train_ddp.main()
