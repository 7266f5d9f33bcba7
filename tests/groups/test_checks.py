"""Issue 25 item 2: with FASTDIST_CHECK=1, every collective on a watched group is compared across
ranks before it is issued, whoever issues it: torch's own calls and DDP's included. A mismatch is
CollectiveMismatchError on every rank at once (not a timeout after the deadline), and an
all_gather whose sizes differ no longer ends the process inside gloo. The rank code is beside
the assertions (tests/support/rank_main.py runs ``test_checks:mismatch_job``)."""

from __future__ import annotations

import time

import pytest
from mp import describe, run_ranks


def mismatch_job(ctx) -> None:  # type: ignore[no-untyped-def]
    import fastdist
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    ctx.init()
    fastdist.set_checks(True)

    def attempt(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        try:
            with fastdist.fail_after(5):
                fn()
            ctx.record(name, error=None, seconds=time.monotonic() - t0)
        except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
            ctx.record(name, error=type(exc).__name__, message=str(exc), seconds=time.monotonic() - t0)

    t = torch.ones(4)
    # torch's own calls, different ops on the two ranks.
    attempt("ops", lambda: dist.all_reduce(t) if ctx.rank == 0 else dist.broadcast(t, src=0))
    # An all_gather whose sizes differ (gloo would abort the process).
    n = 4 if ctx.rank == 0 else 8
    attempt("sizes", lambda: dist.all_gather([torch.empty(n) for _ in range(2)], torch.ones(n)))
    # Nothing was sent: the group goes on, and DDP's own collectives pass their checks.
    x = torch.ones(2)
    attempt("after", lambda: dist.all_reduce(x))
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    attempt("ddp", lambda: model(torch.full((3, 4), float(ctx.rank + 1))).sum().backward())
    ctx.record(
        "state", sum=float(x.sum()), grad=float(model.module.weight.grad.sum()), dead=fastdist.is_dead()
    )


@pytest.mark.timeout(90)
def test_checks_cover_torch_calls_and_ddp_and_a_size_mismatch_never_kills() -> None:
    results = run_ranks(mismatch_job, 2, timeout=60)
    info = describe(results)
    assert all(r.returncode == 0 for r in results), info  # no SIGABRT inside gloo
    for r in results:
        for name, op in (("ops", "all_reduce" if r.rank == 0 else "broadcast"), ("sizes", "all_gather")):
            rec = r.record(name)
            assert rec["error"] == "CollectiveMismatchError", info
            assert rec["seconds"] < 3.0, info  # at once, not at the 5 s deadline
            assert op in rec["message"], info
        assert "Float[4]" in r.record("sizes")["message"] and "Float[8]" in r.record("sizes")["message"], info
        assert r.record("after")["error"] is None and r.record("ddp")["error"] is None, info
        state = r.record("state")
        assert state["sum"] == 4.0 and not state["dead"], info
    # DDP averaged the gradients: the same on both ranks.
    assert results[0].record("state")["grad"] == pytest.approx(results[1].record("state")["grad"]), info
