"""One process of bench/test_report_scale.py: ``sim_report.py PORT FIRST COUNT WORLD``.

Simulates ranks FIRST..FIRST+COUNT-1 of a WORLD-rank group as clients of one TCPStore, running
fastdist's own protocols without a process or a torch group per rank:

1. The fault report (fastdist.store.board.report, the ring tree of fastdist.store.ring):
   rank 0 times out and reports; every other rank but the last (dead: it never answers) is rung,
   forwards the ring to its children, posts its status and collects the report, as a rank in the same op does.
2. The recovery agreement (fastdist.recovery.agreement._agree) with every rank arriving: generation 1.
3. The agreement again with the last rank absent and ``allow_shrink=True``: generation 2, closed
   by the first deadline.

Each simulated rank has two connections of its own, as a rank in a job has (one for short
operations; one for its blocking waits: the listener's pop, then the report's or agreement's
wait). Prints one JSON line: per phase and simulated rank its store operations, and when it
started and finished (time.time())."""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import json
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from fastdist.groups import pgstate
from fastdist.recovery import agreement as recovery
from fastdist.store import board, keys, keywait, ring

BUDGET = 1.0  # the op's timeout: the report window is 0.1 s plus 5 ms per level of the ring tree
SHRINK_AFTER = 1.0  # phase 3: the agreement's deadline, after its start


class Counting:
    """A store proxy that counts the operations made through it."""

    def __init__(self, inner: Any, counter: list[int]) -> None:
        self.inner = inner
        self.counter = counter

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.inner, name)

        def counted(*args: Any) -> Any:
            self.counter[0] += 1
            return fn(*args)

        return counted


_local = threading.local()


@contextlib.contextmanager
def _own_waiter(store: Any = None) -> Iterator[Any]:
    # In a job each rank has its own wait connection (fastdist.store.keywait.waiter); here each simulated
    # rank's thread does.
    _local.counter[0] += 1  # the wait itself
    yield _local.waiter


def _connect(port: int, n: int) -> list[Any]:
    timeout = datetime.timedelta(seconds=300)
    # Made in parallel: a connect can wait on the resolver (see test_report_scale._SIM_ENV).
    with concurrent.futures.ThreadPoolExecutor(256) as pool:
        return list(
            pool.map(lambda _: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout), range(n))
        )


def main() -> None:
    port, first, count, world = (int(x) for x in sys.argv[1:5])
    control = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=300))
    conns = _connect(port, 2 * count)
    ranks = []
    for i, r in enumerate(range(first, first + count)):
        counter = [0]
        # No torch group behind it: plain data, the agreement's and the board's (no history: the
        # waits are made up below).
        st = recovery.Party(Counting(conns[2 * i], counter), "sim", r, world)
        ranks.append((r, st, counter, conns[2 * i + 1]))
    posted = {r: board.Posts() for r, *_ in ranks}  # each simulated rank's, as its lineage keeps it
    keywait.waiter = _own_waiter  # type: ignore[assignment]
    # The store work runs in the simulated rank's own thread (in a job it runs in a bounded
    # helper thread: the same store operations, but the per-thread waiters above would not
    # follow it there).
    inline = lambda fn, seconds, what: fn(threading.Event())
    board.bounded = inline  # type: ignore[assignment]
    phases: dict[str, dict[str, dict[int, float]]] = {
        p: {"start": {}, "done": {}, "ops": {}, "rung": {}} for p in ("report", "agree", "shrink")
    }

    def timed(phase: str, r: int, counter: list[int], fn: Any) -> Any:
        before = counter[0]
        phases[phase]["start"][r] = time.time()
        out = fn()
        phases[phase]["done"][r] = time.time()
        phases[phase]["ops"][r] = counter[0] - before
        return out

    def rung(r: int, st: Any, counter: list[int], blocking: Any) -> None:
        raw = blocking.queue_pop(keys.inbox(r))
        counter[0] += 1  # the listener's pop
        phases["report"]["rung"][r] = time.time()
        fault = json.loads(raw)
        for child in ring.children(r, fault["root"], world, None, frozenset()):
            ring.deliver(st.store, child, raw.decode())
        # A seat of its own, as GroupState.seat makes one, less what a simulated rank has not: op
        # history (its waits are made up), backends, ring children (rung, it rings nobody). With
        # st.seat() here instead, the ring reached the last rank about 20 ms later in 4 runs of 4
        # and some ranks posted after the window, though st.seat() took 6 us (median) a call:
        # 256 ranks share a GIL here, and what costs that is not understood.
        waits = [[s, 900 + (r * 7 + s * 13) % 200] for s in range(1, pgstate.WAITS_KEPT + 1)]
        seat = board.Seat(st.store, "sim", 0, r, world, posted=posted[r], waits=waits)
        status = seat.status("barrier", 1, "in_op", stack=["train.py:88 in main", "train.py:57 in step"])
        if board.post_status(seat, status):
            board.publish(seat)
        rep = board.report(seat, "barrier", 1, "aborted", BUDGET, rung=True)
        assert rep is not None and world - 1 in rep.missing, rep

    def run_rank(r: int, st: Any, counter: list[int], blocking: Any) -> None:
        _local.counter, _local.waiter = counter, blocking
        # Control waits go on the rank's blocking connection (uncounted): a wait holds its client,
        # and the control connection is shared by every simulated rank of this process.
        if r == 0:
            blocking.wait(["fire"])
            rep = timed(
                "report",
                r,
                counter,
                lambda: board.report(
                    board.Seat(
                        st.store,
                        "sim",
                        0,
                        0,
                        world,
                        posted=posted[0],
                        children=ring.children(0, 0, world, None),
                    ),
                    "barrier",
                    1,
                    "timed_out",
                    BUDGET,
                ),
            )
            assert rep is not None and world - 1 in rep.missing, rep
            answered[0] = world - len(rep.missing)  # the dead rank never answers
        elif r != world - 1:
            timed("report", r, counter, lambda: rung(r, st, counter, blocking))
        control.add("reported", 1)
        blocking.wait(["agree"])
        deadline = recovery.current_time() + 60
        members = timed("agree", r, counter, lambda: recovery._agree(st.store, st, 1, deadline, False))
        assert members == list(range(world)), members[:8]
        control.add("agreed", 1)
        if r == world - 1:
            return  # absent from generation 2
        blocking.wait(["shrink"])
        deadline = float(control.get("shrink_deadline"))
        deadline = recovery.current_time() + (deadline - time.time())
        members = timed("shrink", r, counter, lambda: recovery._agree(st.store, st, 2, deadline, True))
        assert members == list(range(world - 1)), members[:8]

    answered = [None]
    threads = [threading.Thread(target=run_rank, args=rank, daemon=True) for rank in ranks]
    for t in threads:
        t.start()
    control.add("ready", 1)
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a simulated rank did not finish"
    print(json.dumps(dict(phases, answered=answered[0])))


if __name__ == "__main__":
    main()
