"""Several nodes under ``fastdist run``: a node whose agent is gone is replaced by a new agent.

torch's dynamic rendezvous admits a new agent only in a new round, and every live agent answers
a new round by restarting its workers. So once the job runs, fastdist's agents keep their own
records beside torch's, in the rendezvous store (``fastdist/run/RUN_ID/``): each node's slot (its
group rank, its workers' global ranks, the job's store) and a beat, a counter its agent adds to
every second. An agent started while the job runs does not join torch's rendezvous: it waits for
a slot whose beat stopped, claims it (compare-and-set on its owner), and starts that node's
workers with the same ranks; they join the live ranks at their next ``fastdist.recover()``. The
live agents' workers are never restarted. The agent that hosts the rendezvous store (the first
started at ``--rdzv-endpoint``) must live: the job's store is there.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import time
import uuid
from typing import Any

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

BEAT_EVERY = 1.0  # seconds between an agent's beats
STALE_AFTER = 4.0  # a slot whose beat did not move for this long has no agent
_DEFAULT_PORT = 29400  # torchrun's default for --rdzv-endpoint


@dataclasses.dataclass(frozen=True)
class Slot:
    """One node's place in the job: what its workers need to start again."""

    group_rank: int
    group_world_size: int
    base_rank: int
    local_world_size: int
    world_size: int
    master_addr: str
    master_port: int

    def named(self) -> str:
        """``node 1 (ranks 4-7)``."""
        last = self.base_rank + self.local_world_size - 1
        return f"node {self.group_rank} (ranks {self.base_rank}-{last})"


def _read_slot(store: Any, group_rank: int) -> Slot:
    return Slot(**json.loads(bytes(store.get(f"node/{group_rank}"))))


class NodeLink:
    """This agent's records in the rendezvous store (``slot`` is set for an agent that took a
    dead node's place)."""

    def __init__(self, endpoint: str, run_id: str) -> None:
        self.endpoint, self.run_id = endpoint, run_id
        self.me = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.slot: Slot | None = None
        self._store: Any = None
        self._next_beat = 0.0
        self._slots: dict[int, Slot] = {}  # other nodes' slots, read when first needed
        self._beats: dict[int, tuple[int, float]] = {}  # node -> (its beat, when it last moved)

    def store(self, timeout: float = 30.0) -> Any:
        """The rendezvous store at the endpoint, under this run's prefix (``fastdist/run/RUN_ID/``),
        connected on first use (``timeout``: seconds, the store's timeout)."""
        if self._store is None:
            host, port = parse_rendezvous_endpoint(self.endpoint, default_port=_DEFAULT_PORT)
            client = TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout))
            self._store = PrefixStore(f"fastdist/run/{self.run_id}/", client)
        return self._store

    def job_running(self) -> bool:
        """Whether a fastdist job already runs at the endpoint (no wait when nobody listens)."""
        host, port = parse_rendezvous_endpoint(self.endpoint, default_port=_DEFAULT_PORT)
        try:
            socket.create_connection((host, port), timeout=2.0).close()
        except OSError:
            return False
        return bool(self.store().check(["job"]))

    # -- a live node ----------------------------------------------------------------------------

    def publish(self, slot: Slot) -> None:
        """Records this node's slot once its rendezvous is done."""
        store = self.store()
        store.set(f"node/{slot.group_rank}", json.dumps(dataclasses.asdict(slot)))
        store.set(f"node/{slot.group_rank}/owner", self.me)
        store.add(f"node/{slot.group_rank}/beat", 1)
        store.set("job", json.dumps({"group_world_size": slot.group_world_size}))
        self.slot = slot
        self._next_beat = time.monotonic() + BEAT_EVERY

    def beat(self) -> None:
        """Called from the agent's monitor loop: one store call a second."""
        if self.slot is None or time.monotonic() < self._next_beat:
            return
        self._next_beat = time.monotonic() + BEAT_EVERY
        self.store().add(f"node/{self.slot.group_rank}/beat", 1)

    def node_of(self, rank: int) -> Slot | None:
        """The slot of the node that runs global rank ``rank`` (None if none recorded it)."""
        if self.slot is None:
            return None
        if not any(s.base_rank <= rank < s.base_rank + s.local_world_size for s in self._slots.values()):
            store = self.store()  # (read once per node: a slot does not change)
            for g in range(self.slot.group_world_size):
                if g not in self._slots and store.check([f"node/{g}"]):
                    self._slots[g] = _read_slot(store, g)
        return next(
            (s for s in self._slots.values() if s.base_rank <= rank < s.base_rank + s.local_world_size), None
        )

    def silent_for(self, group_rank: int) -> float:
        """How long node ``group_rank``'s beat has not moved, as this agent has watched it (0.0
        the first time it looks, and whenever the beat moved since the last look)."""
        beat, now = int(self.store().add(f"node/{group_rank}/beat", 0)), time.monotonic()
        seen = self._beats.get(group_rank)
        if seen is None or seen[0] != beat:
            self._beats[group_rank] = (beat, now)
            return 0.0
        return now - seen[1]

    def exit_barrier(self, timeout: float) -> bool:
        """Every slot's agent (the first or its replacement) arrives once: True when all did.
        Then each says it saw that, and waits (5 s at most) until all did: the agent that hosts
        the store must not take it away from one still reading the count."""
        assert self.slot is not None
        store, nodes = self.store(), self.slot.group_world_size
        store.add("exit", 1)
        end = time.monotonic() + timeout
        while int(store.add("exit", 0)) < nodes:
            if time.monotonic() >= end:
                return False
            self.beat()
            time.sleep(0.1)
        store.add("exit/seen", 1)
        end = time.monotonic() + 5.0
        try:
            while int(store.add("exit/seen", 0)) < nodes and time.monotonic() < end:
                time.sleep(0.05)
        except RuntimeError:
            pass  # the store's host left: it had seen every node arrive
        return True

    # -- a new agent ----------------------------------------------------------------------------

    def claim(self, local_world_size: int | None, wait: float) -> Slot | None:
        """Takes the slot of a node whose beat stopped, waiting up to ``wait`` seconds for one."""
        store = self.store()
        nodes = int(json.loads(bytes(store.get("job")))["group_world_size"])
        end = time.monotonic() + wait
        while True:
            before = {g: int(store.add(f"node/{g}/beat", 0)) for g in range(nodes)}
            time.sleep(STALE_AFTER)
            for g in range(nodes):
                if int(store.add(f"node/{g}/beat", 0)) != before[g] or not store.check([f"node/{g}"]):
                    continue  # alive, or not recorded yet (the first start is still under way)
                slot = _read_slot(store, g)
                if local_world_size is not None and slot.local_world_size != local_world_size:
                    raise SystemExit(
                        f"fastdist run: node {g} is gone, but it ran {slot.local_world_size} workers and "
                        f"this agent was given --nproc-per-node {local_world_size}"
                    )
                owner = bytes(store.get(f"node/{g}/owner")).decode()
                if bytes(store.compare_set(f"node/{g}/owner", owner, self.me)).decode() != self.me:
                    continue  # another new agent took it first
                store.add(f"node/{g}/beat", 1)
                self.slot = slot
                self._next_beat = time.monotonic() + BEAT_EVERY
                return slot
            if time.monotonic() >= end:
                return None
