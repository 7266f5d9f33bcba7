"""fastdist for Hugging Face Accelerate: a watched group under ``Accelerator()``, and a training
step that is redone in place after a fault, ``accumulate()`` included::

    import fastdist.accelerate
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    kwargs = InitProcessGroupKwargs(timeout=timedelta(minutes=10))
    fastdist.accelerate.init_process_group(kwargs)      # before Accelerator()
    accelerator = Accelerator(kwargs_handlers=[kwargs], gradient_accumulation_steps=2)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for x, y in loader:
        with accelerator.accumulate(model):
            def step():
                accelerator.backward(loss_fn(model(x), y))
                opt.step()
                opt.zero_grad()
            fastdist.accelerate.step(accelerator, step, timeout=30)

Accelerate makes its group only when none exists (``PartialState``), so the group made here is
the one Accelerate uses, and every op on it (DDP's all-reduces, ``gather``, ``reduce``,
``wait_for_everyone``) is watched. Launch with ``fastdist run`` or ``torchrun`` (``accelerate
launch --multi_gpu --num_processes N`` runs torchrun itself). ``accelerate launch --cpu`` starts a
single process whatever ``--num_processes`` says, with no RANK or WORLD_SIZE:
:func:`init_process_group` refuses it, naming ``fastdist run --nproc-per-node N``.

Which launcher replaces a dead worker: only ``fastdist run`` (with a step per accumulation window
and ``state=``, see :func:`step`; a shuffled loader's order goes in ``state`` as
:class:`LoaderState`). torchrun and ``accelerate launch`` end the job when a worker
dies, or with ``--max-restarts`` restart every worker; a stalled rank is recovered in place under
any of them.
"""

from __future__ import annotations

import datetime
import os
import warnings
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .deadlines import fail_after
from .process_group import init_process_group as _init_process_group
from .steps import StepStart, check_retries, positive_seconds, redo_after_fault, snapshot_at_start

T = TypeVar("T")


def init_process_group(*kwargs_handlers: Any, backend: str | None = None) -> None:
    """Makes the default group with :func:`fastdist.init_process_group` from the launcher's
    environment (torchrun's), before ``Accelerator()``. Given the ``InitProcessGroupKwargs``
    among ``kwargs_handlers`` (pass the ones you give ``Accelerator``), its ``backend`` and
    ``timeout`` are used as Accelerate would use them: only the values set on it; otherwise the
    backend is NCCL when CUDA is available and gloo if not, and the timeout fastdist's default.
    A group that exists already is left as it is."""
    from accelerate.utils import InitProcessGroupKwargs

    _watch_epoch_starts()
    if torch.distributed.is_initialized():
        return
    _refuse_a_lone_cpu_launch()
    given: dict[str, Any] = {}
    for handler in kwargs_handlers:
        if isinstance(handler, InitProcessGroupKwargs):
            given = handler.to_kwargs()  # only what differs from the defaults, as Accelerate reads it
        elif not hasattr(handler, "to_kwargs"):
            raise TypeError(
                f"kwargs_handlers must be Accelerate kwargs handlers, got {type(handler).__name__}"
            )
    chosen = backend or given.get("backend") or ("nccl" if torch.cuda.is_available() else "gloo")
    _init_process_group(chosen, init_method=given.get("init_method"), timeout=given.get("timeout"))


def _refuse_a_lone_cpu_launch() -> None:
    """``accelerate launch --cpu --num_processes N`` (without mpirun) starts one process, with
    MASTER_ADDR but no RANK or WORLD_SIZE: the group could not be made (torch's error names
    neither the launcher nor the fix), and training on one process would pass for N."""
    if os.environ.get("ACCELERATE_USE_CPU", "").strip().lower() not in ("1", "y", "yes", "t", "true", "on"):
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    raise ValueError(
        "fastdist.accelerate: `accelerate launch --cpu` started this one process with no RANK or "
        "WORLD_SIZE; for several CPU processes launch with `fastdist run --nproc-per-node N "
        "script.py` (or torchrun)"
    )


