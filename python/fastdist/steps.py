"""A training step that is redone in place after a fault: ``fastdist.run_step``.

Every framework integration (fastdist.lightning, fastdist.accelerate) and a loop written by hand
share the rule of this module: the step runs in ``fail_after(timeout)``; when it raises a
:class:`~fastdist.FastdistError`, what the failed attempt changed is put back (the gradients of the
earlier micro-batches when accumulating, the RNG state), :func:`fastdist.recover` rebuilds the
group (a replacement that joins there is handed ``state`` as it was when the step began), and the
step runs again, at most ``max_retries`` times. A step whose optimizer had already
updated the parameters when it failed is never redone (that would apply the update twice): it
raises ``RuntimeError`` saying so (not a FastdistError: a handler that recovers and retries must
not catch it). Nor is a step redone when the fault split the live ranks (one had applied the
previous step's update, another had not: a rank that died mid-all-reduce let one neighbour's
return and not the other's): ``recover(state=)`` gives them all the state of the one that got
least far, but a rank that got further is past that step's batch, which only the caller's loop can
take it back to; ``RuntimeError`` says so on every rank.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .deadlines import fail_after, validate_seconds
from .errors import FastdistError, RecoveryError
from .recovery import randomness, reconcile
from .recovery.recover import recover
from .recovery.snapshot import PeerSnapshot

log = logging.getLogger("fastdist")

T = TypeVar("T")


def check_retries(max_retries: object) -> int:
    """``max_retries``, checked: TypeError unless it is an int (not a bool), ValueError when it is
    negative."""
    if isinstance(max_retries, bool) or not isinstance(max_retries, int):
        raise TypeError(f"max_retries must be an int, got {type(max_retries).__name__}: {max_retries!r}")
    if max_retries < 0:
        raise ValueError(f"max_retries must be >= 0, got {max_retries}")
    return max_retries


def positive_seconds(value: object, name: str) -> float:
    """``value`` (the argument ``name``: a number of seconds or a ``datetime.timedelta``) in
    seconds; raises TypeError for None or another type, ValueError unless it is positive."""
    if value is None:
        raise TypeError(f"{name} must be a number of seconds or a datetime.timedelta, got None")
    seconds = validate_seconds(value, name)
    if seconds <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return seconds


def _inner(optimizer: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (Accelerate's AcceleratedOptimizer, a
    torch Optimizer subclass that holds the real one; Lightning's LightningOptimizer)."""
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizers must hold torch.optim.Optimizer objects, got {type(optimizer).__name__}")
    return optimizer


class StepStart:
    """What a step changes before its optimizer update and must be as it was when the step is
    redone: the gradients (``keep_grads``) and the RNG state. It also counts the optimizers'
    updates during the attempt, so that a step that failed after one is not redone.

    ``keep_grads``: ``None`` (the default) puts the gradients back as they were at the start,
    whatever the step does with them: parameters without one get none again (free), and those
    with one get a copy taken here (one copy of those gradients per step: an accumulation window,
    or ``zero_grad(set_to_none=False)``). ``True`` does the same; ``False`` leaves them as the
    failed attempt left them: only for a step that zeroes its gradients before its backward
    (then no copy is ever taken)."""

    def __init__(self, optimizers: Iterable[Any] = (), keep_grads: bool | None = None) -> None:
        self.optimizers = [_inner(o) for o in optimizers]
        self.grads: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        if keep_grads is not False:
            for opt in self.optimizers:
                for group in opt.param_groups:
                    for p in group["params"]:
                        self.grads.append((p, None if p.grad is None else p.grad.detach().clone()))
        # On a replacement that joined the redo of this step: its predecessor's random state now.
        self.count = randomness.next_count()
        randomness.take_pending(self.count)
        self.random = randomness.everything()  # torch's CPU and CUDA generators, Python's, NumPy's
        # Under fastdist run, sent to the job's store: a replacement of this rank that joins the
        # redo of this step draws what this rank would have (fastdist.recovery.randomness).
        randomness.publish(self.count, self.random)
        self.updates = 0
        self._hooks: list[Any] = []

    def __enter__(self) -> StepStart:  # noqa: PYI034 (subclasses need nothing else)
        def count(*_: Any) -> None:
            self.updates += 1

        self._hooks = [opt.register_step_post_hook(count) for opt in self.optimizers]
        return self

    def __exit__(self, *_: object) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def restore(self) -> None:
        """Puts back what the step began with: the gradients kept at the start and the random
        states (torch's CPU and CUDA generators, Python's, NumPy's); the count of optimizer
        updates starts again at 0."""
        for p, grad in self.grads:
            if grad is None:
                p.grad = None
            elif p.grad is None:
                p.grad = grad.clone()
            else:
                p.grad.copy_(grad)
        randomness.put_back(self.random)
        self.updates = 0


