"""The C++ deadline engine, mostly on a fake clock: these run in milliseconds and never flake."""

from __future__ import annotations

import gc
import random
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from fastdist import _core

pytestmark = pytest.mark.timeout(60)

PENDING, COMPLETED, EXPIRED, CANCELLED = _core.PENDING, _core.COMPLETED, _core.EXPIRED, _core.CANCELLED


@pytest.fixture
def eng():
    e = _core.Engine(fake_clock=True)
    yield e
    e.shutdown()


def test_fires_in_deadline_order_and_ties_in_registration_order(eng) -> None:
    fired: list[str] = []
    for name, deadline in [("c", 3.0), ("a", 1.0), ("b1", 2.0), ("b2", 2.0), ("b3", 2.0), ("d", 4.0)]:
        # Tokens are kept alive: a dropped token never fires.
        setattr(
            test_fires_in_deadline_order_and_ties_in_registration_order,
            name,
            eng.add(deadline, lambda n=name: fired.append(n)),
        )
    eng.advance(2.5)
    assert eng.flush(5)
    assert fired == ["a", "b1", "b2", "b3"]
    eng.advance(10)
    assert eng.flush(5)
    assert fired == ["a", "b1", "b2", "b3", "c", "d"]


def test_nothing_fires_before_its_deadline(eng) -> None:
    fired: list[int] = []
    t = eng.add(1.0, lambda: fired.append(1))
    eng.advance(0.999)
    assert eng.flush(5)
    assert fired == [] and t.state == PENDING
    eng.advance(0.001)
    assert eng.flush(5)
    assert fired == [1] and t.state == EXPIRED


def test_cancel_prevents_firing_and_cancel_after_fire_is_a_no_op(eng) -> None:
    fired: list[str] = []
    a = eng.add(1.0, lambda: fired.append("a"))
    b = eng.add(2.0, lambda: fired.append("b"))
    assert a.cancel() is True
    assert a.cancel() is False
    assert a.state == CANCELLED
    eng.advance(3)
    assert eng.flush(5)
    assert fired == ["b"]
    assert b.cancel() is False and b.complete() is False
    assert b.state == EXPIRED
    assert eng.stats()["pending"] == 0


def test_no_double_fire_and_complete_wins_over_later_expiry(eng) -> None:
    count = {"n": 0}

    def bump() -> None:
        count["n"] += 1

    t = eng.add(1.0, bump)
    for _ in range(5):
        eng.advance(1.0)
    assert eng.flush(5)
    assert count["n"] == 1
    u = eng.add(eng.now() + 1.0, bump)
    assert u.complete() is True
    eng.advance(5)
    assert eng.flush(5)
    assert count["n"] == 1 and u.state == COMPLETED and t.state == EXPIRED


def test_dropping_a_token_removes_its_heap_entry(eng) -> None:
    fired: list[int] = []
    t = eng.add(1.0, lambda: fired.append(1))
    assert eng.stats()["pending"] == 1
    del t
    gc.collect()
    assert eng.stats()["pending"] == 0
    eng.advance(2)
    assert eng.flush(5)
    assert fired == []


def test_no_deadline_token_never_expires(eng) -> None:
    t = eng.add(float("inf"))
    eng.advance(1e12)
    assert t.state == PENDING and eng.stats()["pending"] == 0
    assert t.complete() and t.wait() == COMPLETED


