"""fastdist for the Hugging Face Trainer: a Trainer whose optimizer steps are redone in place
after a fault, and whose dead workers are replaced under ``fastdist run``::

    import fastdist.transformers
    import transformers

    fastdist.transformers.init_process_group(timeout=600)   # before TrainingArguments
    args = transformers.TrainingArguments(output_dir="out", gradient_accumulation_steps=4, ...)
    trainer = fastdist.transformers.Trainer(model=model, args=args, train_dataset=data,
                                            step_timeout=60)
    trainer.train()

launched with ``fastdist run --nproc-per-node 8 train.py`` (a dead worker is replaced and the
job goes on) or ``torchrun`` (a stalled rank is recovered in place; a death ends the job, as
torchrun does).

Each optimizer step, its whole accumulation window (the Trainer's count of the window's tokens,
a collective, every micro-batch's forward and backward, the clipping) up to ``optimizer.step()``,
runs in :func:`fastdist.run_step` with ``step_timeout``: after a fault the group is recovered, a
replacement of a dead rank is handed the live ranks' state (model, optimizer, LR scheduler, the
Trainer's state and control), and the window is redone from its start, exactly once per update.
What the Trainer does after the update (logging, evaluation, saving) is redone the same way, its
loss accumulator and log put back first. A replacement starts the script as the first start did,
is handed the state in ``train()``, and skips the batches done with the Trainer's own
``get_resumed_dataloader`` (the Trainer's default shuffled sampler gives every rank the same order
for an epoch, so the replacement draws what its predecessor would have). The final model equals an
undisturbed run's.

The Trainer has no public hook around its optimizer step, so this class replaces its private
``_run_epoch`` (transformers 5: its body, with the window in a step). It is checked against the
transformers releases in :data:`TESTED`; on another, constructing the Trainer raises
``RuntimeError`` saying so. Not supported (``ValueError`` at ``train()``): resuming from a
checkpoint (``resume_from_checkpoint``; a replacement is handed the state instead), DeepSpeed and
XLA. The loss logged for the step a rank died in is the live ranks' (the dead rank's share was
lost with it); models, optimizer state and evaluations are exact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import inspect
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch

try:
    import transformers as _hf
except ImportError as exc:  # pragma: no cover - the error says what to install
    raise ImportError("fastdist.transformers needs transformers: pip install 'transformers>=5,<6'") from exc

from .accelerate import _refuse_alone
from .accelerate import init_process_group as _accelerate_init
from .errors import FastdistError
from .recovery import randomness
from .recovery.growing import sync_state
from .steps import check_retries, positive_seconds, run_step

log = logging.getLogger("fastdist")

# The transformers releases whose Trainer._run_epoch this module's replaces (major, minor):
# 5.25 tested in CI (tests/frameworks/test_frameworks.py, tests/frameworks/trainer_job.py).
TESTED = ((5, 25),)
_EPOCH_ARGS = (
    "self", "model", "epoch", "train_dataloader", "steps_in_epoch", "num_update_steps_per_epoch", "trial",
    "ignore_keys_for_eval", "start_time", "resume_from_checkpoint", "epochs_trained",
    "steps_trained_in_current_epoch",
)  # fmt: skip


def init_process_group(
    *, timeout: float | datetime.timedelta | None = None, backend: str | None = None
) -> None:
    """Makes the default group as a watched group (:func:`fastdist.init_process_group`, from the
    launcher's environment) before ``TrainingArguments`` makes one itself: call it first.
    ``timeout``: the group's default timeout (seconds or a timedelta); ``backend``: NCCL when
    CUDA is available, gloo if not, unless given."""
    from accelerate.utils import InitProcessGroupKwargs

    if timeout is None:
        _accelerate_init(backend=backend)
        return
    seconds = positive_seconds(timeout, "timeout")
    _accelerate_init(InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=seconds)), backend=backend)


def _version() -> str:
    # (transformers' lazy module can be replaced in sys.modules after this module bound it)
    return str(sys.modules.get("transformers", _hf).__version__)


def _release() -> tuple[int, int]:
    major, minor = (_version().split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def check_release() -> None:
    """``RuntimeError`` unless the installed transformers is one this module was checked against
    and its ``Trainer._run_epoch`` has the arguments this module's replacement takes."""
    found = tuple(inspect.signature(_hf.Trainer._run_epoch).parameters)
    if _release() not in TESTED or found != _EPOCH_ARGS:
        tested = ", ".join(f"{a}.{b}" for a, b in TESTED)
        raise RuntimeError(
            f"fastdist.transformers.Trainer replaces transformers' private Trainer._run_epoch and was "
            f"checked against transformers {tested}; this is {_version()}"
            + ("" if found == _EPOCH_ARGS else " (its _run_epoch takes other arguments)")
            + ": install one of those (pip install 'transformers==5.25.*') or use fastdist.accelerate"
        )


_BEST = ("best_metric", "best_global_step", "best_model_checkpoint")


def _check_distributed(args: Any) -> None:
    """Refuses TrainingArguments that run this process alone in a job of several: on CPU the
    Trainer trains distributed only with ``use_cpu=True``, and otherwise each process trains a model
    of its own (world size 1, every one writing the same output folder), silently."""
    _refuse_alone(
        "args",
        getattr(args, "world_size", None),
        "the TrainingArguments run it alone (world size 1)",
        "On CPU pass TrainingArguments(use_cpu=True, ...)",
    )


def _plain(value: Any) -> Any:
    """A one-element tensor (a grad norm, a metric) as the number it holds, for JSON."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise TypeError(f"the Trainer's state holds a {type(value).__name__}, which fastdist cannot hand over")


class _Progress:
    """The Trainer's place and bookkeeping, handed to a replacement with the model: its state
    (the step, the epoch, the log, the best metric), its control flags, the loss accumulated
    since the last log, and which part of the step the live ranks were in (``after``: "step" or
    "epoch" while the logging, evaluation and saving after an update or an epoch were under
    way; None in the step itself)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.after: str | None = None
        self.grad_norm: float | None = None
        self.learning_rate: float | None = None
        # Puts the Trainer back as it was before the logging, evaluation and saving under way
        # (a replacement joins their redo, so it is handed what they start from).
        self.rewind: Callable[[], None] | None = None

    _STATE = (
        "epoch", "global_step", "num_input_tokens_seen", "total_flos", "log_history", "best_metric",
        "best_global_step", "best_model_checkpoint",
    )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        if self.rewind is not None:
            self.rewind()
        doc = {
            "state": {k: getattr(t.state, k) for k in self._STATE if hasattr(t.state, k)},
            "control": dataclasses.asdict(t.control),
            "tr_loss": float(t._tr_loss.item()),
            "total_loss": t._total_loss_scalar,
            "last_logged": t._globalstep_last_logged,
            "flos": t.current_flos,
            "after": self.after,
            "grad_norm": self.grad_norm,
            "learning_rate": self.learning_rate,
        }
        return {"json": json.dumps(doc, default=_plain)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        t, doc = self.trainer, json.loads(sd["json"])
        for k, v in doc["state"].items():
            setattr(t.state, k, v)
        for k, v in doc["control"].items():
            setattr(t.control, k, v)
        t._tr_loss.fill_(doc["tr_loss"])
        t._total_loss_scalar, t._globalstep_last_logged = doc["total_loss"], doc["last_logged"]
        t.current_flos, self.after = doc["flos"], doc["after"]
        self.grad_norm, self.learning_rate = doc["grad_norm"], doc["learning_rate"]


class Trainer(_hf.Trainer):
    """A ``transformers.Trainer`` whose steps survive a stalled or dead rank (see the module).

    ``step_timeout``: the deadline of one optimizer step (its whole accumulation window) and of
    what follows it (logging, evaluation, saving), seconds or a timedelta; ``max_retries``: the
    faults one step may meet before the last is raised; ``recover_timeout``: the bound of each
    recovery (a replacement must start and join within it). Everything else is the Trainer's.
    ``joined_at`` is the optimizer step a replacement was handed (None on a first start)."""

    def __init__(
        self,
        *args: Any,
        step_timeout: float | datetime.timedelta,
        max_retries: int = 3,
        recover_timeout: float | datetime.timedelta = 120.0,
        **kwargs: Any,
    ) -> None:
        check_release()
        self.step_timeout = positive_seconds(step_timeout, "step_timeout")
        self.recover_timeout = positive_seconds(recover_timeout, "recover_timeout")
        self.max_retries = check_retries(max_retries)
        self.joined_at: int | None = None
        self._synced = False
        self._progress = _Progress(self)
        super().__init__(*args, **kwargs)
        _check_distributed(self.args)

    # -- the state a replacement is handed --------------------------------------------------
    def fastdist_state(self) -> dict[str, Any]:
        """What a replacement is handed: the model, the optimizer, the LR scheduler and the
        Trainer's progress (override to add your own Statefuls)."""
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.lr_scheduler,
            "trainer": self._progress,
        }

    def _redo(self, fn: Callable[[], Any], optimizers: tuple[Any, ...] = ()) -> Any:
        return run_step(
            fn,
            timeout=self.step_timeout,
            optimizers=optimizers,
            max_retries=self.max_retries,
            recover_timeout=self.recover_timeout,
            state=self.fastdist_state(),
        )

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Trains as ``transformers.Trainer.train`` does; raises ValueError for
        ``resume_from_checkpoint`` (a replacement of a dead rank is handed the live ranks' state
        instead), and for DeepSpeed or XLA."""
        if kwargs.get("resume_from_checkpoint") or (args and args[0]):
            raise ValueError(
                "resume_from_checkpoint is not supported by fastdist.transformers.Trainer: a "
                "replacement of a dead rank is handed the live ranks' state instead"
            )
        if self.is_deepspeed_enabled or getattr(self, "is_fsdp_xla_enabled", False):
            raise ValueError("fastdist.transformers.Trainer does not support DeepSpeed or XLA")
        self._synced = False
        return super().train(*args, **kwargs)

    # -- the epoch, as transformers 5.25's _run_epoch with each update in a step ---------------
    def _run_epoch(
        self,
        model: Any,
        epoch: int,
        train_dataloader: Any,
        steps_in_epoch: int,
        num_update_steps_per_epoch: int,
        trial: Any,
        ignore_keys_for_eval: Any,
        start_time: float,
        resume_from_checkpoint: Any,
        epochs_trained: int,
        steps_trained_in_current_epoch: int,
    ) -> None:
        args, progress = self.args, self._progress
        hf: Any = self  # (the Trainer's own untyped methods)
        after = functools.partial(self._after_update, model, trial, epoch, ignore_keys_for_eval, start_time)
        joined_in = None
        if not self._synced:
            self._synced = True
            if sync_state(self.fastdist_state(), timeout=self.recover_timeout):
                self.joined_at, joined_in = self.state.global_step, progress.after
                log.info("fastdist: joined the job at optimizer step %d", self.joined_at)
        done = self.state.global_step - epoch * num_update_steps_per_epoch
        if done > num_update_steps_per_epoch:
            return  # a replacement that joined in a later epoch
        caught_up = None
        if joined_in:
            after(joined_in)  # the live ranks' logging, evaluation or saving it joined
            # Its predecessor's random state as that ended: what a replacement draws from here to
            # its first step (the seeds a DataLoader's iterator and sampler draw as they start,
            # drawn by its predecessor at the epoch's start) is put back before that step.
            caught_up = randomness.everything()
        if done == num_update_steps_per_epoch:  # it joined at the end of this epoch
            if joined_in != "epoch":
                self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
                after("epoch")
            return
        accum = args.gradient_accumulation_steps
        loader = train_dataloader
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        inner: Any = getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None)
        if hasattr(inner, "set_epoch"):
            inner.set_epoch(epoch)
        if done > 0:
            loader = self.get_resumed_dataloader(loader, done * accum)
        batches = iter(loader)
        remainder = steps_in_epoch % accum or accum
        for update_step in range(done, num_update_steps_per_epoch):
            count = accum if update_step != num_update_steps_per_epoch - 1 else remainder
            window = [b for _, b in zip(range(count), batches)]
            if not window:
                break
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            if caught_up is not None:
                randomness.put_back(caught_up)
                caught_up = None
            first = update_step * accum
            losses, grad_norm, progress.learning_rate = self._redo(
                lambda w=window, s=first: self._window(model, w, s, steps_in_epoch),  # type: ignore[misc]
                optimizers=(self.optimizer,),
            )
            for loss, inputs in zip(losses, window):
                if args.logging_nan_inf_filter and (torch.isnan(loss) or torch.isinf(loss)):
                    since = 1 + self.state.global_step - self._globalstep_last_logged
                    self._tr_loss += self._tr_loss / since
                else:
                    self._tr_loss += loss
                hf.current_flos += float(self.floating_point_ops(inputs))
                hf._track_num_input_tokens(inputs)
            for _ in window[:-1]:
                self.control = self.callback_handler.on_substep_end(args, self.state, self.control)
            if not self.accelerator.optimizer_step_was_skipped and not isinstance(
                self.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau
            ):
                hf.lr_scheduler.step()
            model.zero_grad()
            self.state.global_step += 1
            self.state.epoch = epoch + (first + len(window)) / steps_in_epoch
            progress.grad_norm = grad_norm
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            after("step")
            if self.control.should_epoch_stop or self.control.should_training_stop:
                break
        self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
        after("epoch")

    def _window(
        self, model: Any, window: list[Any], first: int, steps_in_epoch: int
    ) -> tuple[list[Any], Any, float]:
        """One accumulation window, up to the optimizer's update: its losses, grad norm and
        learning rate."""
        args = self.args
        num_items = self._get_num_items_in_batch(window, args.device)  # a collective
        self.current_gradient_accumulation_steps = len(window)
        losses = []
        for i, inputs in enumerate(window):
            step = first + i
            sync = (step + 1) % args.gradient_accumulation_steps == 0 or step + 1 == steps_in_epoch
            self.accelerator.gradient_state._set_sync_gradients(sync)
            each = self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False)
            last = i == len(window) - 1 or each
            context = contextlib.nullcontext() if last else self.accelerator.no_sync(model=model)
            with context:
                losses.append(self.training_step(model, inputs, num_items).detach())
        hf: Any = self  # (the Trainer's own untyped methods)
        grad_norm = hf._clip_grad_norm(model) if args.max_grad_norm > 0 else None
        grad_norm = hf._get_grad_norm(model, grad_norm=grad_norm)
        self.control = self.callback_handler.on_pre_optimizer_step(args, self.state, self.control)
        hf.optimizer.step()
        self.control = self.callback_handler.on_optimizer_step(args, self.state, self.control)
        return losses, grad_norm, self._get_learning_rate()  # (before the scheduler's step)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's save, then a barrier: a rank that dies while the checkpoint is written
        (rank 0 writes most of it) fails the step it is saved in, which is redone (the
        replacement writes its part again), so a checkpoint folder is never left half-written
        looking like a good one."""
        import torch.distributed as dist

        try:
            super()._save_checkpoint(model, trial)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.barrier()  # bounded by the step's deadline (the default group is watched)
        except FastdistError as err:
            log.warning(
                "fastdist: the checkpoint of step %d was cut short (%s): it is saved again as the step "
                "is redone, so that it is whole",
                self.state.global_step,
                str(err).splitlines()[0],
            )
            raise

    def _after_update(
        self, model: Any, trial: Any, epoch: int, ignore_keys_for_eval: Any, start_time: float, where: str
    ) -> None:
        """Logging, evaluation and saving after an update (``where``: "step") or at the end of
        an epoch ("epoch"), redone after a fault with the loss accumulator, the log and the
        control flags put back as they were before it."""
        progress = self._progress
        saved = (
            self._tr_loss.clone(), self._total_loss_scalar, self._globalstep_last_logged,
            len(self.state.log_history), dataclasses.asdict(self.control), self.current_flos,
            {k: getattr(self.state, k, None) for k in _BEST},
        )  # fmt: skip

        def rewind() -> None:
            self._tr_loss.copy_(saved[0])
            self._total_loss_scalar, self._globalstep_last_logged = saved[1], saved[2]
            del self.state.log_history[saved[3] :]
            for k, v in saved[4].items():
                setattr(self.control, k, v)
            self.current_flos = saved[5]
            for k, v in saved[6].items():
                setattr(self.state, k, v)

        def attempt() -> None:
            rewind()
            self._maybe_log_save_evaluate(
                self._tr_loss, progress.grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time,
                learning_rate=progress.learning_rate,
            )  # fmt: skip

        progress.after, progress.rewind = where, rewind
        try:
            self._redo(attempt)
        finally:
            progress.after, progress.rewind = None, None