def redo_after_fault(
    attempt: Callable[[], T],
    start: StepStart,
    *,
    max_retries: int,
    recover_timeout: float,
    group: Any = None,
    state: Any = None,
    on_retry: Callable[[], None] | None = None,
    snapshot: Any = None,
) -> tuple[T, int]:
    """Runs ``attempt`` until it returns, recovering and restoring ``start`` after each fault;
    returns its result and how many times it was redone. ``snapshot``: a PeerSnapshot of
    ``state`` taken at this step's start (a replacement of a dead rank then gets its shards)."""
    failures = 0
    take = getattr(on_retry, "take", None)  # a step's snapshot of its start: part of the attempt
    finished = getattr(on_retry, "done", None)
    while True:
        try:
            if take is not None:
                take(start)
            with start:
                result = attempt()
            if finished is not None:
                finished(attempt, start)
            return result, failures
        except FastdistError as err:
            failures += 1
            if start.updates:
                raise RuntimeError(
                    f"fastdist: the step failed after its optimizer had updated the parameters ({err}); "
                    "redoing it would apply the update twice: keep collectives that follow optimizer.step() "
                    "(logging, metrics) out of the step, and call fastdist.recover() before going on"
                ) from err
            if failures > max_retries:
                raise
            log.warning(
                "fastdist: step failed (%s); recovering and redoing it (%d of %d)", err, failures, max_retries
            )
            # Put back first: a rank that joins in the recovery is handed the step's start.
            start.restore()
            pg, failures = _recover_again_after_handover_faults(
                group, recover_timeout, state, snapshot, failures, max_retries
            )
            done = reconcile.last(pg)
            if done is not None and done.split:
                raise RuntimeError(_split_message(done)) from err
            if on_retry is not None:
                on_retry()


def _recover_again_after_handover_faults(
    group: Any, timeout: float, state: Any, snapshot: Any, failures: int, max_retries: int
) -> tuple[Any, int]:
    """``recover()``, and again while it fails because a rank died or stalled in the hand-over of
    the state (a replacement dying while it loads it, the rank sending it dying: one more fault,
    counted against ``max_retries``; the launcher starts a new replacement meanwhile). Returns the
    group and the failures counted."""
    while True:
        try:
            return recover(group, timeout=timeout, state=state, snapshot=snapshot), failures
        except RecoveryError as err:
            failures += 1
            if not err.retryable or failures > max_retries:
                raise
            log.warning(
                "fastdist: recovery failed (%s); recovering again (%d of %d)", err, failures, max_retries
            )


