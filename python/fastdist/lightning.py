"""fastdist for PyTorch Lightning: a ``DDPStrategy`` whose training steps have a deadline and are
redone in place after a fault, so a Lightning job survives a stalled rank without a restart::

    import lightning as L
    import fastdist.lightning

    strategy = fastdist.lightning.DDPStrategy(step_timeout=30, collective_timeout=60)
    trainer = L.Trainer(accelerator="cpu", devices=3, strategy=strategy)
    trainer.fit(model)

The strategy makes the default group with :func:`fastdist.init_process_group` under any of
Lightning's launchers (its own, torchrun, SLURM), so every op on it is watched. Each optimizer
step (the closure of training_step, zero_grad and backward, and the optimizer's update) runs in
``fastdist.fail_after(step_timeout)``; when it raises a :class:`fastdist.FastdistError`, the
strategy calls :func:`fastdist.recover`, puts back what the failed attempt changed, and runs the
step again, at most ``max_retries`` times, after which the error goes to Lightning as without
fastdist. What Lightning counts is counted once: the step is redone inside Lightning's own
``optimizer_step``, so ``global_step``, the LR schedulers and the loggers' step advance once, and
the progress counters the closure moves (``zero_grad``) are put back before the retry.

Gradient accumulation (``accumulate_grad_batches=N``): the earlier micro-batches of the window run
their backward before the optimizer step (under ``no_sync``: no collective), and their gradients
are in ``.grad`` when the step starts. The strategy keeps a copy of the gradients at the start of
the step and puts it back before a retry, so the redone step sums the same micro-batches as an
undisturbed run (the cost: one copy of the gradients per optimizer step, only when N > 1). The RNG
state is put back too, so dropout draws the same masks.

``collective_timeout`` bounds the strategy's own collectives outside the step (validation's
``sync_dist``, ``barrier``, ``broadcast``, ``all_gather``); a fault there is raised to Lightning.
Manual optimization is refused at set-up unless ``max_retries=0``: fastdist cannot redo a step it
does not run.

Which launcher replaces a dead worker: only ``fastdist run``. Lightning's own launcher kills every
other process when one dies (the job ends); torchrun ends the job, or with ``--max-restarts``
restarts every worker. A stalled rank is recovered in place under any of them. ``fastdist run
--spares`` is refused when the strategy is made (Lightning would count the spares as ranks).

A dead worker is replaced under ``fastdist run`` (the same script, any number of processes): the
live ranks' failed step recovers with their state, and the replacement, which runs Lightning's
set-up on a group of its own, joins that recovery before its first batch, is handed the
LightningModule, optimizers, LR schedulers, precision plugin, callbacks' states and the fit
loop's counters as they were when the step began, draws the epoch's batches up to the step's
accumulation window from its loader, and runs the window's earlier micro-batches itself (its
strategy collectives local meanwhile: the live ranks ran theirs before the fault).

``ModelParallelStrategy`` does the same for FSDP2 (``fully_shard`` in ``configure_model``) for a
stalled rank; as FSDP2 communicates in every micro-batch, the window's earlier micro-batches, which
Lightning runs outside the optimizer step, are bounded and redone one by one too. A dead rank's
shards exist on no live rank: under ``fastdist run`` it is replaced only with
``snapshot_copies=K`` (K >= 1; ``accumulate_grad_batches=1`` for now), which keeps a copy of each
rank's part of the handed-over state on K other ranks (:class:`fastdist.PeerSnapshot`, taken at
every optimizer step's start: one copy of the shards and an exchange a step, before the step
runs); the replacement gets its predecessor's shards and every rank redoes the failed step.
Without it the replacement refuses to join, the live ranks' recovery fails and the job ends.

Works with the ``lightning`` package and with ``pytorch_lightning`` (>= 2.4): ``DDPStrategy`` is
built on the one the program imported (``lightning`` when both or neither is imported yet);
:func:`ddp_strategy_class` builds it on a named one. Importing ``fastdist`` does not import this
module.

Why one file of about 700 lines: one strategy for both Lightning packages, and the hooks Lightning
calls on it, each with the check that refuses what cannot be redone; the step's own machinery
(the retry, what a redone step puts back) is fastdist.steps's.
"""

