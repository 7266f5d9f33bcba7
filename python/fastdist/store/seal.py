"""Signed store records: what a store write without the job's secret can no longer do.

torch's TCPStore has no authentication: anything that reaches its port can read and write every
key. torch gives a store write little power over a running job; fastdist's records do more:
a fault record aborts a group on every rank, a suspect record makes ``fastdist run`` kill a
worker, a spare's key gives it a rank, a death record names a rank dead, the joiners and DDP's
bucket layouts shape what a recovery hands over. So each of those records carries an HMAC-SHA256
tag made with a per-job secret, and a record whose tag is wrong (or missing, when the job has a
secret) is ignored, with one warning per kind of record.

The secret is ``FASTDIST_JOB_SECRET`` in the environment of every process of the job (its
agents and workers): ``fastdist run`` makes one for its workers when it is not set (one node);
with several nodes, or with torchrun or a launch by hand, set it to the same value everywhere
(``export FASTDIST_JOB_SECRET=$(openssl rand -hex 32)`` before the launch). Without it records are
not signed and the store is trusted, as torch trusts it. The secret never goes through the
store. C++ signs the records it writes (the report made when Python cannot run) with the same
secret, handed to it when the deadline is armed.

Not signed: the counters and arrival lists of the recovery's agreement and of growth, the
generation counter, and torch's own keys. A forged write there can make a recovery fail or wait
(an error, naming what is missing), not hand over a wrong state. See docs/security.md for the
trust model.
"""

from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger(__name__)

SECRET_ENV = "FASTDIST_JOB_SECRET"
# Between a record and its tag: a control character, which JSON escapes and no number contains.
SEP = "\x1f"
TAG_HEX = 32  # the first 128 bits of the HMAC-SHA256, in hex

_warned: set[str] = set()


def secret() -> bytes | None:
    """The job's secret (``FASTDIST_JOB_SECRET``), or None: records are then not signed."""
    value = os.environ.get(SECRET_ENV, "")
    return value.encode() if value else None


def tag(body: str, key: bytes) -> str:
    """The tag of ``body`` under ``key``."""
    import hashlib
    import hmac  # (here: `import fastdist` imports nothing torch has not)

    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()[:TAG_HEX]


def seal(body: str) -> str:
    """``body`` as written to the store: with its tag when the job has a secret."""
    key = secret()
    return body if key is None else f"{body}{SEP}{tag(body, key)}"


def _same(a: str, b: str) -> bool:
    import hmac

    return hmac.compare_digest(a, b)


def seal_json(record: object) -> str:
    """``record`` as JSON, sealed."""
    return seal(json.dumps(record))


def opened(raw: bytes | str, what: str) -> str | None:
    """The record ``raw`` read from the store, without its tag; None (and a warning, once per
    ``what``) when the job has a secret and the tag is missing or wrong: not written by one of
    this job's processes. Without a secret every record is taken (a tag, if any, dropped)."""
    text = raw.decode(errors="replace") if isinstance(raw, (bytes, bytearray)) else str(raw)
    body, sep, got = text.rpartition(SEP)
    if not sep:
        body, got = text, ""
    key = secret()
    if key is None:
        return body
    if got and _same(got, tag(body, key)):
        return body
    if what not in _warned:
        _warned.add(what)
        logger.warning(
            "fastdist: ignored a %s in the job's store that is not signed with this job's secret (%s): "
            "something other than this job's processes wrote it (see docs/security.md)",
            what,
            SECRET_ENV,
        )
    return None


def opened_lines(raw: bytes | str, what: str) -> list[str]:
    """The records of an appended key (one a line) that are this job's, without their tags."""
    text = raw.decode(errors="replace") if isinstance(raw, (bytes, bytearray)) else str(raw)
    out = []
    for line in text.splitlines():
        body = opened(line, what)
        if body is not None:
            out.append(body)
    return out