def step(
    accelerator: Any,
    fn: Callable[[], T],
    *,
    timeout: float | datetime.timedelta,
    max_retries: int = 3,
    recover_timeout: float | datetime.timedelta = 60.0,
    state: Any = None,
    snapshot: Any = None,
    step_number: int | None = None,
) -> T:
    """Runs ``fn`` (forward, ``accelerator.backward``, the optimizers' step and zero_grad) in
    ``fail_after(timeout)``; after a fault, :func:`fastdist.recover` and ``fn`` again, at most
    ``max_retries`` times, with the RNG state, the accelerator's micro-batch count and, under
    gradient accumulation, the gradients it started with (so the redone step sums the same
    micro-batches as an undisturbed run). Call it once per micro-batch inside
    ``accelerator.accumulate(model)``, or once per accumulation window with the window's
    micro-batches (each in ``accumulate``) inside ``fn``: the whole window is then redone.

    ``state`` (a dict of Statefuls: model, optimizer, scheduler, your loop's position) is handed
    to a replacement of a dead rank in the recovery (``fastdist run``): the replacement calls
    ``fastdist.sync_state(state)`` before its loop and goes on from that position (with
    accumulation, step per window: the dead rank's earlier micro-batches died with it).
    Sharded state (Accelerate's FSDP2 plugin): ``snapshot`` and ``step_number`` as in
    :func:`fastdist.run_step`, the snapshot of the step's start taken here.

    A step whose optimizer had already updated the parameters when it failed (a collective after
    ``opt.step()`` inside ``fn``) is not redone: ``RuntimeError``. Keep logging and metric
    collectives (``gather``, ``reduce``) after ``step``. An accelerator that runs this process
    alone in a job of several processes (on CPU without ``Accelerator(cpu=True)``) is refused:
    ``ValueError``."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    optimizers = getattr(accelerator, "_optimizers", None)
    if optimizers is None:
        raise TypeError(f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}")
    seconds = positive_seconds(timeout, "timeout")
    retries = check_retries(max_retries)
    recover_seconds = positive_seconds(recover_timeout, "recover_timeout")
    _check_distributed(accelerator)
    start = _Start(accelerator, optimizers)
    on_retry = snapshot_at_start(snapshot, step_number, state)
    if state is not None:
        _hint_loader_state(accelerator, state)

    def attempt() -> T:
        with fail_after(seconds):
            return fn()

    result, _ = redo_after_fault(
        attempt,
        start,
        max_retries=retries,
        recover_timeout=recover_seconds,
        state=state,
        snapshot=snapshot,
        on_retry=on_retry,
    )
    return result


def _check_distributed(accelerator: Any) -> None:
    """Refuses an accelerator that runs this process alone in a job of several: Accelerate makes
    a CPU job distributed only with ``Accelerator(cpu=True)`` and otherwise leaves each process to
    train on its own (no all-reduce, every loader unsharded, every model different), silently."""
    _refuse_alone(
        "accelerator",
        getattr(accelerator, "num_processes", None),
        f"the Accelerator runs it alone (distributed_type {getattr(accelerator, 'distributed_type', '?')})",
        "On CPU make it with Accelerator(cpu=True, ...)",
    )


def _refuse_alone(argument: str, processes: object, how: str, fix: str) -> None:
    """``ValueError`` naming ``argument`` when a framework object says it runs ``processes`` == 1
    process (``how``, in words) while this process is one rank of a distributed job of several:
    each process would train its own model, silently. ``fix``: what to pass on CPU."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 or processes != 1:
        return
    raise ValueError(
        f"{argument}: this process is rank {dist.get_rank()} of a job of {dist.get_world_size()}, but "
        f"{how}: each process would train its own model. {fix}; on GPUs launch with fastdist run or torchrun"
    )


# The prepared loaders whose missing LoaderState was said (once per loader and process).
_hinted: weakref.WeakSet[Any] = weakref.WeakSet()


def _hint_loader_state(accelerator: Any, state: Any) -> None:
    """Warns, once per loader, when ``state`` (what a replacement is handed) lacks the
    :class:`LoaderState` of a shuffled loader the accelerator prepared: a replacement's iterator
    would then broadcast Accelerate's RNG state alone, fail, and every replacement after it."""
    if not isinstance(state, dict):
        return
    handed = {id(v.loader) for v in state.values() if isinstance(v, LoaderState)}
    for loader in getattr(accelerator, "_dataloaders", ()):
        if getattr(loader, "synchronized_generator", None) is None or id(loader) in handed:
            continue
        try:
            if loader in _hinted:
                continue
            _hinted.add(loader)
        except TypeError:  # (not weakly referable: said every step rather than never)
            pass
        warnings.warn(
            "fastdist.accelerate.step: state= hands a replacement of a dead rank the model, but not the "
            f"shuffle order of the loader {type(loader).__name__} the accelerator prepared: its iterator "
            "would broadcast Accelerate's RNG state alone and fail, and so would every replacement after "
            "it. Add fastdist.accelerate.LoaderState(loader) to state",
            RuntimeWarning,
            stacklevel=3,
        )


