"""A rank whose Python cannot run at its deadline (a thread holds the GIL in a long C call) while
its own DDP collective is in flight: fastdist's C++ side reports the timeout at the deadline, so
the other ranks raise at once with the right story (that rank timed out; nobody died), and the
rank itself raises CollectiveTimeoutError saying the GIL was held, once it gets it back; then the
job recovers and trains on. (Issue 25, item 4.)

Run as a script, this file is one rank of the job: ``python tests/ops/test_gil.py OUT_DIR`` with
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

HOLD_SECONDS = 6.0  # rank 1 holds the GIL this long, from just after its all_reduce is issued
DEADLINE = 2.0  # rank 1's step deadline
LATE = 3.5  # rank 2 starts its step this late (after rank 1's deadline): it is "elsewhere"


def rank_main(out: Path) -> None:
    import ctypes

    import fastdist
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = int(os.environ["RANK"])
    fastdist.init_process_group("gloo", timeout=30)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hold = {"left": rank == 1}

    def hook(_state, bucket):  # type: ignore[no-untyped-def]  # (DDP checks real annotations)
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        if hold["left"]:
            hold["left"] = False
            ctypes.PyDLL(None).sleep(int(HOLD_SECONDS))  # a C call that never releases the GIL
        return fut.then(lambda f: f.value()[0] / dist.get_world_size())

    model.register_comm_hook(None, hook)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank))
    records: dict[str, object] = {}
    dist.barrier()
    t0 = time.monotonic()
    try:
        if rank == 2:
            time.sleep(LATE)
        with fastdist.fail_after(DEADLINE if rank == 1 else 20):
            model(x).sum().backward()
        records["error"] = None
    except fastdist.FastdistError as exc:
        records.update(error=type(exc).__name__, message=str(exc), at=time.monotonic() - t0)
    opt.zero_grad()
    fastdist.recover(timeout=20)
    with fastdist.fail_after(20):
        model(x).sum().backward()
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    records["equal"] = all(torch.equal(every[0], t) for t in every)
    (out / f"rank{rank}.json").write_text(json.dumps(records))
    dist.barrier()


pytestmark = pytest.mark.timeout(120)


def test_a_rank_holding_the_gil_at_its_deadline_is_reported_from_cpp(tmp_path: Path) -> None:
    from mp import free_port, run_processes

    port = free_port()
    cmds = []
    for rank in range(3):
        env = f"RANK={rank} WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT={port}"
        cmds.append(["env", *env.split(), sys.executable, __file__, str(tmp_path)])
    codes = run_processes(cmds, timeout=90)
    got = {
        r: json.loads((tmp_path / f"rank{r}.json").read_text())
        for r in range(3)
        if (tmp_path / f"rank{r}.json").exists()
    }
    info = f"exit codes {codes}; records {json.dumps(got, indent=1)}"
    assert codes == [0, 0, 0] and len(got) == 3, info
    in_op, holder, late = got[0], got[1], got[2]
    # Rank 0 was in the op with rank 1: it raises when rank 1's deadline passes (within the
    # native report's 50 ms and the report's window: 0.24 s after it on an idle machine, 1.7 s
    # once with the other pytest worker busy), not when rank 1's Python runs again, at
    # HOLD_SECONDS; and it says that rank 1 timed out, with why its stack is unknown.
    assert in_op["error"] == "CollectiveTimeoutError", info
    assert in_op["at"] < min(DEADLINE + 3.0, HOLD_SECONDS - 1.0), info
    assert "rank 1 timed out first" in in_op["message"] and "held the GIL" in in_op["message"], info
    # Rank 2 came after the fault: refused at once, told the same story; nobody "exited".
    assert late["error"] == "GroupAbortedError", info
    assert late["at"] < LATE + 1.0, info
    assert "rank 1 timed out in all_reduce" in late["message"] and "held the GIL" in late["message"], info
    for rec in got.values():
        assert "exited or was killed" not in rec["message"], info
    # The holder: a timeout, not an abort, raised when it got the GIL back, naming the thread.
    assert holder["error"] == "CollectiveTimeoutError", info
    assert holder["at"] >= HOLD_SECONDS - 0.5, info
    assert (
        "the GIL was held" in holder["message"]
        and "thread 'MainThread', which issued the op" in holder["message"]
    ), info
    # And the job goes on: recovered, one more step, every rank's model the same.
    assert all(rec["equal"] for rec in got.values()), info


def test_when_python_runs_the_timeout_is_rung_from_cpp_without_the_gil_note() -> None:
    """The other side of the native report: when the error's builder gets the GIL in time, C++
    still claims the group's fault and rings the rank's children at once (while Python marks the
    group dead and hands its report to a store thread), and says nothing of the GIL; it posts no
    status (Python's report does). In one process: a watched NCCL double whose "kernel" stalls
    past a 0.3 s deadline, on a group fastdist does not know (its builder makes no report)."""
    import datetime

    import fake_nccl
    import torch
    import torch.distributed as dist
    from fastdist._native import _watched
    from fastdist.errors import GroupAbortedError
    from fastdist.ops import watching
    from fastdist.store import keys

    watching.install()
    store = dist.HashStore()
    gloo = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))
    double = fake_nccl.NcclDouble(gloo)
    b = _watched.WatchedBackend(double, "rung-early", 0.3, True, double._fastdist_stream_marker)
    children = [keys.inbox(1), keys.inbox(2)]
    b.set_native_report(store, "rung-early", 0, 0, 0, "fault", "status", "count", children)
    fake_nccl.configure(delay=2.0)
    try:
        with pytest.raises(GroupAbortedError):
            b.allreduce([torch.ones(1)]).wait()
    finally:
        fake_nccl.configure(delay=0.0)
    # Made when the builder took the GIL, on the thread that would have made the native report
    # (here the builder finds no group, so nothing else writes them).
    store.wait(["fault"], datetime.timedelta(seconds=10))
    claim = json.loads(bytes(store.get("fault")))
    assert (claim["rank"], claim["op"], claim["seq"], claim["state"]) == (0, "all_reduce", 1, "timed_out")
    for inbox in children:
        end = time.monotonic() + 10
        while store.queue_len(inbox) == 0 and time.monotonic() < end:
            time.sleep(0.01)
        assert store.queue_len(inbox) == 1
        rung = json.loads(bytes(store.queue_pop(inbox, False)))
        assert (rung["kind"], rung["group"], rung["root"], rung["op"], rung["seq"]) == (
            "fault",
            "rung-early",
            0,
            "all_reduce",
            1,
        )
        assert "gil" not in rung and "gil" not in claim
    time.sleep(0.4)  # past the native report's 0.2 s: it did not run, so nothing was posted
    assert not b.native_posted(0) and not store.check(["status"])


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]))