from __future__ import annotations

import copy
import datetime
import importlib
import importlib.util
import os
import sys
from typing import Any

import torch

from .deadlines import fail_after
from .diagnostics import uncaught
from .process_group import init_process_group
from .recovery import joining, snapshot
from .recovery.growing import sync_state
from .steps import StepStart, check_retries, positive_seconds, redo_after_fault, snapshot_at_start

_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def _chosen_package() -> str:
    """The Lightning package a strategy is built on: the one already imported, else the first
    installed."""
    if "lightning" in sys.modules or "lightning.pytorch" in sys.modules:
        return "lightning.pytorch"
    if "pytorch_lightning" in sys.modules:
        return "pytorch_lightning"
    for name in _PACKAGES:
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            return name
    raise ImportError(
        "fastdist.lightning needs Lightning >= 2.4: pip install lightning (or pytorch_lightning)"
    )


def _refuse_spares() -> None:
    """Refuses ``fastdist run --spares`` when a strategy is made, before Lightning sizes the job:
    it takes the world size (its check of devices x num_nodes, the samplers' shards) from the
    launcher's WORLD_SIZE, which counts the spares, and would split the data among ranks that do
    not train. Every worker raises the same error, which ``fastdist run`` takes for the script's
    own: the job ends with one root cause and no replacement."""
    spares = joining.spares_arg(None)
    if spares:
        uncaught.record_uncaught()  # under fastdist run: to the agent, which shows it once
        raise ValueError(
            f"fastdist.lightning: FASTDIST_SPARES={spares} (fastdist run --spares) is not supported: "
            "Lightning takes the world size from WORLD_SIZE, which counts the spares; run without "
            "--spares (a dead worker is still replaced, by a new process)"
        )


def _init_watched_group(strategy: Any) -> None:
    """The default group, made by :func:`fastdist.init_process_group` (watched) where Lightning
    would call torch's: from the strategy's cluster environment, with its backend and timeout. A
    group that exists already (a second ``fit``, or one the script made) is used as it is."""
    _refuse_spares()
    if torch.distributed.is_initialized():
        return
    env = strategy.cluster_environment
    os.environ["MASTER_ADDR"] = env.main_address
    os.environ["MASTER_PORT"] = str(env.main_port)
    init_process_group(
        strategy._process_group_backend,
        rank=strategy.global_rank,
        world_size=strategy.world_size,
        timeout=strategy._timeout,
    )


