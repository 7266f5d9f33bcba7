"""One rank of bench/test_snapshot.py: RANK PORT WORLD MEGABYTES ROUNDS EVERY OUT.

FSDP2 (a 1-D mesh over every rank) on a model of square Linear layers of MEGABYTES in all, SGD
with momentum. Measured in the same processes, in turn:
- a block of EVERY steps without a snapshot against a block of EVERY steps starting with one
  (``snap.step``: the own copy there, the exchange on its thread while the block goes on, waited
  for at the block's end), and a block whose snapshot's exchange runs on the training thread
  (``snap.take``), ROUNDS of each;
- a snapshot's exchange (``snap.take``) against raw gloo sends of the same bytes on the same
  pattern (each rank to its holder, from its keeper);
- rolling back to the snapshot (``snap.load`` of its own copy) against ``dcp.load`` of the same
  state from a checkpoint on local disk (the state part of a restart).
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
import tempfile
import time

import fastdist
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fastdist.recovery import state_sync
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class App:
    """The model and optimizer as one DCP Stateful."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict:
        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, sd: dict) -> None:
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def main() -> None:
    rank, port, world, megabytes, rounds, every = (int(a) for a in sys.argv[1:7])
    out = sys.argv[7]
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, datetime.timedelta(seconds=300))
    fastdist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    side = 1024
    layers = max(1, (megabytes << 20) // (side * side * 4))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(layers)])
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    state = {"model": model, "optim": opt}
    snap = fastdist.PeerSnapshot(state, every=every, copies=1)
    x = torch.randn(16, side, generator=torch.Generator().manual_seed(rank))

    def one_step() -> None:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    for _ in range(3):
        one_step()
    step, plain, with_snap, in_line = 0, [], [], []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(every):
            one_step()
        plain.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(every):
            one_step()
            snap.step(step)  # one snapshot, at the block's first step: its exchange overlaps the rest
            step += 1
        snap.wait()  # the exchange counted: all of its cost is inside the block
        with_snap.append(time.perf_counter() - t0)
        assert snap.latest() == step - every, (snap.latest(), step)
        dist.barrier()
        t0 = time.perf_counter()
        for k in range(every):
            one_step()
            if k == 0:
                snap.take(step)  # the same snapshot with its exchange on the training thread
            step += 1
        in_line.append(time.perf_counter() - t0)

    # The exchange against raw gloo sends of the same bytes, on the same pattern.
    own = snap._own_copy()
    packed = state_sync.Packed(own, torch.device("cpu"))
    flat = torch.empty(packed.nbytes, dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([packed.nbytes]))
    exchange, raw = [], []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        snap.take(step)  # the exchange here, on this thread
        exchange.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        works = [dist.isend(flat, h) for h in snap.holders[rank]]
        for k in snap.keeps:
            dist.recv(torch.empty(int(sizes[k].item()), dtype=torch.uint8), k)
        for w in works:
            w.wait()
        dist.barrier()
        raw.append(time.perf_counter() - t0)

    # Rolling back to the snapshot against loading a DCP checkpoint from local disk.
    with tempfile.TemporaryDirectory() as tmp:
        path = [tmp]
        dist.broadcast_object_list(path, 0)  # one directory, rank 0's (a local disk shared here)
        dcp.save({"app": App(model, opt)}, checkpoint_id=path[0])
        roll, load = [], []
        for _ in range(rounds):
            dist.barrier()
            t0 = time.perf_counter()
            snap.load(snap.copy_of(step, rank))
            dist.barrier()
            roll.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            dcp.load({"app": App(model, opt)}, checkpoint_id=path[0])
            dist.barrier()
            load.append(time.perf_counter() - t0)
        dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    "state_mb_per_rank": packed.nbytes / 2**20,
                    "every": every,
                    "block_plain_ms": statistics.median(plain) * 1e3,
                    "block_snapshot_ms": statistics.median(with_snap) * 1e3,
                    "block_inline_ms": statistics.median(in_line) * 1e3,
                    "exchange_ms": statistics.median(exchange) * 1e3,
                    "raw_send_ms": statistics.median(raw) * 1e3,
                    "rollback_ms": statistics.median(roll) * 1e3,
                    "dcp_load_ms": statistics.median(load) * 1e3,
                    "bytes_held": snap.bytes_held(),
                },
                f,
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
