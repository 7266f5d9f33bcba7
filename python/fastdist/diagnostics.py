"""Who is missing, and who is doing something else: the report made when a collective fails.

Nothing here runs on the fast path: a healthy collective never touches the store. When a
collective times out (or a peer closes the group), each rank that noticed writes one status
record for the group's current generation (the op and sequence number it is in) to the group's
store, then waits a short window for the others' records:

- a rank that wrote the same op and sequence number arrived and is stuck with us;
- a rank that wrote another op or sequence number is alive but desynced (it is in that op);
- a rank that wrote nothing within the window never arrived (hung, stopped, dead, or busy
  elsewhere without a deadline).

Every rank reads the same records, so every rank that times out gets the same report: no
circular blame. The window is min(1 s, 10% of the timeout), and ends early once every rank of the
group has written.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import _keys

if TYPE_CHECKING:
    from ._groups import GroupState

logger = logging.getLogger(__name__)

# Where the job's store lives, for messages when it is gone: "HOST:PORT (in rank 0)" (set by
# fastdist.init_process_group), and what the last failed store operation said.
store_location: str | None = None
store_failure: str | None = None


def store_gone_reason() -> str:
    """Says that the job's store is unreachable, and where it was."""
    where = f" at {store_location}" if store_location else ""
    return (
        f"the job's store{where} cannot be reached ({store_failure or 'connection lost'}): its host exited "
        "or was killed, and reports and recovery go through it; restart the job"
    )


# A rank's status record: what report() writes, and checks before it believes one.
_STATUS_FIELDS: dict[str, type | tuple[type, ...]] = {"op": str, "seq": int, "state": str, "t": (int, float)}
_STATES = ("timed_out", "aborted")
_INVALID: dict[str, Any] = {}

MAX_WINDOW_SECONDS = 1.0
WINDOW_FRACTION = 0.1
_POLL_SECONDS = 0.005


@dataclass
class Report:
    missing: list[int] = field(default_factory=list)  # global ranks that never reported
    desynced: dict[int, str] = field(default_factory=dict)  # global rank -> "op #seq"
    timed_out: list[int] = field(default_factory=list)  # global ranks whose own deadline passed
    first_timeout_wall: float | None = None  # time.time() of the earliest of those timeouts


def window(budget: float) -> float:
    return min(MAX_WINDOW_SECONDS, WINDOW_FRACTION * max(budget, 0.0))


def report(
    st: GroupState, op: str, seq: int, state: str, budget: float, until: float | None = None
) -> Report | None:
    """Publishes this rank's status (``state``: ``"timed_out"`` or ``"aborted"``) and collects the
    group's, for the window after now, or after ``until`` (a ``time.monotonic()`` value) when
    given. ``None`` when the group has no store or the store cannot be reached.

    A rank whose peer closed the group early passes its own deadline as ``until``: the ranks still
    waiting in the op report by then, and without them it would blame live ranks as missing."""
    store = st.store
    if store is None or st.size <= 1:
        return Report() if st.size <= 1 else None
    prefix = _keys.key("diag", st.name, st.generation)
    me = {"op": op, "seq": seq, "state": state, "t": time.time()}
    try:
        store.set(f"{prefix}/status/{st.rank}", json.dumps(me))
        count = store.add(f"{prefix}/count", 1)
        end = max(time.monotonic(), until or 0.0) + window(budget)
        while count < st.size and time.monotonic() < end:
            time.sleep(_POLL_SECONDS)
            count = store.add(f"{prefix}/count", 0)
        records: dict[int, dict[str, Any]] = {}
        for r in range(st.size):
            key = f"{prefix}/status/{r}"
            if r == st.rank:
                records[r] = me
            elif store.check([key]):
                rec = _keys.parse_record(store.get(key), _STATUS_FIELDS)
                records[r] = rec if rec is not None and rec["state"] in _STATES else _INVALID
    except Exception as exc:  # noqa: BLE001 - a dead store must not turn a timeout into another failure
        global store_failure
        store_failure = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        logger.warning(
            "rank %d: could not assemble the report for %s #%d: %s", st.my_global_rank, op, seq, store_failure
        )
        return None
    out = Report()
    for r in range(st.size):
        rec = records.get(r)
        g = st.global_rank(r)
        if rec is None:
            out.missing.append(g)
            continue
        if rec is _INVALID:
            out.desynced[g] = "an invalid status record (not fastdist's: is something else using this store?)"
            continue
        if (rec["op"], rec["seq"]) != (op, seq):
            out.desynced[g] = f"{rec['op']} #{rec['seq']}"
        if rec["state"] == "timed_out" and r != st.rank:
            out.timed_out.append(g)
            t = float(rec["t"])  # type: ignore[arg-type]  # checked: int or float
            out.first_timeout_wall = t if out.first_timeout_wall is None else min(out.first_timeout_wall, t)
    return out


def peer_closed_verdict(rep: Report | None, started_wall: float) -> tuple[str | None, str]:
    """What a report says about a group a peer closed under this rank's op (started at
    ``started_wall``, a time.time()): ``(cause, "")`` when a peer timed out while this rank was in
    the op (then this is a timeout too), else ``(None, why)``: this rank arrived after a peer had
    timed out and aborted (a straggler), or peers exited or were killed."""
    if (
        rep is not None
        and rep.timed_out
        and rep.first_timeout_wall is not None
        and rep.first_timeout_wall > started_wall
    ):
        return f"rank {min(rep.timed_out)} timed out first and closed the group", ""
    if rep is not None and rep.timed_out:
        return None, f"rank {min(rep.timed_out)} had timed out and aborted the group before this rank arrived"
    if rep is not None and rep.missing:
        many = len(rep.missing) > 1
        return (
            None,
            (
                f"rank{'s' if many else ''} {', '.join(map(str, rep.missing))} exited or "
                f"{'were' if many else 'was'} killed"
            ),
        )
    return None, "a peer exited or was killed"