class _SnapshotAtStart:
    """A step's snapshot of its start (see :func:`snapshot_at_start`): :meth:`take` before each
    attempt, inside ``redo_after_fault``'s retry (a rank dying in the exchange is one more fault);
    called after a recovery, the check of where it rolled back to: this step's start (the step is
    redone), the previous step's (a rank died in this step's exchange before its copy left: the
    previous step is redone first, with the replacement, see :meth:`_redo_previous`), or further
    back (:class:`~fastdist.RecoveryError`: the loop cannot go back)."""

    def __init__(self, snapshot: PeerSnapshot, step: int) -> None:
        self.snapshot, self.step = snapshot, step
        self._redo_pending = False

    def take(self, start: StepStart | None = None) -> None:
        snap = self.snapshot
        if snap.catch_up_to is not None and self.step >= snap.catch_up_to:
            snap.catch_up_to = None  # a replacement that rolled back is where the live ranks are
        if self._redo_pending:
            self._redo_previous(start)
        # Not again where it is the latest already (a replacement joining the live ranks' redo
        # of this step restored it, or a recovery rolled back to it and took it afresh).
        if snap.sharded and self.step != snap.latest():
            snap.take(self.step)

    def done(self, attempt: Callable[[], Any], start: StepStart) -> None:
        """The step is done: kept (with what it began with) until the next is, to be redone if a
        death in the next step's exchange rolls the job back to this step's start."""
        self.snapshot.previous = (self.step, attempt, start)

    def _redo_previous(self, start: StepStart | None) -> None:
        """The recovery rolled every rank back to the previous step's start (its snapshot): the
        replacement redoes that step from it, and so do the live ranks here, with the attempt they
        kept and what it began with, so that every collective of it has its peer. Then each live
        rank loads back its own copy of this step's start (its state never changed: the redo only
        gave the replacement its shards) and the attempt's start, and this step goes on."""
        snap = self.snapshot
        assert snap.previous is not None
        _, attempt, previous_start = snap.previous
        own = snap.own_at(self.step)
        if own is None:
            raise RecoveryError(
                group="default",
                rank=snap.rank,
                generation=-1,
                reason=f"this rank holds no copy of its state at step {self.step}'s start",
                missing_ranks=None,
                retryable=False,
            )
        previous_start.restore()
        with previous_start:
            attempt()
        self._redo_pending = False
        snap.load(own)
        snap.restored_step = None
        if start is not None:
            start.restore()
        log.warning(
            "fastdist: rank %d redid step %d with the replacement (a death in the exchange of step %d's "
            "snapshot rolled the job back to step %d's start), and goes on with step %d",
            snap.rank,
            self.step - 1,
            self.step,
            self.step - 1,
            self.step,
        )

    def __call__(self) -> None:
        restored = self.snapshot.restored_step
        if restored is None:  # nothing rolled back (a stall): a redo of the previous step still pending stays
            return
        if restored == self.step:
            self._redo_pending = False
            return
        previous = self.snapshot.previous
        if restored == self.step - 1 and previous is not None and previous[0] == restored:
            self._redo_pending = True  # done first thing in the next attempt (a fault there: one more)
            return
        raise RecoveryError(
            group="default",
            rank=dist.get_rank() if dist.is_initialized() else -1,
            generation=-1,
            reason=(
                f"the recovery rolled back to the snapshot of step {restored}, and the loop is at step "
                f"{self.step}: only the previous step's start, whose step this rank did with the same "
                "snapshot, can be redone in place. Restart the job from a checkpoint "
                "(fastdist.load_checkpoint)"
            ),
            missing_ranks=None,
            retryable=False,
        )


def snapshot_at_start(snapshot: Any, step: object, state: Any) -> Callable[[], None] | None:
    """For a step redone from a :class:`fastdist.PeerSnapshot` of its start (``snapshot``, of
    ``state``, at step number ``step``): the snapshot of the step's start, which
    ``redo_after_fault`` takes before each attempt (a rank dying in its exchange is a fault like
    any other: recovered, and a replacement joins; the copies of the dead rank that reached the
    ranks keeping them are used), and, as its ``on_retry``, the check that a recovery rolled back
    to this step's start if it rolled back at all (the loop cannot go back further:
    :class:`~fastdist.RecoveryError`). The arguments are checked first, under the names the callers
    take them by."""
    if snapshot is None:
        return None
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(
            f"step_number must be an int when snapshot is given, got {type(step).__name__}: {step!r}"
        )
    if not isinstance(snapshot, PeerSnapshot):
        raise TypeError(f"snapshot must be a fastdist.PeerSnapshot, got {type(snapshot).__name__}")
    if state is None:
        raise ValueError("snapshot needs state= (the state it copies, handed to a replacement)")
    return _SnapshotAtStart(snapshot, step)


