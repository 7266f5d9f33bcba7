"""A dead rank's random state, for its replacement: every step's start (a
:class:`fastdist.steps.StepStart`, which run_step, Fabric's loop in run_step, Accelerate's
``step`` and the Hugging Face Trainer make) publishes this rank's random generators (torch's CPU
and CUDA generators, Python's ``random``, NumPy's global generator when NumPy is imported) to the
job's store, from a thread of its own, under ``fastdist run``; a replacement that joins the live
ranks' redo of a step loads what its predecessor published at that step's start, so that dropout
and every other draw of the redone step are the ones the dead rank would have made.

Steps are counted per process, one a StepStart (equal on every rank of an SPMD loop); the lowest
live rank of a recovery with joiners writes the count of the step it redoes, and a joiner takes
its predecessor's record only when it was published at that count's start (a rank that died
before its record left, or in a step whose start it had not published, leaves the replacement
with its own generators, and it says so). Records are JSON, signed with the job's secret like
every record fastdist reads from the store (never unpickled).
"""

from __future__ import annotations

import array
import atexit
import base64
import logging
import queue
import random
import sys
import threading
from typing import Any

import torch

from ..store import job, keys, keywait, seal

logger = logging.getLogger("fastdist")

_FIELDS: dict[str, type | tuple[type, ...]] = {"count": int, "cpu": str}
_queue: queue.SimpleQueue[tuple[int, int, dict[str, Any]] | None] = queue.SimpleQueue()
_thread: threading.Thread | None = None
_lock = threading.Lock()
_count = 0  # the steps started in this process (StepStarts made)
_pending: tuple[int, dict[str, Any]] | None = None  # on a joiner: (the step redone, its record)


def next_count() -> int:
    """The count of a step starting now (one more than the last)."""
    global _count
    _count += 1
    return _count


def everything() -> dict[str, Any]:
    """Every generator this module keeps (torch's CPU and CUDA ones, Python's, NumPy's when
    NumPy is imported), now, as objects (no encoding here)."""
    cuda = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    states: dict[str, Any] = {
        "python": random.getstate(),
        "cpu": torch.random.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if cuda else None,
    }
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["numpy"] = numpy.random.get_state()
    return states


def put_back(states: dict[str, Any]) -> None:
    """Sets every generator from :func:`everything`'s."""
    torch.random.set_rng_state(states["cpu"])
    if states.get("cuda") is not None:
        torch.cuda.set_rng_state_all(states["cuda"])
    random.setstate(states["python"])
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy" in states:
        numpy.random.set_state(states["numpy"])


def publish(count: int, states: dict[str, Any]) -> None:
    """Under ``fastdist run``: the random state at the start of step ``count`` (``states``:
    :func:`everything`'s, taken by the caller), sent to the job's store from a thread of its own."""
    if not _publishing():
        return
    import torch.distributed as dist

    _start()
    _queue.put((dist.get_rank(), count, states))


def _publishing() -> bool:
    """Whether a replacement could need this rank's random state: under ``fastdist run``, in a
    job of several ranks."""
    import torch.distributed as dist

    return job.under_launcher() and dist.is_initialized() and dist.get_world_size() > 1


def _start() -> None:
    global _thread
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_send, name="fastdist-random-state", daemon=True)
            _thread.start()
            atexit.register(_stop)


def _stop() -> None:
    """At exit: the sender ends after the record it is sending (a daemon thread inside a store
    call as the interpreter goes would end the process in std::terminate)."""
    thread = _thread
    if thread is not None and thread.is_alive():
        _queue.put(None)
        thread.join(EXIT_SECONDS)


# How long the exit waits for the record being sent (a store call is bounded by the store's own
# timeout; this bounds the exit whatever it is).
EXIT_SECONDS = 2.0


def _key(rank: int) -> str:
    return keys.key("random-state", rank)


