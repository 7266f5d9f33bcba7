"""What follows an op's deadline, on either op path (the watched backend's faults,
fastdist.ops.watching, and fastdist.ops.unwatched): one sequence, written once.

The group is marked dead (an NCCL-like group's communicators start aborting, bounded, in the
background), the who-is-missing report is gathered (fastdist.diagnostics.board), and the
:class:`CollectiveTimeoutError` is built from it. Counting the fault and running the timeout
handler stay with the caller, which knows who waits."""

from __future__ import annotations

import math
import time
from typing import Any

from ..deadlines import current_time
from ..diagnostics import board, verdict
from ..errors import CollectiveTimeoutError
from ..groups import pgstate
from ..groups.opcall import OpCall
from ..store import job
from ..store.job import JOB
from . import polled


def timed_out(
    call: OpCall,
    cause: str | None = None,
    *,
    abandoned: Any = None,
    late: str | None = None,
    rung_by: str | None = None,
) -> CollectiveTimeoutError:
    """The error for ``call``, whose deadline passed (``call.last_seen`` filled in). ``cause``:
    what the backend or the caller said; a store that stopped answering this rank's report
    replaces it. ``abandoned``: the token of the op still in flight (see
    :func:`pgstate.mark_dead`). ``late``: why the error comes after the deadline (Python could
    not run then), put first. ``rung_by``: the peer (``"rank N"``) whose timeout of the same op
    rang this rank first: its report is read, not gathered again."""
    st = call.st
    who = rung_by or f"rank {st.my_global_rank}"
    pgstate.mark_dead(call.pg, f"{call.name} timed out on {who}", abandoned=abandoned)
    if st.polled:
        hung = verdict.timeout_error(call, None, "aborting the communicators hung")
        polled.abort_group(call.pg, st.is_default, hung)
    window = call.deadline - call.start if math.isfinite(call.deadline) else 1.0
    if rung_by is not None:
        rep = board.report(st, call.op, call.seq, "aborted", window, rung=True)
    else:
        rep = board.report(st, call.op, call.seq, "timed_out", window)
        if rep is None and JOB.failure is not None:
            cause = JOB.store_gone_reason()
    if late:
        cause = late + (f"; {cause}" if cause else "")
    if rep is not None and rung_by is None:
        silent = [r for r in rep.missing if r not in rep.stacks]  # never reached it, did not answer
        if silent:  # fastdist run's agent kills a rank that stays silent (a frozen process)
            began = time.time() - (current_time() - call.start)
            job.name_missing(silent, st.my_global_rank, f"{call.name} on group {st.name!r}", began)
    return verdict.timeout_error(call, rep, cause)