def _split_message(done: reconcile.Reconciliation) -> str:
    what = (
        "they kept their states (no state= was passed), which differ"
        if done.diverged
        else f"every rank now holds rank {done.source}'s state"
    )
    return (
        f"fastdist: the live ranks were split when the step failed ({done.describe(sorted(done.counts))}): "
        f"{', '.join(f'rank {r}' for r in done.applied)} had applied an optimizer update that rank "
        f"{done.source} had not, and {what}. The step cannot be redone in place: a rank that got further "
        "is past the batch of the step it must redo. Keep the loop's position in state= and recover in "
        "the loop itself (docs/replacement.md), or restart the job from a checkpoint"
    )


def run_step(
    step: Callable[[], T],
    *,
    timeout: float | datetime.timedelta,
    optimizers: Iterable[Any] = (),
    keep_grads: bool | None = None,
    max_retries: int = 3,
    recover_timeout: float | datetime.timedelta = 60.0,
    group: Any = None,
    state: Any = None,
    snapshot: Any = None,
    step_number: int | None = None,
) -> T:
    """Runs ``step()`` (forward, backward, optimizer update) with a deadline, and after a fault
    recovers the group and runs it again in place::

        for batch in loader:
            def step():
                opt.zero_grad()
                loss_fn(model(batch)).backward()
                opt.step()
            fastdist.run_step(step, timeout=30, optimizers=[opt])

    ``optimizers``: the step's optimizers (wrapped ones too). An attempt during which one of them
    updated the parameters is not redone: ``RuntimeError``. Before a retry the gradients are put
    back as they were at the step's start (``keep_grads=None``, the default: a step that does
    not zero them, a micro-batch of an accumulation window or a Trainer's ``training_step``, is
    redone without drift; gradients that exist at the start are copied each step, those that do
    not cost nothing). ``keep_grads=False`` skips that, for a step that zeroes its gradients before
    its backward and keeps them allocated (``zero_grad(set_to_none=False)``): no copy. The RNG
    state is put back too. After ``max_retries`` faults the last error is raised. ``state`` is passed
    to :func:`recover` (a replacement of a dead rank is brought up to date with it).

    Sharded state (FSDP2): ``snapshot``, a :class:`fastdist.PeerSnapshot` of ``state``, and
    ``step_number``, the step's number (the same on every rank, one more each step): the snapshot
    of the step's start is taken here before the step runs, so that a replacement of a dead rank
    gets its predecessor's shards and every rank redoes the step from its start (a replacement
    joining that redo skips the snapshot: it restored it). A rank that dies in that exchange
    before its own copy left rolls every rank back to the previous step's start: the replacement
    redoes that step in its loop, the live ranks here with the attempt they kept from it, then put
    their own state back and go on with this step (docs/snapshots.md)::

        snap = fastdist.PeerSnapshot(state, every=1, copies=1)
        fastdist.sync_state(state, snapshot=snap)
        while progress.step < steps:
            fastdist.run_step(step, timeout=30, optimizers=[opt], state=state,
                              snapshot=snap, step_number=progress.step)
            progress.step += 1

    When the fault
    split the live ranks (one had applied the previous step's update and another had not), the
    step is not redone: ``RuntimeError`` on every rank.
    """
    if not callable(step):
        raise TypeError(f"step must be callable, got {type(step).__name__}")
    seconds = positive_seconds(timeout, "timeout")
    retries = check_retries(max_retries)
    recover_seconds = positive_seconds(recover_timeout, "recover_timeout")
    if keep_grads is not None and not isinstance(keep_grads, bool):
        raise TypeError(f"keep_grads must be a bool or None, got {type(keep_grads).__name__}: {keep_grads!r}")
    start = StepStart(optimizers, keep_grads)
    on_retry = snapshot_at_start(snapshot, step_number, state)

    def attempt() -> T:
        with fail_after(seconds):
            return step()

    result, _ = redo_after_fault(
        attempt,
        start,
        max_retries=retries,
        recover_timeout=recover_seconds,
        group=group,
        state=state,
        snapshot=snapshot,
        on_retry=on_retry,
    )
    return result
