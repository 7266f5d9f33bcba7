"""A Fabric loop as a user writes it, for tests/frameworks/test_frameworks.py:
``python tests/frameworks/fabric_job.py --out DIR`` (Fabric's own launcher starts 3 processes). CPU (gloo),
fastdist.lightning.FabricDDPStrategy, gradient accumulation over 2 micro-batches with
``no_backward_sync``, dropout, a LR scheduler, each micro-batch in ``fastdist.run_step`` and
``fabric.all_reduce`` of the loss after it.

Each process trains twice: undisturbed, then with rank 2 stalling ``--stall`` s in the last
micro-batch of optimizer step 3. After each run it saves what the test compares to
``DIR/rank{R}-{run}.pt``.

``--kill`` (under ``fastdist run``): one fastdist step per accumulation window (both micro-batches
in it), the loop's position handed over with the model, and rank 2 SIGKILLs itself in the first
micro-batch of window 3, once; the replacement joins with ``fastdist.sync_state``, draws the
windows done from its loader and trains on. No dropout: a replacement cannot draw the dead rank's
masks. Runs ``undisturbed`` and ``killed`` (a replacement skips the runs its rank finished).

    python -m fastdist.run --nproc-per-node 3 tests/frameworks/fabric_job.py --out DIR --kill

``--kill --fsdp2``: the same with FSDP2 (fastdist.lightning.FabricModelParallelStrategy,
``fully_shard`` in its ``parallelize_fn``) and a ``fastdist.PeerSnapshot`` of each step's start
taken by ``run_step``: the replacement gets its predecessor's shards from the copy rank 0 holds,
every rank redoes window 3 from its start; rank 1 then stalls 3 s in window 6 (a recovery that
rolls nothing back), dies in the exchange of window 9's snapshot after its copy left (window 9 is
redone), and rank 2 dies in window 12's before its copy left (every rank rolls back to window 11's
start and redoes it with the replacement, the live ranks' own state put back after it). The killed
run comes first, so that every process (the replacement too) makes the same groups (each
PeerSnapshot makes one).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

import fastdist
import fastdist.lightning
import torch
import torch.nn.functional as F
from fastdist.examples.train_ddp import Progress
from jobs_common import die_in_snapshot_exchanges, result
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

STALL_RANK, STALL_STEP, STEPS, ACCUM = 2, 3, 20, 2
# --kill --fsdp2: rank 1 dies in the exchange of window 9's snapshot after its copy left (window 9
# is redone), rank 2 in window 12's before its copy left (every rank redoes window 11, then 12).
EXCHANGE_AFTER, EXCHANGE_BEFORE = 9, 12


def train(fabric: Fabric, stall: float) -> dict[str, Any]:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)]
    net = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    model, fopt = fabric.setup(net, opt)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * 3 * STEPS * ACCUM, 8, generator=g)
    loader = fabric.setup_dataloaders(
        DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4)
    )
    torch.manual_seed(1 + fabric.global_rank)
    stalled, calls, losses = False, 0, []
    for i, (xb, yb) in enumerate(loader):
        last = (i + 1) % ACCUM == 0

        def step(i: int = i, xb: torch.Tensor = xb, yb: torch.Tensor = yb, last: bool = last) -> torch.Tensor:
            nonlocal stalled, calls
            calls += 1
            if stall and not stalled and fabric.global_rank == STALL_RANK and i == STALL_STEP * ACCUM + 1:
                stalled = True
                time.sleep(stall)
            with fabric.no_backward_sync(model, enabled=not last):
                loss = F.mse_loss(model(xb), yb)
                fabric.backward(loss / ACCUM)
            if last:
                fopt.step()
                fopt.zero_grad()
                sched.step()
            return loss.detach()

        loss = fastdist.run_step(step, timeout=2, optimizers=[fopt], keep_grads=True)
        losses.append(fabric.all_reduce(loss, reduce_op="sum").item())  # bounded by collective_timeout
    return result(fabric.global_rank, net, opt, sched.last_epoch, losses, retries=calls - len(loader))


def train_windows(fabric: Fabric, kill: str | None, fsdp2: bool = False) -> dict[str, Any]:
    """One fastdist step per accumulation window; ``kill``: the marker of rank 2's death.
    ``fsdp2``: the model sharded by the strategy's parallelize_fn, a PeerSnapshot of every step's
    start taken by run_step, and (with ``kill``) rank 1 stalling 3 s in window 6 too."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    if fsdp2:
        model = fabric.setup_module(net)  # fully_shard, in the strategy's parallelize_fn
        fopt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        opt = fopt.optimizer
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        model, fopt = fabric.setup(net, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * 3 * STEPS * ACCUM, 8, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True).sin())
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=4))
    progress = Progress()  # optimizer steps done: one a window
    state = {"model": net, "optim": opt, "sched": sched, "progress": progress}
    snap = fastdist.PeerSnapshot(state, every=1, copies=1) if fsdp2 else None
    joined = progress.step if fastdist.sync_state(state, snapshot=snap) else None  # a replacement: its step
    batches = iter(loader)
    for _ in range(progress.step * ACCUM):  # a replacement draws the windows done
        next(batches)
    losses, stalled = [], False
    while progress.step < STEPS:
        window = [next(batches) for _ in range(ACCUM)]

        def step(window: list[Any] = window) -> torch.Tensor:
            nonlocal stalled
            for j, (xb, yb) in enumerate(window):
                dies = kill and fabric.global_rank == STALL_RANK and progress.step == STALL_STEP and j == 0
                if dies and not os.path.exists(kill):  # once: the replacement must live
                    open(kill, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
                if fsdp2 and kill and fabric.global_rank == 1 and progress.step == 6 and not stalled:
                    stalled = True
                    time.sleep(3)
                with fabric.no_backward_sync(model, enabled=j < ACCUM - 1):
                    loss = F.mse_loss(model(xb), yb)
                    fabric.backward(loss / ACCUM)
            fopt.step()
            fopt.zero_grad()
            sched.step()
            return loss.detach()

        # keep_grads: a redone window starts from the gradients it started with (none).
        n = progress.step
        loss = fastdist.run_step(
            step, timeout=2, optimizers=[fopt], keep_grads=True, state=state, snapshot=snap, step_number=n
        )
        progress.step += 1
        losses.append(fabric.all_reduce(loss, reduce_op="sum").item())
    out = result(fabric.global_rank, net, opt, sched.last_epoch, losses, joined=joined, pid=os.getpid())
    if fsdp2:  # the shards gathered: every rank's whole model, as DDP's
        out["params"] = {k: _full(v) for k, v in net.state_dict().items()}
        out["momentum"] = [_full(opt.state[p]["momentum_buffer"]) for p in net.parameters()]
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor().detach().clone()  # type: ignore[attr-defined]


def _parallelize(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--stall", type=float, default=3.5)
    p.add_argument("--kill", action="store_true", help="rank 2 is SIGKILLed (under fastdist run)")
    p.add_argument("--fsdp2", action="store_true", help="FSDP2 and a PeerSnapshot (with --kill)")
    args = p.parse_args()
    if args.fsdp2:
        strategy = fastdist.lightning.FabricModelParallelStrategy(
            parallelize_fn=_parallelize, data_parallel_size=3, tensor_parallel_size=1, collective_timeout=30
        )
    else:
        strategy = fastdist.lightning.FabricDDPStrategy(collective_timeout=30)
    fabric = Fabric(accelerator="cpu", devices=3, strategy=strategy)
    fabric.launch()
    if args.fsdp2:
        marker = os.path.join(args.out, ".killed")
        if args.kill:  # and two deaths in the exchanges of step-start snapshots, in the killed run
            after, before = marker + "-after-copy", marker + "-before-copy"
            die_in_snapshot_exchanges([(EXCHANGE_AFTER, 1, False, after), (EXCHANGE_BEFORE, 2, True, before)])
        for run in ("killed", "undisturbed"):  # killed first: the same groups on every process
            path = os.path.join(args.out, f"rank{fabric.global_rank}-{run}.pt")
            torch.save(train_windows(fabric, marker if run == "killed" else None, fsdp2=True), path)
        return
    if args.kill:
        marker = os.path.join(args.out, ".killed")
        for run in ("undisturbed", "killed"):
            path = os.path.join(args.out, f"rank{fabric.global_rank}-{run}.pt")
            if not os.path.exists(path):  # a replacement skips the runs its rank finished
                torch.save(train_windows(fabric, marker if run == "killed" else None), path)
        return
    for run, stall in (("undisturbed", 0.0), ("stalled", args.stall)):
        result = train(fabric, stall)
        torch.save(result, os.path.join(args.out, f"rank{result['rank']}-{run}.pt"))


if __name__ == "__main__":
    main()