def test_a_hundred_thousand_tokens(eng) -> None:
    rng = random.Random(7)
    n = 100_000
    deadlines = [rng.randrange(1, 1000) / 10 for _ in range(n)]
    order: list[int] = []
    tokens = [eng.add(d, lambda i=i: order.append(i)) for i, d in enumerate(deadlines)]
    cancelled = set(rng.sample(range(n), n // 3))
    for i in cancelled:
        assert tokens[i].cancel()
    assert eng.stats()["pending"] == n - len(cancelled)
    for _ in range(20):
        eng.advance(5.0)
    assert eng.flush(30)
    expected = sorted((deadlines[i], i) for i in range(n) if i not in cancelled)
    assert order == [i for _, i in expected]
    assert eng.stats()["pending"] == 0
    assert all(tokens[i].state == (CANCELLED if i in cancelled else EXPIRED) for i in range(n))


def test_waiter_releases_the_gil_and_wakes_on_completion(eng) -> None:
    t = eng.add(10.0)
    result: list[int] = []
    waiter = threading.Thread(target=lambda: result.append(t.wait()))
    waiter.start()
    # While the waiter is blocked, this thread must be able to run Python code.
    spins = 0
    end = time.monotonic() + 0.05
    while time.monotonic() < end:
        spins += 1
    assert spins > 1000 and waiter.is_alive() and result == []
    assert t.complete()
    waiter.join(5)
    assert result == [COMPLETED]


def test_waiter_wakes_at_expiry(eng) -> None:
    t = eng.add(1.0)
    result: list[int] = []
    waiter = threading.Thread(target=lambda: result.append(t.wait()))
    waiter.start()
    eng.advance(1.0)
    waiter.join(5)
    assert result == [EXPIRED]


def test_wait_with_a_timeout_returns_pending(eng) -> None:
    t = eng.add(10.0)
    assert t.wait(0.01) == PENDING


def test_torch_future_completion_wakes_the_waiter(eng) -> None:
    import torch

    fut: torch.futures.Future[int] = torch.futures.Future()
    t = eng.add(10.0)
    fut.add_done_callback(t.notifier())
    threading.Timer(0.02, lambda: fut.set_result(1)).start()
    assert t.wait(5) == COMPLETED and t.work_done


def test_idle_engine_makes_no_timer_wakeups() -> None:
    e = _core.Engine()  # real clock
    t = e.add(e.now() + 3600)  # starts the threads; the earliest deadline is an hour away
    time.sleep(0.3)
    assert e.stats()["timer_wakeups"] == 0
    # A later deadline does not wake the timer; an earlier one does, once.
    keep = [e.add(e.now() + 7200) for _ in range(100)]
    time.sleep(0.05)
    assert e.stats()["timer_wakeups"] == 0
    soon = e.add(e.now() + 0.01)
    assert soon.wait(5) == EXPIRED
    assert 1 <= e.stats()["timer_wakeups"] <= 3
    del t, keep
    e.shutdown()


def test_real_clock_deadline_fires_on_time() -> None:
    e = _core.Engine()
    start = time.monotonic()
    t = e.add(e.now() + 0.1)
    assert t.wait() == EXPIRED
    late = time.monotonic() - start - 0.1
    assert -0.001 < late < 0.5  # goal ~0.1 ms; the slack is for a loaded 2-core machine
    e.shutdown()


def test_many_threads_registering_and_cancelling_stay_correct() -> None:
    e = _core.Engine()
    fired = []
    lock = threading.Lock()
    outcomes: list[tuple[int, int]] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        mine = []
        for i in range(3000):
            key = seed * 10_000 + i
            t = e.add(e.now() + rng.random() * 0.002, lambda k=key: fired.append(k))
            r = rng.random()
            if r < 0.3:
                t.cancel()
            elif r < 0.6:
                t.complete()
            mine.append((key, t))
        for _key, t in mine:
            t.wait(5)
        with lock:
            outcomes.extend((key, t.state) for key, t in mine)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert e.flush(10)
    assert len(outcomes) == 8 * 3000
    assert all(state in (COMPLETED, EXPIRED, CANCELLED) for _, state in outcomes)
    expired = sorted(k for k, s in outcomes if s == EXPIRED)
    assert sorted(fired) == expired  # every expiry ran its action exactly once, nothing else did
    assert e.stats()["pending"] == 0
    e.shutdown()


def test_bad_arguments(eng) -> None:
    with pytest.raises(ValueError, match="deadline must not be NaN"):
        eng.add(float("nan"))
    with pytest.raises(TypeError, match="on_expire must be callable"):
        eng.add(1.0, 5)
    with pytest.raises(ValueError):
        eng.advance(-1)
    with pytest.raises(RuntimeError, match="fake_clock"):
        _core.Engine().advance(1)


def test_an_action_that_raises_does_not_stop_the_engine(eng, monkeypatch) -> None:
    fired: list[int] = []
    reported: list[BaseException] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reported.append(u.exc_value))

    def boom() -> None:
        raise RuntimeError("boom")

    a = eng.add(1.0, boom)
    b = eng.add(2.0, lambda: fired.append(2))
    eng.advance(3)
    assert eng.flush(5)
    assert [str(e) for e in reported] == ["boom"]
    assert fired == [2] and a.state == EXPIRED and b.state == EXPIRED


def _run_script(code: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_fork_leaves_a_working_engine_in_the_child() -> None:
    proc = _run_script(
        """
        import os, sys
        from fastdist import _core
        e = _core.default_engine()
        assert e.add(e.now() + 0.01).wait(5) == _core.EXPIRED   # threads are running
        hold = e.add(e.now() + 3600)                             # a pending token crosses the fork
        pid = os.fork()
        if pid == 0:
            fired = []
            t = e.add(e.now() + 0.05, lambda: fired.append(1))
            ok = t.wait(5) == _core.EXPIRED and e.flush(5) and fired == [1]
            ok = ok and e.stats()["pending"] == 1 and hold.cancel()
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert e.add(e.now() + 0.01).wait(5) == _core.EXPIRED   # the parent's engine still works
        print("ok")
        """
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_interpreter_exit_with_pending_tokens_neither_hangs_nor_crashes() -> None:
    start = time.monotonic()
    proc = _run_script(
        """
        import time
        from fastdist import _core
        d = _core.default_engine()
        f = _core.Engine(fake_clock=True)
        keep = [d.add(d.now() + 3600, lambda: print("never")) for _ in range(1000)]
        keep += [f.add(10.0, lambda: print("never")) for _ in range(1000)]
        # An action that is running (and sleeping, GIL released) when the interpreter exits, and
        # wakes while it finalizes: Python then ends its thread from inside the engine's
        # executor, which must let that unwinding through instead of aborting the process.
        keep.append(d.add(d.now() + 0.01, lambda: time.sleep(0.3)))

        class SlowTeardown:
            def __del__(self):
                time.sleep(0.6)  # runs during finalization, GIL released while it sleeps

        slow = SlowTeardown()
        time.sleep(0.05)
        print("bye")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "bye"
    assert time.monotonic() - start < 10
