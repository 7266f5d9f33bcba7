"""FSDP2 with fastdist.PeerSnapshot, for tests/recovery/test_snapshot.py, under
``fastdist run --nproc-per-node 4 --spares 1`` (world 3 and a spare): snapshots every 2 steps,
12 steps with a fixed data order, the ranks of ``--kill-ranks`` (default 1) SIGKILLed in their
forward at ``--kill-step`` (once: a marker file each), or with ``--kill-in-snapshot S`` during the
snapshot of step S, after sending their own copy and before the snapshot counts (the previous
snapshot must be used). The spare takes rank 1's place with the copy of its shards that rank 2
holds, every rank rolls back to the last snapshot and trains on. Then every process trains the
same model again, undisturbed, and saves both runs' full parameters and momentum to
``OUT/rank{R}.pt``. ``--copies`` is PeerSnapshot's; ``--ddp`` trains the same model under DDP
with the same script (nothing to copy: a joiner gets a live rank's state, no roll-back).
``--hsdp`` shards over a 2 x N mesh (replicate x shard): a joiner gets its predecessor's shards from
its replica, nothing is copied and nothing rolls back.
``--checkpoint DIR --checkpoint-every M`` saves a DCP checkpoint every M steps; ``--resume`` loads
it first (a restart, when memory held no copy).
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

import fastdist
import torch
from fastdist.examples.train_ddp import Progress
from fastdist.recovery import snapshot, state_sync
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

STEPS = 12
KILL_STEP = [-1]  # --kill-step, for train()


def build(mesh: Any, ddp: bool = False) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        fully_shard(model, mesh=mesh)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + rank))


def train(
    model: Any, opt: Any, progress: Progress, rank: int, snap: Any = None, state: Any = None, ckpt: Any = None
) -> None:
    """``ckpt``: (directory, every): a checkpoint on disk every that many steps."""
    while progress.step < STEPS:
        if snap is not None and progress.step == KILL_STEP[0]:
            # The kill in this step comes after the last snapshot counted everywhere (its exchange
            # runs on a thread and may still be in flight on a loaded machine); a kill during an
            # exchange is the --kill-in-snapshot case.
            snap.wait()
        try:
            with fastdist.fail_after(5):
                opt.zero_grad()
                model(batch(progress.step, rank)).pow(2).mean().backward()
                opt.step()
            progress.step += 1
            if snap is not None:
                snap.step(progress.step)
            if ckpt is not None and progress.step % ckpt[1] == 0:
                fastdist.save_checkpoint(state, ckpt[0], timeout=30)
        except fastdist.FastdistError as err:
            print(f"rank {rank}: step {progress.step} failed: {type(err).__name__}", flush=True)
            try:
                fastdist.recover(timeout=60, state=state, snapshot=snap)
            except fastdist.RecoveryError as failed:
                print(f"rank {rank}: recovery failed: {failed}", flush=True)
                raise
            print(f"rank {rank}: recovered; rolled back to step {snap.restored_step}", flush=True)


def full(model: Any, opt: Any) -> dict[str, Any]:
    """Every parameter and momentum buffer whole (all-gathered: every rank calls it)."""
    return {
        "params": {k: _whole(v) for k, v in model.state_dict().items()},
        "momentum": [_whole(opt.state[p]["momentum_buffer"]) for p in model.parameters()],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--kill-step", type=int, default=7)
    p.add_argument("--kill-in-snapshot", type=int, default=-1)
    p.add_argument("--kill-ranks", default="1", help="the ranks killed, comma-separated")
    p.add_argument("--copies", type=int, default=1)
    p.add_argument("--ddp", action="store_true", help="DDP instead of FSDP2: nothing to copy")
    p.add_argument("--hsdp", action="store_true", help="a 2 x N mesh, replicate x shard: no copy either")
    p.add_argument("--checkpoint", default="", help="a DCP checkpoint's directory")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save it every N steps")
    p.add_argument("--resume", action="store_true", help="load it first (a restart)")
    args = p.parse_args()
    KILL_STEP[0] = args.kill_step if args.kill_in_snapshot < 0 else -1
    fastdist.init_process_group("gloo")  # a spare returns once it holds a dead rank's slot
    rank = fastdist.get_rank()
    world = fastdist.get_world_size()
    if args.hsdp:  # HSDP: rank r's shards are also on its replica, rank (r + world / 2) % world
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    model, opt = build(mesh, args.ddp)
    progress = Progress()
    state = {"model": model, "optim": opt, "progress": progress}
    available = snapshot._available_bytes
    snapshot._available_bytes = lambda: 1000  # a host without room: refused before anything is made
    try:
        fastdist.PeerSnapshot(state, every=2, copies=1)
    except MemoryError as err:
        print(f"rank {rank}: refused: {err}", flush=True)
    snapshot._available_bytes = available
    snap = fastdist.PeerSnapshot(state, every=2, copies=args.copies)
    joined = fastdist.sync_state(state, timeout=60, snapshot=snap)
    if joined:
        print(
            f"rank {rank}: joined at step {progress.step} (snapshot of step {snap.restored_step})", flush=True
        )
    if args.resume:
        fastdist.load_checkpoint(state, args.checkpoint, timeout=30)
        print(f"rank {rank}: resumed from the checkpoint of step {progress.step}", flush=True)
    marker = os.path.join(args.out, f".killed{rank}")
    if str(rank) in args.kill_ranks.split(",") and not os.path.exists(marker):

        def die(*_: Any) -> None:
            if progress.step == args.kill_step:
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)

        if args.kill_in_snapshot < 0:
            (model.module if args.ddp else model)[1].register_forward_hook(die)
        else:
            exchange = snap._exchange

            def dying_exchange(step: int, own: Any, deadline: float, epoch: int) -> Any:
                if step == args.kill_in_snapshot:  # on the snapshot's own thread
                    packed = state_sync.Packed(own, torch.device("cpu"))
                    works = [w for h in snap.holders[rank] for w in packed.isend(h, snap.group)]
                    for w in works:
                        w.wait()  # its copy reached its holder; the snapshot has not counted yet
                    open(marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
                return exchange(step, own, deadline, epoch)

            snap._exchange = dying_exchange  # type: ignore[method-assign]
    ckpt = (args.checkpoint, args.checkpoint_every) if args.checkpoint_every else None
    train(model, opt, progress, rank, snap, state, ckpt)
    disturbed = full(model, opt)
    held = snap.bytes_held()
    model2, opt2 = build(mesh, args.ddp)
    train(model2, opt2, Progress(), rank)
    torch.save(
        {
            "disturbed": disturbed,
            "undisturbed": full(model2, opt2),
            "restored": snap.restored_step,
            "joined": joined,
            "bytes_held": held,
            "step": progress.step,
        },
        os.path.join(args.out, f"rank{rank}.pt"),
    )
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    main()
