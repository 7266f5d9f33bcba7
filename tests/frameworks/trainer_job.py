"""A Hugging Face Trainer job as a user writes it, for tests/frameworks/test_frameworks.py's Trainer test:
``python -m fastdist.run --nproc-per-node 3 tests/frameworks/trainer_job.py --out DIR``. A tiny GPT-2 built
from its config (no download; its default dropout, 0.1: a replacement draws the masks its
predecessor would have, fastdist.recovery.randomness), CPU
(gloo), ``gradient_accumulation_steps=2`` (the Trainer gathers the window's token count before
it, a collective outside the step), a linear LR schedule with warm-up, SGD with momentum, the
Trainer's shuffled sampler, logging every 2 steps and an evaluation every 4 (collectives at the
end of a step).

Each process trains twice: ``undisturbed``, then ``faulted``: rank 1 stalls ``--stall`` s in the
last micro-batch of optimizer step 3 (recovered in place; the step is redone), and rank 2
SIGKILLs itself in the first micro-batch of step 6 and again (the replacement) in the evaluation
after step 8's update (once each: marker files), replaced by ``fastdist run`` each time; a
replacement is handed the live ranks' state, joins what they were redoing (the step, or the
evaluation) and goes on. A checkpoint is saved at step 5 and 10; rank 0 SIGKILLs itself inside the
save of step 10's (its model, optimizer and scheduler written, the RNG states and the Trainer's
state not): the live ranks' barrier after the save fails, the step's saving is redone with its
replacement, and the checkpoint ends whole.
After each run a rank saves what the test compares to ``DIR/rank{R}-{run}.pt`` (a replacement
skips the runs its rank finished).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

import fastdist.transformers
import torch
import transformers
from jobs_common import result

STEPS, ACCUM, STALL_STEP, KILL_STEP, KILL_EVAL, KILL_SAVE = 10, 2, 3, 6, 8, 10


class Faulty(fastdist.transformers.Trainer):
    """The user's Trainer; rank 1 stalls in the last micro-batch of STALL_STEP (once), rank 2
    dies in the first micro-batch of KILL_STEP and in the evaluation after step KILL_EVAL's update
    (once each: markers; the replacements must live)."""

    def __init__(self, *args: Any, marker: str | None, stall: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.marker, self.stall, self.calls, self.stalled = marker, stall, 0, False
        self.step, self.micro = -1, 0

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        self.calls += 1
        step, rank = self.state.global_step, torch.distributed.get_rank()
        self.micro = self.micro + 1 if step == self.step else 0  # a redo's go on counting
        self.step, micro = step, self.micro
        if self.marker is not None:
            if rank == 1 and step == STALL_STEP and micro == ACCUM - 1 and not self.stalled:
                self.stalled = True
                time.sleep(self.stall)
            if rank == 2 and step == KILL_STEP and micro == 0 and not os.path.exists(self.marker):
                open(self.marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(model, inputs, num_items_in_batch)

    def _save_rng_state(self, output_dir: str) -> None:
        # Rank 0 dies inside the save of the last step's checkpoint, once: the model, optimizer and
        # scheduler written, its RNG state and the Trainer's state not (a checkpoint half-written).
        marker = f"{self.marker}-save"
        here = torch.distributed.get_rank() == 0 and self.state.global_step == KILL_SAVE
        if self.marker and here and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        super()._save_rng_state(output_dir)

    def prediction_step(self, *args: Any, **kwargs: Any) -> Any:
        rank, marker = torch.distributed.get_rank(), f"{self.marker}-eval"
        if self.marker and rank == 2 and self.state.global_step == KILL_EVAL and not os.path.exists(marker):
            open(marker, "w").close()  # in the evaluation after step KILL_EVAL's update
            os.kill(os.getpid(), signal.SIGKILL)
        return super().prediction_step(*args, **kwargs)


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (n, 12), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(out: str, run: str, marker: str | None, stall: float) -> dict[str, Any]:
    # GPT2Config's default dropout (0.1): each replacement draws the masks its predecessor would
    # have, from the random state it published at the start of the step redone.
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out, f"trainer-{run}"),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=ACCUM,
        max_steps=STEPS,
        learning_rate=0.05,
        lr_scheduler_type="linear",
        warmup_steps=2,
        optim="sgd",
        optim_args="momentum=0.9",
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=4,
        save_strategy="steps",
        save_steps=5,
        report_to=[],
        seed=7,
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
    )
    trainer = Faulty(
        model=model,
        args=args,
        train_dataset=Data(3 * 2 * ACCUM * STEPS, 1),
        eval_dataset=Data(24, 2),
        step_timeout=2.0,
        marker=marker,
        stall=stall,
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    return result(
        torch.distributed.get_rank(), model, opt, trainer.state.global_step, losses,
        evals=evals, pid=os.getpid(), joined=trainer.joined_at, calls=trainer.calls,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--stall", type=float, default=3.5)
    args = p.parse_args()
    fastdist.transformers.init_process_group(timeout=77)
    for run in ("undisturbed", "faulted"):
        path = os.path.join(args.out, f"rank{os.environ['RANK']}-{run}.pt")
        if not os.path.exists(path):
            marker = os.path.join(args.out, ".killed") if run == "faulted" else None
            torch.save(train(args.out, run, marker, args.stall), path)


if __name__ == "__main__":
    main()
