"""A Lightning job as a user writes it, for tests/frameworks/test_frameworks.py: Trainer, DDP on CPU (gloo),
fastdist.lightning.DDPStrategy, a LR scheduler stepped every step, dropout, validation with
``sync_dist`` every 5 steps, and ``accumulate_grad_batches`` 1 and 2. ``--fsdp2``: the model
sharded with FSDP2 in ``configure_model`` under fastdist.lightning.ModelParallelStrategy instead.

    python tests/frameworks/lightning_job.py --out DIR  # Lightning's own launcher starts 3 processes
    torchrun --nproc-per-node 3 tests/frameworks/lightning_job.py --out DIR

Each process fits the same model twice per accumulation setting: undisturbed, then with rank 2
stalling ``--stall`` seconds in its training_step at global step 3 (inside the optimizer step
without accumulation; in the window's first micro-batch, before the step, with it). After each
fit it saves what the test compares to ``DIR/rank{R}-accum{N}-{run}.pt``.

``--kill`` (under ``fastdist run``): rank 2 SIGKILLs itself at global step 7 instead (the second
epoch: the training data shrinks to 5 optimizer steps an epoch, shuffled), once per accumulation
setting, and the replacement ``fastdist run`` starts skips the fits its rank already finished.
Without dropout: a replacement cannot draw the masks the dead rank would have. With ``--fsdp2``
the strategy keeps a copy of each rank's shards on another rank (``snapshot_copies=1``), taken at
every optimizer step's start, which the replacement gets. ``--in-snapshot`` (with ``--fsdp2``):
rank 2 dies inside the exchange of that snapshot at step 7's start instead, after its copy was
sent and its neighbours' received, as it enters the exchange's closing barrier; then rank 1 dies
in the exchange of step 12's snapshot before its copy left: every rank rolls back to step 11's
start and redoes step 11 with the replacement (tests/frameworks/jobs_common.py).

    python -m fastdist.run --nproc-per-node 3 tests/frameworks/lightning_job.py --out DIR --accum 1 2 --kill
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

import fastdist.lightning
import lightning as L
import torch
import torch.nn.functional as F
from jobs_common import die_in_snapshot_exchanges
from torch.utils.data import DataLoader, TensorDataset

STALL_RANK, STALL_STEP = 2, 3
KILL_STEP = 7  # with --kill: in the second epoch (5 optimizer steps an epoch)
EXCHANGE_STEP = 12  # with --in-snapshot: rank 1 dies there before its copy left (a roll-back)


class Net(L.LightningModule):
    def __init__(self, accum: int, stall: float, fsdp2: bool = False, kill: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16),
            torch.nn.Tanh(),
            torch.nn.Dropout(0.0 if kill else 0.2),
            torch.nn.Linear(16, 1),
        )
        self.accum, self.stall, self.stalled, self.fsdp2, self.kill = accum, stall, False, fsdp2, kill

    def configure_model(self) -> None:
        if self.fsdp2:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        x, y = batch
        if (
            self.stall
            and not self.stalled
            and self.global_rank == STALL_RANK
            and self.global_step == (KILL_STEP if self.kill else STALL_STEP)
            and idx % self.accum == 0
        ):
            self.stalled = True
            if not self.kill:
                time.sleep(self.stall)
            elif not os.path.exists(self.kill):  # a marker: the replacement must not die too
                open(self.kill, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(n: int, seed: int, shuffle: bool = False) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4, shuffle=shuffle)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def fit(accum: int, stall: float, steps: int, fsdp2: bool = False, kill: str | None = None) -> dict[str, Any]:
    torch.manual_seed(1)
    model = Net(accum, stall, fsdp2, kill)
    timeouts = {"step_timeout": 2, "collective_timeout": 30, "recover_timeout": 60}
    strategy: Any
    if fsdp2:
        # --kill: a copy of each rank's shards on another rank, for the replacement.
        strategy = fastdist.lightning.ModelParallelStrategy(
            data_parallel_size=3, tensor_parallel_size=1, snapshot_copies=1 if kill else 0, **timeouts
        )
    else:
        strategy = fastdist.lightning.DDPStrategy(**timeouts)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=3,
        strategy=strategy,
        max_steps=steps,
        accumulate_grad_batches=accum,
        val_check_interval=5 * accum,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # --kill: epochs of 10 batches, shuffled (a replacement must follow the epoch's order).
    train = data(3 * steps * accum, 0, shuffle=True) if kill else data(12 * steps * accum, 0)
    trainer.fit(model, train, data(24, 1))
    opt = trainer.optimizers[0]
    return {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "params": {k: _whole(v) for k, v in model.state_dict().items()},
        "momentum": [_whole(opt.state[p]["momentum_buffer"]) for p in model.parameters()],
        "lr": [g["lr"] for g in opt.param_groups],
        "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "fit_loop": trainer.fit_loop.state_dict(),
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "retries": strategy.retries,
        "joined_at": strategy.joined_at,
        "pid": os.getpid(),
        "world": torch.distributed.get_world_size(),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--stall", type=float, default=3.5)
    p.add_argument("--accum", type=int, nargs="+", default=[1, 2])
    p.add_argument("--fsdp2", action="store_true", help="FSDP2: fastdist.lightning.ModelParallelStrategy")
    p.add_argument("--kill", action="store_true", help="rank 2 is SIGKILLed (under fastdist run)")
    p.add_argument(
        "--in-snapshot", action="store_true", help="with --kill --fsdp2: in the snapshot's exchange"
    )
    p.add_argument(
        "--only",
        choices=("undisturbed", "disturbed"),
        default=None,
        help="one of the two fits (FSDP2 under --kill: each fit makes groups of its own, which a "
        "replacement that skips the first fit would not make; so each fit is a launch of its own)",
    )
    args = p.parse_args()
    runs = (("undisturbed", 0.0), ("killed" if args.kill else "stalled", args.stall))
    if args.only is not None:
        runs = runs[:1] if args.only == "undisturbed" else runs[1:]
    rank = os.environ.get("RANK")
    for accum in args.accum:
        marker = os.path.join(args.out, f".killed-accum{accum}") if args.kill else None
        for run, stall in runs:
            if rank is not None and os.path.exists(
                os.path.join(args.out, f"rank{rank}-accum{accum}-{run}.pt")
            ):
                continue  # a replacement: this rank's earlier process finished that fit
            if marker and args.in_snapshot and stall:  # the disturbed fit only
                die_in_snapshot_exchanges(
                    [(KILL_STEP, 2, False, marker), (EXCHANGE_STEP, 1, True, marker + "-before-copy")]
                )
            result = fit(accum, stall, args.steps, args.fsdp2, marker)
            path = os.path.join(args.out, f"rank{result['rank']}-accum{accum}-{run}.pt")
            torch.save(result, path)


if __name__ == "__main__":
    main()