def _send() -> None:
    while True:
        item = _queue.get()
        if item is None:
            return
        while True:  # only the newest matters: a record a step
            try:
                newer = _queue.get_nowait()
            except queue.Empty:
                break
            if newer is None:
                return
            item = newer
        rank, count, states = item
        store = job.JOB.store
        if store is None:
            continue
        try:
            store.set(_key(rank), seal.seal_json(encode(count, states)))
        except Exception as exc:  # noqa: BLE001 - the store is failing: the next fault says so
            logger.debug("could not publish rank %d's random state: %r", rank, exc)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def encode(count: int, states: dict[str, Any]) -> dict[str, Any]:
    """A record of step ``count``'s random states, as JSON takes it."""
    record: dict[str, Any] = {"count": count, "cpu": _b64(states["cpu"])}
    if states.get("cuda") is not None:
        record["cuda"] = [_b64(t) for t in states["cuda"]]
    version, internal, gauss = states["python"]
    record["python"] = [version, base64.b64encode(array.array("I", internal).tobytes()).decode(), gauss]
    if "numpy" in states:
        name, keys_, pos, has_gauss, cached = states["numpy"]
        record["numpy"] = [
            name,
            base64.b64encode(keys_.tobytes()).decode(),
            int(pos),
            int(has_gauss),
            float(cached),
        ]
    return record


def load(record: dict[str, Any]) -> None:
    """Sets this process's generators from a record :func:`encode` made."""
    torch.random.set_rng_state(_tensor(record["cpu"]))
    cuda = record.get("cuda")
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_tensor(t) for t in cuda])
    version, internal, gauss = record["python"]
    words = array.array("I")
    words.frombytes(base64.b64decode(internal))
    random.setstate((version, tuple(words), gauss))
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy" in record:
        name, keys_, pos, has_gauss, cached = record["numpy"]
        state = numpy.frombuffer(base64.b64decode(keys_), dtype=numpy.uint32).copy()
        numpy.random.set_state((name, state, pos, has_gauss, cached))


def _count_key(group: str, generation: int) -> str:
    return keys.key("random-state", "redone", group, generation)


def hand_over(group: str, generation: int, me: int, source: int, joiners: list[int], deadline: float) -> None:
    """In a recovery with ``joiners``: ``source`` (the lowest live rank) writes the count of the
    step being redone; each joiner loads its predecessor's random state of that step's start if
    it was published (loaded as its next StepStart, that step's, begins: :func:`take_pending`),
    and counts its steps from there."""
    global _count
    store = job.JOB.store
    if store is None or not job.under_launcher():
        return
    key = _count_key(group, generation)
    if me == source:
        store.set(key, seal.seal(str(_count)))
        return
    if me not in joiners:
        return
    if not keywait.wait_key(store, key, deadline):
        logger.warning("rank %d: the live ranks did not say which step is redone: its own random state", me)
        return
    said = seal.opened(bytes(store.get(key)), "redone-step record")
    if said is None or not said.isdigit() or int(said) == 0:
        return  # not the job's record, or the live ranks' loop makes no StepStart (it recovers itself)
    redone = int(said)
    record: Any = None
    if store.check([_key(me)]):
        record = keys.parse_record(bytes(store.get(_key(me))), _FIELDS, "random-state record")
    _count = redone - 1
    if record is None or record["count"] != redone:
        logger.warning(
            "rank %d: its predecessor's random state at the start of the step redone was not kept (it "
            "died before it was sent): this process draws its own random numbers (dropout masks differ "
            "from an undisturbed run's)",
            me,
        )
        return
    global _pending
    _pending = (redone, record)  # loaded as that step starts here (see take_pending)


def take_pending(count: int) -> None:
    """At the start of step ``count`` (a StepStart, before it captures the generators): on a
    joiner, its predecessor's random state of that step's start, handed over by the recovery it
    joined. Loaded here, not in the recovery: what the joiner drew between the two (a data
    loader's iterator draws a seed as it is made) was drawn by its predecessor before the step
    too, so the state it published already holds it."""
    global _pending
    if _pending is None or _pending[0] != count:
        return
    _, record = _pending
    _pending = None
    load(record)
    logger.info("took its predecessor's random state at the start of the step redone (%d)", count)