class _Bounded:
    """The strategy's own collectives outside the step (``barrier``, ``broadcast``, ``reduce`` /
    ``all_reduce``, ``all_gather``), each in ``fail_after(collective_timeout)``."""

    _fastdist_collective_timeout: float | None = None

    def _catching_up(self) -> bool:
        """On a replacement until it joins: its groups are local, and a broadcast from another
        rank would give garbage (an object's size); and after it rolled back behind the live ranks
        (a death in a step-start snapshot's exchange), until it is at their step: they ran the
        collectives of the steps between before the death."""
        return joining.is_pending() or snapshot.catching_up()

    def _bounded(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        if self._catching_up():
            return _local(call.__name__, *args, **kwargs)
        if self._fastdist_collective_timeout is None:
            return call(*args, **kwargs)
        with fail_after(self._fastdist_collective_timeout):
            return call(*args, **kwargs)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._bounded(super().barrier, *args, **kwargs)  # type: ignore[misc]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._bounded(super().broadcast, obj, src)  # type: ignore[misc]

    def all_gather(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return self._bounded(super().all_gather, tensor, *args, **kwargs)  # type: ignore[misc]


def _local(name: str, value: Any = None, *args: Any, **kwargs: Any) -> Any:
    """What a strategy collective gives on a replacement that catches up the micro-batches the
    live ranks ran before the fault: its own value, as on a group of one."""
    if name == "all_gather":
        return torch.stack([value] * torch.distributed.get_world_size())
    return value


class _Mixin(_Bounded):
    """The behaviour fastdist adds to a Lightning strategy; the class is put together with the
    strategy of the installed package by :func:`ddp_strategy_class`."""

    _fastdist_step_timeout: float | None
    _fastdist_recover_timeout: float
    _fastdist_max_retries: int
    retries: int
    # Whether the micro-batches that accumulate outside the optimizer step issue collectives
    # (FSDP2 reduce-scatters every backward; DDP's run under no_sync and issue none).
    _fastdist_micro_batches = False
    _fastdist_in_step = False
    # What a rank that joins in a recovery is handed (set up in setup()); on a joiner, the batch
    # whose optimizer step it joined in, until it has run it.
    _fastdist_state: dict[str, Any] | None = None
    _fastdist_catch_up_to: int | None = None
    _fastdist_fabric: str  # the Fabric package beside the Lightning one (set by the class factory)

    def __init__(
        self,
        *args: Any,
        step_timeout: float | datetime.timedelta | None = None,
        collective_timeout: float | datetime.timedelta | None = None,
        recover_timeout: float | datetime.timedelta = 60.0,
        max_retries: int = 3,
        snapshot_copies: int = 0,
        **kwargs: Any,
    ) -> None:
        if isinstance(snapshot_copies, bool) or not isinstance(snapshot_copies, int):
            raise TypeError(f"snapshot_copies must be an int, got {type(snapshot_copies).__name__}")
        if snapshot_copies < 0:
            raise ValueError(f"snapshot_copies must be >= 0, got {snapshot_copies}")
        if snapshot_copies and not self._fastdist_micro_batches:
            raise ValueError(
                "snapshot_copies is for ModelParallelStrategy (FSDP2): DDP's state is whole on every rank"
            )
        self._fastdist_snapshot_copies = snapshot_copies
        self._fastdist_snapshot: Any = None
        self._fastdist_snapshot_step: int | None = None
        self._fastdist_step_timeout = (
            None if step_timeout is None else positive_seconds(step_timeout, "step_timeout")
        )
        self._fastdist_collective_timeout = (
            None if collective_timeout is None else positive_seconds(collective_timeout, "collective_timeout")
        )
        self._fastdist_recover_timeout = positive_seconds(recover_timeout, "recover_timeout")
        self._fastdist_max_retries = check_retries(max_retries)
        _refuse_spares()
        self.retries = 0  # steps redone in this process, for the user's logs and tests
        self.joined_at: int | None = None  # on a replacement: the global step it joined at
        super().__init__(*args, **kwargs)

    # -- the group ---------------------------------------------------------------------------

    def setup_distributed(self) -> None:
        """Lightning's own set-up, with the group made by :func:`fastdist.init_process_group`
        (watched) rather than torch's. A group that exists already (a second ``fit``, or one the
        script made) is used as it is."""
        s: Any = self
        seed = importlib.import_module(s._fastdist_fabric + ".utilities.seed")
        seed.reset_seed()
        s.set_world_ranks()
        s._process_group_backend = s._get_process_group_backend()
        _init_watched_group(s)

    def _setup_distributed(self) -> None:
        """ModelParallelStrategy's set-up (FSDP2): the watched group first, which Lightning's own
        set-up then finds and uses."""
        s: Any = self
        s.set_world_ranks()
        s._process_group_backend = s._get_process_group_backend()
        _init_watched_group(s)
        super()._setup_distributed()  # type: ignore[misc]

    def setup(self, trainer: Any) -> None:
        module = getattr(trainer, "lightning_module", None)
        if self._fastdist_max_retries and module is not None and not module.automatic_optimization:
            raise ValueError(
                "fastdist.lightning.DDPStrategy redoes failed steps only in automatic optimization; "
                "with manual optimization pass max_retries=0 and call fastdist.recover() in your step"
            )
        joiner = joining.is_pending()
        if joiner and self._fastdist_micro_batches and not self._fastdist_snapshot_copies:
            raise RuntimeError(
                "fastdist.lightning.ModelParallelStrategy cannot bring a replacement of a dead rank up "
                "to date: its FSDP2 shards exist nowhere else; the live ranks' recovery times out and "
                "the job ends (pass snapshot_copies=1 to keep copies on other ranks, use "
                "fastdist.lightning.DDPStrategy, or restart from a checkpoint)"
            )
        super().setup(trainer)  # type: ignore[misc]
        self._fastdist_state = _handed_over(trainer)
        if self._fastdist_snapshot_copies:
            from .recovery.snapshot import PeerSnapshot

            if trainer.accumulate_grad_batches > 1:
                # A death in a window's earlier micro-batch comes before the step's snapshot: the
                # job would roll back past the batches the loop has drawn.
                raise ValueError(
                    "ModelParallelStrategy(snapshot_copies=) needs accumulate_grad_batches=1 for now: "
                    f"got {trainer.accumulate_grad_batches}"
                )

            # Made here on every process, a replacement too (it makes a group), and taken at the
            # start of every optimizer step: a replacement gets its predecessor's shards as they
            # were when the failed step began, and every rank redoes that step.
            self._fastdist_snapshot = PeerSnapshot(
                self._fastdist_state, every=1, copies=self._fastdist_snapshot_copies
            )
        self._bound_sigterm_broadcast(trainer)
        if self._fastdist_micro_batches:
            self._bound_accumulating_micro_batches(trainer)
        if joiner:
            self._join_at_first_batch(trainer)

    # -- a replacement of a dead rank -----------------------------------------------------------

    def _join_at_first_batch(self, trainer: Any) -> None:
        """On a process that takes a dead rank's place (``fastdist run``): its groups are local
        until it joins, so Lightning's set-up runs here as on a group of one (no sanity
        validation: the live ranks are not validating). Before its first batch it joins the live
        ranks' recovery and is handed their state as it was when the failed step began; it goes
        on from the first micro-batch of that step's accumulation window, which it runs without
        collectives, as the dead rank had (its gradients died with it)."""
        trainer.num_sanity_val_steps = 0
        loop = trainer.fit_loop.epoch_loop

        def first_batch(data_fetcher: Any) -> Any:
            del loop.advance  # back to the class's
            state = self._fastdist_state
            assert state is not None
            # (With a snapshot, the live ranks check that it is the failed step's start.)
            sync_state(state, timeout=self._fastdist_recover_timeout, snapshot=self._fastdist_snapshot)
            self._fastdist_catch_up_to = state["loop"].place(data_fetcher, self._fastdist_fabric)
            self.joined_at = trainer.global_step
            return loop.advance(data_fetcher)

        loop.advance = first_batch

    def _catching_up(self) -> bool:
        """On a replacement, until it joins, and while it runs the batches up to the one whose
        step it joined in (the live ranks ran their collectives outside that step before the
        fault)."""
        if super()._catching_up():
            return True
        if self._fastdist_catch_up_to is None:
            return False
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        if trainer.fit_loop.epoch_loop.batch_progress.current.ready <= self._fastdist_catch_up_to:
            return True
        self._fastdist_catch_up_to = None
        return False

    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return self._bounded(super().reduce, tensor, *args, **kwargs)  # type: ignore[misc]

    def _bound_sigterm_broadcast(self, trainer: Any) -> None:
        """Lightning broadcasts a "SIGTERM received" flag from rank 0 before every batch, outside
        the step, and ignores its errors. A rank that stalls before that broadcast would keep rank
        0 in it for the group's whole timeout; bounded by ``step_timeout``, it ends in time and
        the step's next op raises, so the step is redone as after any fault. A replacement skips
        it for the batches it catches up (the live ranks made it before the fault)."""
        loop: Any = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        original = getattr(loop, "_broadcast_sigterm_tensor", None)
        if original is None or getattr(original, "_fastdist", False):
            return
        seconds = self._fastdist_step_timeout

        def bounded() -> None:
            if self._catching_up():  # the live ranks broadcast for this batch before the fault
                return
            if seconds is None:
                original()
                return
            with fail_after(seconds):
                original()

        bounded._fastdist = True  # type: ignore[attr-defined]
        loop._broadcast_sigterm_tensor = bounded

    def _bound_accumulating_micro_batches(self, trainer: Any) -> None:
        """With ``accumulate_grad_batches`` > 1, Lightning runs the window's earlier micro-batches
        (training_step and backward) outside ``optimizer_step``. Under FSDP2 they all-gather and
        reduce-scatter: each runs in ``fail_after(step_timeout)`` and, after a fault, is redone
        alone, from the gradients, RNG state, counters and metrics it started with."""
        loop: Any = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        auto: Any = getattr(loop, "automatic_optimization", None)
        make = getattr(auto, "_make_closure", None)
        if make is None or getattr(make, "_fastdist", False):
            return
        if self._fastdist_step_timeout is None and not self._fastdist_max_retries:
            return
        strategy = self

        def make_closure(kwargs: Any, optimizer: Any, batch_idx: int) -> Any:
            closure = make(kwargs, optimizer, batch_idx)
            inner = closure.closure

            def guarded(*args: Any, **kw: Any) -> Any:
                if strategy._fastdist_in_step:  # the optimizer step's closure: bounded there
                    return inner(*args, **kw)
                result, redone = strategy._redo(lambda: inner(*args, **kw), optimizer)
                strategy.retries += redone
                return result

            closure.closure = guarded
            return closure

        make_closure._fastdist = True  # type: ignore[attr-defined]
        auto._make_closure = make_closure

    def _redo(self, call: Any, optimizer: Any) -> tuple[Any, int]:
        timeout = self._fastdist_step_timeout

        def attempt() -> Any:
            if timeout is None:
                return call()
            with fail_after(timeout):
                return call()

        snap = self._fastdist_snapshot
        step = self.lightning_module.trainer.global_step  # type: ignore[attr-defined]
        return redo_after_fault(
            attempt,
            _StepStart(self, optimizer),
            max_retries=self._fastdist_max_retries,
            recover_timeout=self._fastdist_recover_timeout,
            state=self._fastdist_state,
            snapshot=snap,
            on_retry=snapshot_at_start(snap, step, self._fastdist_state),
        )

    # -- the training step -------------------------------------------------------------------

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The step in ``fail_after(step_timeout)``; after a fault, recovery and the step again
        with the gradients, RNG state, progress counters and logged metrics it started with."""
        step = super().optimizer_step  # type: ignore[misc]
        if self._fastdist_step_timeout is None and not self._fastdist_max_retries:
            return step(optimizer, closure, model, **kwargs)
        self._fastdist_in_step = True
        try:
            result, redone = self._redo(lambda: step(optimizer, closure, model, **kwargs), optimizer)
        finally:
            self._fastdist_in_step = False
        self.retries += redone
        return result


class _StepStart(StepStart):
    """The generic step start (gradients of the earlier micro-batches with accumulation, RNG
    state) and Lightning's own: the progress counters the closure moves and the states of the
    metrics training_step logs."""

    def __init__(self, strategy: Any, optimizer: Any) -> None:
        module = strategy.lightning_module
        trainer = getattr(module, "_trainer", None)
        super().__init__([optimizer], keep_grads=trainer is not None and trainer.accumulate_grad_batches > 1)
        self.progress = None
        self.progress_state = None
        self.results = None
        self.logged: dict[str, Any] = {}
        if trainer is not None and module.automatic_optimization:
            self.progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress
            self.progress_state = self.progress.state_dict()
            # What training_step logs (self.log): an epoch-level mean must not count a redone step
            # twice. A few scalar metrics: copying their states costs microseconds.
            self.results = trainer._results
            if self.results is not None:
                self.logged = {k: _metric_states(v) for k, v in self.results.items()}

    def restore(self) -> None:
        super().restore()
        if self.progress is not None:
            self.progress.load_state_dict(self.progress_state)
        if self.results is not None:
            for key in [k for k in self.results if k not in self.logged]:
                del self.results[key]  # first logged by the failed attempt
            for key, states in self.logged.items():
                _set_metric_states(self.results[key], states)


def _handed_over(trainer: Any) -> dict[str, Any]:
    """What a live rank hands to a rank that joins in a recovery (fastdist.recover's ``state``):
    the LightningModule, its optimizers and LR schedulers, the precision plugin, the callbacks'
    states and the fit loop's position. Handed over after the failed step's start is put back."""
    state: dict[str, Any] = {
        "module": trainer.lightning_module,
        "precision": trainer.precision_plugin,
        "callbacks": _Callbacks(trainer),
        "loop": _LoopPosition(trainer),
    }
    for i, opt in enumerate(trainer.optimizers):
        state[f"optimizer{i}"] = opt
    for i, config in enumerate(trainer.lr_scheduler_configs):
        state[f"scheduler{i}"] = config.scheduler
    return state


class _Callbacks:
    """The callbacks' states (ModelCheckpoint's best scores...), as in a Lightning checkpoint."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return {cb.state_key: cb.state_dict() for cb in self.trainer.callbacks}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for cb in self.trainer.callbacks:
            if cb.state_key in sd:
                cb.load_state_dict(sd[cb.state_key])


class _LoopPosition:
    """The fit loop's progress counters (epoch, batch, optimizer, scheduler, validation) and the
    loggers' step, as a live rank has them in a step; a joiner puts itself there with
    :meth:`place`."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return dict(self.trainer.fit_loop.state_dict())

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.loaded = sd

    def place(self, data_fetcher: Any, fabric: str) -> int:
        """Loads the counters at the first micro-batch of the window whose step the live ranks
        redo, and the data at that batch of the same epoch (drawn from the loader); returns the
        index of the window's last batch."""
        assert self.loaded is not None
        trainer, sd = self.trainer, copy.deepcopy(self.loaded)
        fit = trainer.fit_loop
        batch = sd["epoch_loop.batch_progress"]
        last: int = batch["current"]["ready"] - 1  # the batch in whose step the fault came
        first = last - last % trainer.accumulate_grad_batches
        back = batch["current"]["completed"] - first
        for part in ("current", "total"):
            value = batch[part]["completed"] - back
            batch[part].update(ready=value, started=value, processed=value, completed=value)
        batch["is_last_batch"] = False
        # The step was counted ready before it began; the window's first micro-batch zeroed the
        # gradients (outside the step when it has earlier micro-batches): the joiner does it again.
        optim = sd["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]
        for part in ("current", "total"):
            optim["step"][part]["ready"] = optim["step"][part]["completed"]
            if first < last:
                optim["zero_grad"][part] = {k: v - 1 for k, v in optim["zero_grad"][part].items()}
        _load_progress(fit, sd, "")
        set_epoch = importlib.import_module(fabric + ".utilities.data")._set_sampler_epoch
        for loader in fit._combined_loader.flattened:
            set_epoch(loader, fit.epoch_progress.current.processed)
        iter(data_fetcher)  # this epoch's order, from its first batch
        for _ in range(first):
            next(data_fetcher)
        return last


def _load_progress(loop: Any, sd: dict[str, Any], prefix: str) -> None:
    """A loop's and its children's counters from ``sd`` (Lightning's own per-loop load, without
    marking the loops as restarting from a checkpoint: the joiner is mid-run)."""
    base = next(c for c in type(loop).__mro__ if c.__name__ == "_Loop")
    loop._load_from_state_dict(sd, prefix)
    for name, child in vars(loop).items():
        if isinstance(child, base):
            _load_progress(child, sd, prefix + name + ".")


# The state of what self.log keeps (Lightning's _ResultMetric, a torchmetrics Metric, or a dict of
# them): its registered states and the bookkeeping torchmetrics keeps beside them.
_BOOKKEEPING = ("_update_count", "_computed", "_forward_cache")


def _metric_states(metric: Any) -> Any:
    if isinstance(metric, dict):
        return {k: _metric_states(v) for k, v in metric.items()}
    names = list(getattr(metric, "_defaults", {})) + [n for n in _BOOKKEEPING if hasattr(metric, n)]
    return {n: _copy(getattr(metric, n)) for n in names}


def _set_metric_states(metric: Any, states: Any) -> None:
    if isinstance(metric, dict):
        for k, v in states.items():
            _set_metric_states(metric[k], v)
        return
    for name, value in states.items():
        setattr(metric, name, _copy(value))


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else copy.copy(value)


_classes: dict[str, type] = {}


def ddp_strategy_class(package: str | None = None) -> type:
    """fastdist's DDP strategy built on ``package``'s ``DDPStrategy`` (``"lightning.pytorch"`` or
    ``"pytorch_lightning"``; default: the one the program imported)."""
    name = _chosen_package() if package is None else package
    if name not in _PACKAGES:
        raise ValueError(f"package must be one of {', '.join(_PACKAGES)}; got {package!r}")
    if name not in _classes:
        base = importlib.import_module(name + ".strategies").DDPStrategy
        fabric = "lightning.fabric" if name == "lightning.pytorch" else "lightning_fabric"
        cls = type("DDPStrategy", (_Mixin, base), {"_fastdist_fabric": fabric, "__module__": __name__})
        cls.__doc__ = __doc__
        cls.__qualname__ = "DDPStrategy"
        _classes[name] = cls
    return _classes[name]


def model_parallel_strategy_class(package: str | None = None) -> type:
    """fastdist's strategy for FSDP2 (and tensor parallelism) built on ``package``'s
    ``ModelParallelStrategy``: the same deadlines and in-place redo as :func:`ddp_strategy_class`.
    The LightningModule shards itself in ``configure_model`` on ``self.device_mesh``::

        def configure_model(self):
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        strategy = fastdist.lightning.ModelParallelStrategy(
            data_parallel_size=3, tensor_parallel_size=1, step_timeout=30)
    """
    name = _chosen_package() if package is None else package
    if name not in _PACKAGES:
        raise ValueError(f"package must be one of {', '.join(_PACKAGES)}; got {package!r}")
    key = name + ":model_parallel"
    if key not in _classes:
        base = importlib.import_module(name + ".strategies").ModelParallelStrategy
        fabric = "lightning.fabric" if name == "lightning.pytorch" else "lightning_fabric"
        attrs = {"_fastdist_fabric": fabric, "__module__": __name__, "_fastdist_micro_batches": True}
        cls = type("ModelParallelStrategy", (_Mixin, base), attrs)
        cls.__doc__ = model_parallel_strategy_class.__doc__
        cls.__qualname__ = "ModelParallelStrategy"
        _classes[key] = cls
    return _classes[key]


class _FabricMixin(_Bounded):
    """Fabric's DDP or model-parallel strategy with the group made by
    :func:`fastdist.init_process_group` and its collectives bounded by ``collective_timeout``; the
    loop is the user's (see :func:`fabric_ddp_strategy_class`)."""

    _fastdist_fabric: str  # the Fabric package
    _fastdist_reset_seed: bool  # the base's _setup_distributed resets the seed first

    def __init__(
        self, *args: Any, collective_timeout: float | datetime.timedelta | None = None, **kwargs: Any
    ) -> None:
        self._fastdist_collective_timeout = (
            None if collective_timeout is None else positive_seconds(collective_timeout, "collective_timeout")
        )
        _refuse_spares()
        super().__init__(*args, **kwargs)

    def _setup_distributed(self) -> None:
        s: Any = self
        if s._fastdist_reset_seed:  # as the base class does (ModelParallelStrategy)
            importlib.import_module(s._fastdist_fabric + ".utilities.seed").reset_seed()
        s._set_world_ranks()
        s._process_group_backend = s._get_process_group_backend()
        _init_watched_group(s)

    def all_reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return self._bounded(super().all_reduce, tensor, *args, **kwargs)  # type: ignore[misc]


_FABRIC = {"lightning.pytorch": "lightning.fabric", "pytorch_lightning": "lightning_fabric"}


def fabric_ddp_strategy_class(package: str | None = None) -> type:
    """fastdist's DDP strategy for Fabric, built on ``package``'s Fabric (``"lightning.fabric"``
    or ``"lightning_fabric"``; default: the one that goes with the Lightning package the program
    imported). Fabric's loop is the user's: bound and redo each step with
    :func:`fastdist.run_step`::

        fabric = Fabric(accelerator="cpu", devices=3, strategy=fastdist.lightning.FabricDDPStrategy())
        fabric.launch()
        model, opt = fabric.setup(model, opt)
        for x, y in loader:
            def step():
                opt.zero_grad()
                fabric.backward(loss_fn(model(x), y))
                opt.step()
            fastdist.run_step(step, timeout=30, optimizers=[opt])

    Which launcher replaces a dead worker: only ``fastdist run`` (with ``state=`` in
    ``run_step`` and ``fastdist.sync_state(state)`` before the loop). Fabric's own launcher ends
    the job when a process dies; torchrun ends it or restarts every worker. A stalled rank is
    recovered in place under any of them.
    """
    return _fabric_class(package, "DDPStrategy", fabric_ddp_strategy_class.__doc__)


def fabric_model_parallel_strategy_class(package: str | None = None) -> type:
    """fastdist's FSDP2 strategy for Fabric, built on ``package``'s ``ModelParallelStrategy``
    (see :func:`fabric_ddp_strategy_class` for ``package``): the group made by
    :func:`fastdist.init_process_group`, Fabric's collectives bounded by ``collective_timeout``.
    A dead rank's shards exist on no live rank: under ``fastdist run`` a replacement gets them
    from a :class:`fastdist.PeerSnapshot` of the step's start, which :func:`fastdist.run_step`
    takes (``snapshot=``, ``step_number=``)::

        def parallelize(model, mesh):
            fully_shard(model, mesh=mesh["data_parallel"])
            return model

        strategy = fastdist.lightning.FabricModelParallelStrategy(
            parallelize_fn=parallelize, data_parallel_size=3, tensor_parallel_size=1)
        fabric = Fabric(accelerator="cpu", devices=3, strategy=strategy)
        fabric.launch()
        model = fabric.setup_module(net)
        opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05))
        state = {"model": net, "optim": opt.optimizer, "progress": progress}
        snap = fastdist.PeerSnapshot(state, every=1, copies=1)
        fastdist.sync_state(state, snapshot=snap)      # a replacement: its predecessor's shards
        while progress.step < steps:
            fastdist.run_step(step, timeout=60, optimizers=[opt], state=state,
                              snapshot=snap, step_number=progress.step)
            progress.step += 1
    """
    return _fabric_class(package, "ModelParallelStrategy", fabric_model_parallel_strategy_class.__doc__)


def _fabric_class(package: str | None, base_name: str, doc: str | None) -> type:
    """``Fabric`` + ``base_name`` (a strategy class of ``package``'s Fabric) with
    :class:`_FabricMixin`, made once per package."""
    name = _FABRIC[_chosen_package()] if package is None else package
    if name not in _FABRIC.values():
        raise ValueError(f"package must be one of {', '.join(_FABRIC.values())}; got {package!r}")
    key = f"{name}:{base_name}"
    if key not in _classes:
        base = getattr(importlib.import_module(name + ".strategies"), base_name)
        # ModelParallelStrategy's own _setup_distributed resets the seed first; the mixin's does too.
        reset_seed = base_name == "ModelParallelStrategy"
        attrs = {"__module__": __name__, "_fastdist_fabric": name, "_fastdist_reset_seed": reset_seed}
        cls = type("Fabric" + base_name, (_FabricMixin, base), attrs)
        cls.__doc__ = doc
        cls.__qualname__ = "Fabric" + base_name
        _classes[key] = cls
    return _classes[key]


def __getattr__(name: str) -> Any:
    if name == "DDPStrategy":
        return ddp_strategy_class()
    if name == "FabricDDPStrategy":
        return fabric_ddp_strategy_class()
    if name == "ModelParallelStrategy":
        return model_parallel_strategy_class()
    if name == "FabricModelParallelStrategy":
        return fabric_model_parallel_strategy_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
