"""In-memory copies of every rank's shards on other ranks: ``fastdist.PeerSnapshot``.

A sharded model (FSDP2) loses a dead rank's shards with its process. A snapshot, taken every
``every`` steps at a step boundary, copies each rank's own part of ``state`` into its CPU memory
and sends it to ``copies`` other ranks (preferring ranks on other hosts), over a group of its own.
It counts once every rank holds its own copy and its neighbours' (a barrier after the exchange:
a rank passes it only when every rank has sent and received everything); a snapshot half-taken at
a fault is discarded and the previous one kept.

When a replacement (or a spare) takes a dead rank's place, ``recover(state=, snapshot=)`` on the
live ranks and ``sync_state(state, snapshot=)`` on the joiner agree on the newest step whose copies
cover every rank, the joiner receives its predecessor's copy from a rank that holds it, and every
rank loads that step's state: the job rolls back to the snapshot (the user's step counter is part
of ``state``) and redoes the steps since. With no dead rank (a stall) nothing rolls back. State
that is not sharded (DDP) needs no copies: a joiner gets a live rank's state as without snapshots.
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..deadlines import current_time, fail_at, get_default_timeout
from . import state_sync

_SHARD = "__fastdist_shard__"


def holders(rank: int, world: int, copies: int, local: int) -> list[int]:
    """The ranks that keep ``rank``'s copies: ring neighbours ``local`` ranks on (another host,
    when ranks are laid out host by host, ``local`` to a host), then the next ranks."""
    out: list[int] = []
    if world > local > 0:
        out += [(rank + k * local) % world for k in range(1, world)]
    out += [(rank + k) % world for k in range(1, world)]
    chosen: list[int] = []
    for r in out:
        if r != rank and r not in chosen:
            chosen.append(r)
        if len(chosen) == copies:
            break
    return chosen


def newest_covering(everyone: list[dict[int, list[int]]], joiners: list[int]) -> int | None:
    """The newest step for which every live rank holds its own copy and, for each joiner, some
    live rank holds the copy of the dead rank it replaces; None if there is none. ``everyone``:
    each rank's holdings (step -> the ranks whose copies it holds; a joiner holds none)."""
    live = [r for r in range(len(everyone)) if r not in joiners]
    for s in sorted({s for held in everyone for s in held}, reverse=True):
        if all(r in everyone[r].get(s, ()) for r in live) and all(
            any(j in everyone[r].get(s, ()) for r in live) for j in joiners
        ):
            return s
    return None


