"""The ranks of tests/ops/test_every_op.py: every collective and point-to-point op, healthy and timed out."""

from __future__ import annotations

import fastdist
import torch
import torch.distributed as dist


def every_op(ctx) -> None:
    """Every wrapper once on 3 ranks (and a subgroup), with the results torch would give."""
    ctx.init()
    rank, ws = ctx.rank, ctx.world_size
    T = 20
    t = torch.tensor([float(rank + 1)])
    fastdist.all_reduce(t, timeout=T)
    assert t.item() == sum(range(1, ws + 1)), t
    t = torch.tensor([float(rank + 1)])
    fastdist.all_reduce(t, dist.ReduceOp.MAX, timeout=T)
    assert t.item() == ws
    t = torch.tensor([float(rank + 1)])
    fastdist.reduce(t, dst=1, timeout=T)
    if rank == 1:
        assert t.item() == sum(range(1, ws + 1))
    t = torch.tensor([float(rank * 7)])
    fastdist.broadcast(t, src=2, timeout=T)
    assert t.item() == 14.0
    out = torch.zeros(ws * 2)
    fastdist.all_gather_into_tensor(out, torch.tensor([float(rank), float(rank)]), timeout=T)
    assert out.tolist() == [float(r) for r in range(ws) for _ in range(2)]
    out = torch.zeros(1)
    fastdist.reduce_scatter_tensor(out, torch.arange(ws, dtype=torch.float32), timeout=T)
    assert out.item() == float(rank * ws)
    gl = [torch.zeros(1) for _ in range(ws)] if rank == 0 else None
    fastdist.gather(torch.tensor([float(rank)]), gl, dst=0, timeout=T)
    if rank == 0:
        assert [g.item() for g in gl] == [0.0, 1.0, 2.0]
    mine = torch.zeros(1)
    fastdist.scatter(
        mine, [torch.tensor([float(r * 3)]) for r in range(ws)] if rank == 1 else None, src=1, timeout=T
    )
    assert mine.item() == rank * 3
    o = torch.zeros(ws)
    fastdist.all_to_all_single(o, torch.tensor([float(rank * 10 + r) for r in range(ws)]), timeout=T)
    assert o.tolist() == [float(r * 10 + rank) for r in range(ws)], o
    # point to point: a ring
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    got = torch.zeros(1)
    if rank % 2 == 0:
        fastdist.send(torch.tensor([float(rank)]), nxt, timeout=T)
        src = fastdist.recv(got, prv, timeout=T)
    else:
        src = fastdist.recv(got, prv, timeout=T)
        fastdist.send(torch.tensor([float(rank)]), nxt, timeout=T)
    assert got.item() == prv and src == prv
    got2 = torch.zeros(1)
    hs = fastdist.batch_isend_irecv(
        [dist.P2POp(dist.isend, torch.tensor([float(rank)]), nxt), dist.P2POp(dist.irecv, got2, prv)],
        timeout=T,
    )
    assert all(h.wait() for h in hs) and got2.item() == prv
    # torch's own batch: coalesced into one work where the backend coalesces (NCCL, its double),
    # not issued send by send (a large symmetric exchange can deadlock on NCCL).
    coalesces = (
        dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).supports_coalescing
    )
    assert len(hs) == (1 if coalesces else 2), (len(hs), coalesces)
    h1 = fastdist.isend(torch.tensor([5.0 + rank]), nxt, timeout=T)
    got3 = torch.zeros(1)
    h2 = fastdist.irecv(got3, prv, timeout=T)
    assert h2.wait() and h1.wait() and got3.item() == 5.0 + prv
    # async collectives and fastdist.wait on torch's own work
    t = torch.tensor([1.0])
    h = fastdist.all_reduce(t, async_op=True, timeout=T)
    assert h.wait(5) is True and t.item() == ws and h.is_completed() and h.exception() is None
    raw = dist.all_reduce(torch.ones(1), async_op=True)
    assert fastdist.wait(raw, timeout=T) is True
    # objects
    objs = [None] * ws
    fastdist.all_gather_object(objs, {"rank": rank, "data": "x" * rank}, timeout=T)
    assert objs == [{"rank": r, "data": "x" * r} for r in range(ws)]
    gathered = [None] * ws if rank == 2 else None
    fastdist.gather_object(("r", rank), gathered, dst=2, timeout=T)
    if rank == 2:
        assert gathered == [("r", r) for r in range(ws)]
    lst = [{"a": 1}, [1, 2, 3], "hello"] if rank == 0 else [None, None, None]
    fastdist.broadcast_object_list(lst, src=0, timeout=T)
    assert lst == [{"a": 1}, [1, 2, 3], "hello"]
    outo = [None]
    fastdist.scatter_object_list(
        outo, [f"for {r}" * (r + 1) for r in range(ws)] if rank == 0 else None, src=0, timeout=T
    )
    assert outo == [f"for {rank}" * (rank + 1)]
    # a subgroup of ranks 1 and 2 (every rank calls new_group)
    sub = dist.new_group([1, 2])
    if rank in (1, 2):
        t = torch.tensor([float(rank)])
        fastdist.all_reduce(t, group=sub, timeout=T)
        assert t.item() == 3.0
        t = torch.tensor([float(rank)])
        fastdist.broadcast(t, src=2, group=sub, timeout=T)
        assert t.item() == 2.0
    assert fastdist.barrier(timeout=T)
    ctx.record("ok")