class LoaderState:
    """A Stateful for ``state=`` that hands a joiner the shuffle order of an Accelerate data loader
    (``shuffle=True``) in the epoch the live ranks are in::

        state = {"model": model, "optim": opt, "progress": progress,
                 "data": fastdist.accelerate.LoaderState(loader)}

    Accelerate draws each epoch's order from a generator that every rank sets, as the epoch's
    iterator starts, to rank 0's state (a ``broadcast``). A replacement that starts its iterator
    mid-epoch (``skip_first_batches``) would issue that broadcast alone, and the job would fail
    on it. This entry carries the states the live ranks' generators (and any other RNG in the
    loader's ``rng_types``) were set to at the epoch's start; the joiner's first iterator takes
    them instead of broadcasting, so it draws the live ranks' order and skips to their batch.
    Later epochs broadcast on every rank again. Needs :func:`init_process_group` (it sets this
    up). A loader without shuffling hands over nothing.

    (Accelerate's ``use_seedable_sampler=True`` seeds each epoch's order from a fixed seed and
    the epoch number, with no broadcast: such a loader needs no entry.)"""

    def __init__(self, loader: Any) -> None:
        if not hasattr(loader, "rng_types") or not hasattr(loader, "synchronized_generator"):
            raise TypeError(
                f"loader must be a data loader prepared by Accelerate (accelerator.prepare), got "
                f"{type(loader).__name__}"
            )
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        """The RNG states the loader's generators were set to at the start of its current epoch in
        this process, as ``{"epoch_start": ...}`` (empty before any epoch started)."""
        started = _epochs_of(self.loader.synchronized_generator).start
        return {"epoch_start": dict(started) if started is not None else {}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Takes the epoch-start RNG states of ``sd`` (a :meth:`state_dict`) for the loader's first
        epoch when it has started none in this process (a joiner); a process already in an epoch
        keeps its own. Raises TypeError when ``sd`` is not a LoaderState's state dict."""
        if not isinstance(sd, dict) or not isinstance(sd.get("epoch_start"), dict):
            raise TypeError(f"not a LoaderState's state_dict: {sd!r}")
        epochs = _epochs_of(self.loader.synchronized_generator)
        if sd["epoch_start"] and epochs.start is None:
            # A process whose loader never started an epoch (a joiner): its first one takes these.
            # A live rank that loads them (it had got further) is mid-epoch already: its next
            # epoch broadcasts with the others.
            epochs.pending = sd["epoch_start"]


class _Epochs:
    """A loader generator's epochs in this process: the RNG states set at the start of the
    current one (None: none started here yet), and states handed over for its first one."""

    __slots__ = ("pending", "start")

    def __init__(self) -> None:
        self.start: dict[str, torch.Tensor] | None = None
        self.pending: dict[str, torch.Tensor] | None = None


# By generator, held weakly: a generator's record dies with it (one keyed by id() could pass to a
# new generator at the same address). None (the global RNG) has one of its own.
_epochs: weakref.WeakKeyDictionary[Any, _Epochs] = weakref.WeakKeyDictionary()
_global_epochs = _Epochs()
# torch 2.11's Generator takes no weak reference: its record is kept with the generator itself,
# held strongly (so that its id() is never another generator's).
_held: dict[int, tuple[Any, _Epochs]] = {}


def _epochs_of(generator: Any) -> _Epochs:
    if generator is None:
        return _global_epochs
    try:
        epochs = _epochs.get(generator)
        if epochs is None:
            epochs = _epochs[generator] = _Epochs()
        return epochs
    except TypeError:  # cannot create weak reference
        return _held.setdefault(id(generator), (generator, _Epochs()))[1]


def _rng_state(rng_type: str, generator: Any) -> torch.Tensor:
    return generator.get_state() if rng_type == "generator" else torch.get_rng_state()


def _set_rng_state(rng_type: str, generator: Any, state: torch.Tensor) -> None:
    # A tensor of its own: torch reads an RNG state from the start of its storage, and a state
    # handed over is a view into the transfer's buffer ("Invalid mt19937 state", or a crash).
    state = state.detach().to("cpu", torch.uint8).clone()
    if rng_type == "generator":
        generator.set_state(state)
    else:
        torch.set_rng_state(state)


def _watch_epoch_starts() -> None:
    """Wraps the ``synchronize_rng_states`` Accelerate's loaders call as each epoch starts: it
    records what they were set to (see :class:`LoaderState`), and on a joiner's first epoch sets
    what the live ranks handed over instead of broadcasting."""
    from accelerate import data_loader

    real = data_loader.synchronize_rng_states
    if getattr(real, "_fastdist", False):
        return

    def synchronize_rng_states(rng_types: Any, generator: Any = None) -> None:
        names = [getattr(t, "value", t) for t in rng_types]
        epochs = _epochs_of(generator)
        pending, epochs.pending = epochs.pending, None
        if pending is not None and set(pending) == {n for n in names if n in ("generator", "torch")}:
            for name in names:
                _set_rng_state(name, generator, pending[name])
        else:
            real(rng_types, generator)
        epochs.start = {n: _rng_state(n, generator).clone() for n in names if n in ("generator", "torch")}

    synchronize_rng_states._fastdist = True  # type: ignore[attr-defined]
    data_loader.synchronize_rng_states = synchronize_rng_states


class _Start(StepStart):
    """The generic step start and the accelerator's micro-batch count, which ``accumulate()``
    advances on entry (a step over a whole window enters it once per micro-batch)."""

    def __init__(self, accelerator: Any, optimizers: Any) -> None:
        super().__init__(optimizers, keep_grads=accelerator.gradient_accumulation_steps > 1)
        self.accelerator = accelerator
        self.count = accelerator.step

    def restore(self) -> None:
        super().restore()
        self.accelerator.step = self.count