def _copy_leaf(value: Any) -> Any:
    """A state_dict leaf as kept in a snapshot: a tensor cloned to the CPU; a DTensor as its local
    shard (cloned) with what rebuilds it; anything else deep-copied."""
    tensor_module = _dtensor_module()
    if tensor_module is not None and isinstance(value, tensor_module.DTensor):
        local = value.to_local().detach().to("cpu", copy=True)
        return (_SHARD, local, tuple(value.placements), tuple(value.shape), tuple(value.stride()))
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Mapping):
        return state_sync._like(value, ((k, _copy_leaf(v)) for k, v in value.items()))
    if isinstance(value, list):
        return [_copy_leaf(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_copy_leaf(v) for v in value)
    return copy.deepcopy(value)


def _dtensor_module() -> Any:
    import sys

    return sys.modules.get("torch.distributed.tensor")


def _rebuilt(value: Any, mesh: Any, device: torch.device) -> Any:
    """A snapshot's leaf as load_state_dict takes it: fresh tensors (the state must not alias the
    snapshot), DTensors rebuilt on ``mesh``."""
    if isinstance(value, tuple) and len(value) == 5 and value[0] == _SHARD:
        from torch.distributed.tensor import DTensor

        _, local, placements, shape, stride = value
        return DTensor.from_local(
            local.to(device, copy=True), mesh, placements, run_check=False, shape=shape, stride=stride
        )
    if isinstance(value, torch.Tensor):
        return value.to(device, copy=True)
    if isinstance(value, Mapping):
        return state_sync._like(value, ((k, _rebuilt(v, mesh, device)) for k, v in value.items()))
    if isinstance(value, list):
        return [_rebuilt(v, mesh, device) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_rebuilt(v, mesh, device) for v in value)
    return copy.deepcopy(value)


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _local_bytes(state: Mapping[str, Any]) -> int:
    """The bytes of this rank's part of ``state``'s tensors (a DTensor's local shard), without
    copying them."""
    tensor_module = _dtensor_module()
    total = 0
    for obj in state.values():
        for leaf in state_sync._leaves(obj.state_dict(), torch.Tensor):
            if tensor_module is not None and isinstance(leaf, tensor_module.DTensor):
                leaf = leaf.to_local()
            total += leaf.numel() * leaf.element_size()
    return total


def _mesh_and_device(state: Mapping[str, Any]) -> tuple[Any, torch.device]:
    """The device mesh and device of the state's DTensors (FSDP2's), for rebuilding them."""
    tensor_module = _dtensor_module()
    if tensor_module is not None:
        for obj in state.values():
            for leaf in state_sync._leaves(obj.state_dict(), torch.Tensor):
                if isinstance(leaf, tensor_module.DTensor):
                    return leaf.device_mesh, leaf.to_local().device
    return None, torch.device("cpu")


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PeerSnapshot:
    """Copies of ``state``'s shards in the CPU memory of this rank and of ``copies`` others, every
    ``every`` steps::

        state = {"model": model, "optim": opt, "progress": progress}   # as recover(state=) takes
        snap = fastdist.PeerSnapshot(state, every=10, copies=1)
        fastdist.sync_state(state, snapshot=snap)       # a replacement: its predecessor's shards
        while progress.step < steps:
            try:
                with fastdist.fail_after(30):
                    train_one_step()
                progress.step += 1
                snap.step(progress.step)                # every 10th step: a snapshot
            except fastdist.FastdistError:
                fastdist.recover(state=state, snapshot=snap)   # a dead rank: all roll back

    Make it on every rank, after the model and the optimizer and before :func:`sync_state`, in
    the same place on a replacement as on a first start (it makes a group). ``copies`` (>= 1,
    < the world size) other ranks keep each rank's copy: a rank and all holders of its copy dying
    together cannot be recovered from memory (RecoveryError; load a checkpoint instead). Memory:
    each rank holds its own part and ``copies`` others', twice while a snapshot is taken; a
    snapshot that would not fit in the host's available memory (every local rank's share) is
    refused here (MemoryError). State without DTensors (DDP) is held whole on every rank: no copy
    is taken and a joiner gets a live rank's state.
    """

    def __init__(self, state: Any, *, every: int, copies: int = 1, timeout: float | None = None) -> None:
        self.state = state_sync.check_state(state)
        for name, value, low in (("every", every, 1), ("copies", copies, 1)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if not dist.is_initialized():
            raise RuntimeError("PeerSnapshot needs the default group: call fastdist.init_process_group first")
        world = dist.get_world_size()
        if copies >= world:
            raise ValueError(f"copies must be < the world size ({world}), got {copies}")
        self.every, self.copies, self.world, self.rank = every, copies, world, dist.get_rank()
        self.timeout = get_default_timeout() if timeout is None else float(timeout)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        self.holders = {r: holders(r, world, copies, local) for r in range(world)}
        self.keeps = [r for r in range(world) if self.rank in self.holders[r]]  # whose copies I hold
        self.sharded = bool(state_sync.sharded_entries(self.state))
        self._lock = threading.Lock()
        # step -> {rank: that rank's state dicts}: the committed snapshot (at most one kept).
        self._held: dict[int, dict[int, dict[str, Any]]] = {}
        self.restored_step: int | None = None
        self.taken = 0
        if self.sharded:
            own = _local_bytes(self.state)
            local_ranks = max(1, local or 1)
            need = own * (1 + copies) * 2 * local_ranks
            free = _available_bytes()
            if free is not None and need > free:
                raise MemoryError(
                    f"PeerSnapshot needs about {need / 2**20:.0f} MiB on this host ({own / 2**20:.1f} MiB of "
                    f"state per rank, {1 + copies} copies, twice while a snapshot is taken, {local_ranks} "
                    f"ranks on the host) and {free / 2**20:.0f} MiB is available: take fewer copies, or "
                    "snapshot less state"
                )
        # The exchange's own group, made where every process makes it (a replacement too).
        self.group = dist.new_group(backend="gloo")

    def _own_copy(self) -> dict[str, Any]:
        return {k: _copy_leaf(v.state_dict()) for k, v in self.state.items()}

    def bytes_held(self) -> int:
        """Bytes of state this rank holds for snapshots (its own copy and its neighbours')."""
        with self._lock:
            return sum(_nbytes(d) for held in self._held.values() for d in held.values())

    def latest(self) -> int | None:
        """The step of the snapshot that counts (every rank holds it), or None."""
        with self._lock:
            return max(self._held) if self._held else None

    def step(self, step: int) -> bool:
        """At a step boundary (every rank, the same ``step``): every ``every``-th step, a snapshot
        of ``state`` as it is now. Returns whether one was taken."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {type(step).__name__}: {step!r}")
        if step % self.every or not self.sharded:
            return False
        self.take(step)
        return True

    def take(self, step: int) -> None:
        """A snapshot of ``state`` as of ``step`` now: the own copy, the exchange with the
        neighbours, then the barrier that makes it count. On a fault it is discarded (the previous
        one stays) and the error raised."""
        own = self._own_copy()
        got = self._exchange(own, current_time() + self.timeout)
        got[self.rank] = own
        with self._lock:
            self._held = {step: got}
        self.taken += 1

    def _exchange(self, own: dict[str, Any], deadline: float) -> dict[int, dict[str, Any]]:
        packed = state_sync.Packed(own, torch.device("cpu"))
        got: dict[int, dict[str, Any]] = {}
        with fail_at(deadline):
            works = [w for h in self.holders[self.rank] for w in packed.isend(h, self.group)]
            for r in self.keeps:
                received = state_sync.receive(r, self.group, deadline)
                assert received is not None
                got[r] = received
            for w in works:
                w.wait()
            dist.barrier(group=self.group)  # every rank holds its own and its neighbours' copies
        return got

    # -- recovery ---------------------------------------------------------------------------

    def holdings(self) -> dict[int, list[int]]:
        """step -> the ranks whose copies this rank holds for it."""
        with self._lock:
            return {s: sorted(held) for s, held in self._held.items()}

    def copy_of(self, step: int, rank: int) -> dict[str, Any]:
        with self._lock:
            return self._held[step][rank]

    def load(self, dicts: Mapping[str, Any]) -> None:
        """Loads a snapshot's state dicts (this rank's own, or its predecessor's) into ``state``."""
        mesh, device = _mesh_and_device(self.state)
        for key, obj in self.state.items():
            obj.load_state_dict(_rebuilt(dicts[key], mesh, device))

    def forget(self) -> None:
        with self._lock:
            self._held = {}
