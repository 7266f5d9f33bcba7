"""One process of bench/test_report_scale.py: ``sim_report.py PORT FIRST COUNT WORLD``.

Simulates ranks FIRST..FIRST+COUNT-1 of a WORLD-rank group as clients of one TCPStore, running
fastdist's own fault protocol (fastdist.diagnostics.report, fastdist._bell's ring tree) without
a process or a torch group per rank: rank 0 times out and reports; every other rank but the last
(dead: it never answers) is rung, forwards the ring to its children, posts its status and
collects the report, as a rank in the same op does. Prints one JSON line: per simulated rank its
store operations and when it held the report (time.time())."""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import json
import sys
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from fastdist import _bell, diagnostics

BUDGET = 1.0  # the op's timeout: the report window is 0.1 s


class Counting:
    """A store proxy that counts the operations made through it (and through its clones)."""

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
def _own_waiter() -> Iterator[Any]:
    # In a job each rank has its own wait connection (fastdist._bell.waiter); here each simulated
    # rank's thread does.
    _local.counter[0] += 1  # the wait itself
    yield _local.waiter


def main() -> None:
    port, first, count, world = (int(x) for x in sys.argv[1:5])
    timeout = datetime.timedelta(seconds=300)
    # One connection for the short operations of every simulated rank of this process (they are
    # serialized by the client, as one rank's threads would be), and one per simulated rank for
    # its blocking operations: the pop from its inbox, then the wait for the report (a rank's
    # listener and its report each have their own in a job; here both run in one thread, in turn).
    shared = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    # Made in parallel: on some network stacks (gVisor here) about one connect in 25 stalls for 5 s.
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        conns = list(
            pool.map(
                lambda _: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout), range(count)
            )
        )
    ranks = []
    for r, own in zip(range(first, first + count), conns):
        counter = [0]
        st = types.SimpleNamespace(
            store=Counting(shared, counter),
            size=world,
            rank=r,
            name="sim",
            generation=0,
            my_global_rank=r,
            global_rank=lambda x: x,
            ref=lambda: None,  # no torch group behind it: no history, no waits posted
        )
        ranks.append((r, st, counter, own, own))
    _bell.waiter = _own_waiter  # type: ignore[assignment]
    # The report's store work runs in the simulated rank's own thread (in a job it runs in a
    # bounded helper thread: the same store operations, but the per-thread waiters above would
    # not follow it there).
    diagnostics.bounded = lambda fn, seconds, what: fn(threading.Event())  # type: ignore[assignment]
    done: dict[int, float] = {}

    def rung(r: int, st: Any, counter: list[int], listen: Any, wait: Any) -> None:
        _local.counter, _local.waiter = counter, wait
        raw = listen.queue_pop(_bell._inbox(r))
        counter[0] += 1  # the listener's pop
        fault = json.loads(raw)
        for child in _bell._children(st, fault["root"]):
            _bell._deliver(st.store, child, raw.decode())
        status = {
            "rank": r,
            "op": "barrier",
            "seq": 1,
            "state": "in_op",
            "t": time.time(),
            "stack": ["x.py:1 in f"],
        }
        diagnostics.post_status(st, status)
        rep = diagnostics.report(st, "barrier", 1, "aborted", BUDGET, rung=True)
        assert rep is not None, "the report failed"
        done[r] = time.time()

    threads = []
    for r, st, counter, listen, wait in ranks:
        if r in (0, world - 1):
            continue
        t = threading.Thread(target=rung, args=(r, st, counter, listen, wait), daemon=True)
        t.start()
        threads.append(t)
    control = shared
    control.add("ready", 1)
    started = None
    answered = None
    if first == 0:
        control.wait(["fire"], timeout)
        _r, st, counter, _listen, wait = ranks[0]
        _local.counter, _local.waiter = counter, wait
        started = time.time()
        rep = diagnostics.report(st, "barrier", 1, "timed_out", BUDGET)
        assert rep is not None and world - 1 in rep.missing, rep
        done[0] = time.time()
        answered = world - len(rep.missing)  # the dead rank never answers
    for t in threads:
        t.join(120)
    ops = {r: counter[0] for r, _st, counter, _l, _w in ranks if r != world - 1}
    print(json.dumps({"started": started, "done": done, "ops": ops, "answered": answered}))


if __name__ == "__main__":
    main()
