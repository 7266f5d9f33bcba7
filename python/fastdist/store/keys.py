"""Where fastdist's keys live in a job's store, and what the launcher says about it.

Every key fastdist writes (reports, checks, recovery generations, the version record) sits under
one prefix per launch attempt. torchrun restarts a failed worker group with
``--max-restarts`` on the same store (its agent's), and keys of one attempt must never be read by
the next: a recovery generation or a report count left by attempt 0 would otherwise decide
attempt 1's.
"""

from __future__ import annotations

import json
import os

from . import seal


def _attempt() -> int:
    # torchrun (torch.distributed.elastic) numbers the attempts of a worker group.
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    return int(value) if value.isdigit() else 0


ATTEMPT = _attempt()
ROOT = f"fastdist/attempt{ATTEMPT}" if ATTEMPT else "fastdist"


def key(*parts: object) -> str:
    """``ROOT/part/part...``: a key in this attempt's namespace."""
    return "/".join((ROOT, *map(str, parts)))


def inbox(global_rank: int) -> str:
    """The store queue a rank is rung through (fastdist.store.ring)."""
    return key("inbox", global_rank)


def board(group: str, generation: int) -> str:
    """The prefix of a group generation's report keys (fastdist.store.board)."""
    return key("diag", group, generation)


def pg_prefix() -> str:
    """The prefix of the workers' store under a torchrun (or ``fastdist run``) agent: their groups'
    keys and fastdist's keys through the default store (the fault inboxes among them) sit under it,
    apart from the agent's own."""
    return key("pg") + "/"


def agent_hosts_store() -> bool:
    """Whether a torchrun agent hosts the store on MASTER_PORT, so that every worker, rank 0
    included, must connect to it as a client (torch's env:// handler does the same)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def under_torchrun() -> bool:
    """Whether this process runs under a torchrun agent (``fastdist run`` included):
    TORCHELASTIC_RUN_ID or TORCHELASTIC_RESTART_COUNT is set."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "TORCHELASTIC_RESTART_COUNT" in os.environ


def parse_record(
    raw: bytes | str, fields: dict[str, type | tuple[type, ...]], what: str = "record"
) -> dict[str, object] | None:
    """A JSON record read from the store, or None when it is not one of fastdist's: not signed
    with the job's secret when it has one (fastdist.store.seal; ``what`` names the record in the
    warning), not JSON, not an object, or lacking one of ``fields`` (name -> expected type). The
    store has no authentication of its own (see docs/security.md): whatever reads a
    record checks it here before use, so that a stranger's or a corrupt value gives a clear
    error, never a crash, and changes nothing."""
    body = seal.opened(raw, what)
    if body is None:
        return None
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(value, dict):
        return None
    for name, kind in fields.items():
        v = value.get(name)
        if not isinstance(v, kind) or (isinstance(v, bool) and kind in (int, float, (int, float))):
            return None
    return value
