"""How far each live rank got before its group failed, so that ``recover(state=)`` leaves every
member with the same state.

A fault can split the live ranks: gloo's ring all-reduce returns on a rank once it holds the
whole result, while a neighbour still waits for its last chunk from the rank that died. One live
rank then applies the step's update (DDP's all-reduce returned, ``opt.step()`` ran), another does
not (its all-reduce raised). Handing only the joiners a state would leave the live ranks with
different models.

What a rank's state has seen is measured by its group's op count: how many of its ops, numbered
in order (the same numbers on every rank that issues the same ops), completed before the first
one that did not (an op refused on a dead group is never numbered, so the count of ops issued
would not do: a rank whose next op was refused would tie with one whose last op failed). An
update needs every op of its step to complete on the rank that applies it, and a rank issues the
next step's ops only after its update; so of two live ranks, the one whose count is lower cannot
have applied an update that the other has not, and two ranks with the same count applied the
same updates. The live rank with the lowest count (ties: the lowest rank) is the source: every
joiner, and every live rank whose count differs from the source's, loads the source's state, and
the failed step is redone once, everywhere.

The count is kept per group as an offset (``GroupState.op_base``: the count the state held when
the group's numbering last started at op 1) plus the leading completed ops in the group's history
since. The count taken when a recovery began is kept until that recovery completes
(``Lineage.pending``, by the group's name: a shrink makes a new group object): a
recovery that failed midway (a joiner that died in the hand-over) is retried with the counts of
the training, not those of the hand-over's own ops.

Counts can also differ with equal states (a broadcast whose root completed while a receiver's
failed, before any update): the hand-over is then harmless, but a caller that cannot redo a step
that a rank had finished (``fastdist.run_step``) must tell the two apart. So each rank also sends
how many optimizer updates it applied since the numbering last started (every
``torch.optim.Optimizer.step()`` in the process is counted); updates that differ between live
ranks are a split of their states (:attr:`Reconciliation.split`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..deadlines import fail_at
from ..errors import FastdistError
from ..groups import pgstate
from . import state_sync

logger = logging.getLogger(__name__)

# Optimizer updates applied in this process: all of them, and when the numbering last restarted.
_updates = [0, 0]


def _count_update(*_: Any) -> None:
    _updates[0] += 1


register_optimizer_step_post_hook(_count_update)


@dataclass(frozen=True)
class Reconciliation:
    """What a recovery found about how far the members had got, by global rank: ``counts``, the
    op count of each one's state, and ``updates``, the optimizer updates each had applied since
    the last recovery (-1: a joiner). ``source``: the live rank whose state the joiners and the
    ``ahead`` ranks loaded; ``ahead``: live ranks whose count differed from the source's, which
    loaded its state; ``diverged``: the same, when recover() was called without ``state=`` (they
    kept their own states)."""

    source: int
    counts: dict[int, int]
    updates: dict[int, int]
    ahead: list[int] = field(default_factory=list)
    diverged: list[int] = field(default_factory=list)

    @property
    def applied(self) -> list[int]:
        """The live ranks that had applied an optimizer update that the source had not."""
        return sorted(r for r, n in self.updates.items() if n >= 0 and n != self.updates[self.source])

    @property
    def split(self) -> bool:
        """Whether the live ranks' states differed: one had applied an update that another had
        not (counted as torch optimizers' updates)."""
        return bool(self.applied)

    def describe(self, ranks: list[int]) -> str:
        """Where each of ``ranks`` had got: its op count and optimizer updates."""
        return "; ".join(
            f"rank {r}: joined"
            if self.counts[r] < 0
            else f"rank {r}: op {self.counts[r]}, {self.updates[r]} updates"
            for r in ranks
        )


def ops_done(st: pgstate.GroupState) -> int:
    """The ops of ``st``'s group (every backend of it) that completed on this rank, in order, since
    its numbering last started: up to the first that failed, timed out or never ended."""
    total = 0
    for ctl in st.ctls():
        done = int(ctl.seq)
        for rec in ctl.history():  # oldest first
            if rec["outcome"] != "ok":
                done = int(rec["seq"]) - 1
                break
        total += done
    return total


def begin(st: pgstate.GroupState) -> tuple[int, int]:
    """This rank's op count and optimizer updates, taken when a recovery of the group begins, before
    anything renumbers its ops; a recovery that failed midway keeps what was taken before it."""
    got = st.lineage.pending
    if got is None:
        got = (st.op_base + ops_done(st), _updates[0] - _updates[1])
        st.lineage.pending = got
    return got


def exchange(
    pg: Any, st: pgstate.GroupState, gen: int, mine: tuple[int, int], has_state: bool, deadline: float
) -> tuple[dict[int, int], dict[int, int], dict[int, bool]]:
    """Every member's op count, updates and whether it passed ``state=``, by global rank: one
    all-gather over the rebuilt group (a joiner sends -1), bounded by ``deadline``."""
    t = torch.tensor([*mine, int(has_state)], dtype=torch.int64, device=state_sync.device_of(pg))
    rows = [torch.empty_like(t) for _ in range(st.size)]
    try:
        with fail_at(deadline):
            dist.all_gather(rows, t, group=pg)
    except FastdistError as exc:
        raise st.recovery_error(gen, f"exchanging how far each rank had got failed: {exc}") from None
    got = {st.global_rank(r): [int(v) for v in row.tolist()] for r, row in enumerate(rows)}
    return (
        {r: v[0] for r, v in got.items()},
        {r: v[1] for r, v in got.items()},
        {r: bool(v[2]) for r, v in got.items()},
    )


def plan(
    counts: dict[int, int], updates: dict[int, int], has: dict[int, bool], joiners: list[int]
) -> Reconciliation | None:
    """Who sends and who loads (the same on every member: it reads only what every member
    gathered). None when no live rank is left (every rank joined anew)."""
    live = sorted(r for r in counts if r not in joiners and counts[r] >= 0)
    if not live:
        return None
    source = min(live, key=lambda r: (counts[r], r))
    differ = [r for r in live if counts[r] != counts[source]]
    alive = {r: updates[r] if r in live else -1 for r in updates}
    if differ and not all(has[r] for r in live):
        return Reconciliation(source, counts, alive, diverged=differ)
    return Reconciliation(source, counts, alive, ahead=differ)


def warn_diverged(me: int, done: Reconciliation) -> None:
    """Warns, in a log line of rank ``me``, that the live ranks had not all got as far when the
    group failed, so that their models may differ now; passing ``state=`` to recover() has every
    rank load the state of ``done.source``."""
    live = sorted(r for r, c in done.counts.items() if c >= 0)
    logger.warning(
        "rank %d: the live ranks had not all got as far when the group failed (%s): their models "
        "may differ now (a rank may have applied an update that another has not). Pass state= to "
        "recover() to have every rank load rank %d's state",
        me,
        done.describe(live),
        done.source,
    )


def finish(st: pgstate.GroupState, held: int, done: Reconciliation | None) -> None:
    """The recovery of the group of ``st`` (the group it made) completed on this rank, whose state is at count
    ``held``: every member numbers its ops from 1 again, in step."""
    renumber(st)
    st.op_base = held - ops_done(st)  # (0 ops done after the renumbering, unless it was skipped)
    st.lineage.pending = None
    st.reconciled = done


def forget(st: pgstate.GroupState) -> None:
    """A recovery of the group of ``st`` completed without comparing the members' counts."""
    st.lineage.pending = None
    _updates[1] = _updates[0]


def renumber(st: pgstate.GroupState) -> None:
    """Every op number of the group starts at 1 again, and the updates are counted afresh. Called
    on every member once its last recovery op (the hand-over's barrier) has returned, nothing of
    the group in flight: the p2p ops of a hand-over are issued by some members only, and the
    numbers of the next ops must be the same on every member (reports compare them)."""
    for ctl in st.ctls():
        if not ctl.dead:  # (a peer's fault that came since: the next op is refused, and recovered)
            ctl.revive()
    _updates[1] = _updates[0]


def last(group: Any) -> Reconciliation | None:
    """What the last recovery of ``group`` (the group recover() returned) found, if it compared
    the members' counts."""
    st = pgstate.peek(group)
    return None if st is None else st.reconciled
