"""In-memory copies of every rank's shards on other ranks: ``fastdist.PeerSnapshot``.

A sharded model (FSDP2) loses a dead rank's shards with its process. A snapshot, taken every
``every`` steps at a step boundary, copies each rank's own part of ``state`` into its CPU memory
(there, on the training thread: the next step changes the state in place) and sends it to
``copies`` other ranks (preferring ranks on other hosts) from a thread of its own, over a group of
its own, while training goes on. It counts once every rank holds its own copy and its neighbours'
(a barrier after the exchange: a rank passes it only when every rank has sent and received
everything); a snapshot half-taken at a fault is discarded and the previous one kept. A rank keeps
its part of an exchange it completed but whose barrier a fault cut short: if every live rank
completed its part and the dead rank's copy reached a live rank, that snapshot is used (each copy
a roll-back loads is whole), else the previous one.

Recovery halts an exchange in flight before it rebuilds the groups (:meth:`PeerSnapshot.halt`):
each op of the exchange is issued under a lock that checks it was not halted, so nothing of an
old exchange reaches a rebuilt group; ops already issued end with the old backend.

When a replacement (or a spare) takes a dead rank's place, ``recover(state=, snapshot=)`` on the
live ranks and ``sync_state(state, snapshot=)`` on the joiner agree on the newest step whose copies
cover every rank, the joiner receives its predecessor's copy from a rank that holds it, and every
rank loads that step's state: the job rolls back to the snapshot (the user's step counter is part
of ``state``) and redoes the steps since. With no dead rank (a stall) nothing rolls back. State
that is not sharded (DDP) needs no copies: a joiner gets a live rank's state as without snapshots.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..deadlines import current_time, fail_at, get_default_timeout, validate_seconds
from . import state_sync

_SHARD = "__fastdist_shard__"
logger = logging.getLogger("fastdist")
_live: weakref.WeakSet[PeerSnapshot] = weakref.WeakSet()


def catching_up() -> bool:
    """Whether this process replaced a dead rank whose death cut a step-start snapshot's exchange
    short, and still redoes the steps between the snapshot it rolled back to and the live ranks'
    step: the collectives a loop issues between those steps (Fabric's ``all_reduce`` of a loss)
    ran on the live ranks before the death, so a framework's own ones are local meanwhile."""
    return any(snap.catch_up_to is not None for snap in list(_live))


class _Halted(Exception):
    pass


def halt_all() -> None:
    """Halts every snapshot exchange in flight (recovery is about to rebuild the groups)."""
    for snap in list(_live):
        snap.halt()


def wait_all(seconds: float) -> None:
    """Waits up to ``seconds`` in all for the snapshot exchanges in flight (at exit)."""
    end = current_time() + seconds
    for snap in list(_live):
        snap.wait(max(0.0, end - current_time()))


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
    each rank's holdings (step -> the ranks whose copies it holds; a joiner holds none). A step
    whose exchange a death cut short counts where the live ranks completed their parts and the
    dead rank's copy reached a live rank: every copy a roll-back loads is there, whole (each rank
    reports only what it holds)."""
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


def own_copy(state: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's part of ``state``'s state dicts, copied to the CPU (DTensors as local shards)."""
    return {k: _copy_leaf(v.state_dict()) for k, v in state.items()}


def load_into(state: Mapping[str, Any], dicts: Mapping[str, Any]) -> None:
    """Loads copies made by :func:`own_copy` (this rank's, or another's of the same shards) into
    ``state``, DTensors rebuilt on the state's own mesh."""
    mesh, device = _mesh_and_device(state)
    for key, obj in state.items():
        obj.load_state_dict(_rebuilt(dicts[key], mesh, device))


def replicas(state: Mapping[str, Any]) -> dict[int, list[int]] | None:
    """Global rank -> the other ranks that hold the same shards of every DTensor in ``state``,
    when each is replicated along some mesh dimension (HSDP: ``Replicate()`` on the replicate
    dimension, ``Shard`` on the other); None when some DTensor's shard is held by one rank only
    (FSDP2 on a 1-D mesh), the DTensors are on different meshes, or there are none.

    Read from the DTensors themselves: their placements say along which mesh dimensions they
    are replicated, and their mesh which ranks sit along those dimensions."""
    tensor_module = _dtensor_module()
    if tensor_module is None:
        return None
    grid: torch.Tensor | None = None
    along: set[int] | None = None
    for obj in state.values():
        for leaf in state_sync._leaves(obj.state_dict(), tensor_module.DTensor):
            ranks = leaf.device_mesh.mesh
            if grid is None:
                grid = ranks
            elif grid.shape != ranks.shape or not torch.equal(grid, ranks):
                return None
            dims = {i for i, p in enumerate(leaf.placements) if p.is_replicate() and ranks.size(i) > 1}
            along = dims if along is None else along & dims
            if not along:
                return None
    if grid is None or not along:
        return None
    out: dict[int, list[int]] = {}
    coords = list(itertools.product(*(range(n) for n in grid.shape)))
    for here in coords:
        out[int(grid[here])] = sorted(
            int(grid[there])
            for there in coords
            if there != here and all(a == b for i, (a, b) in enumerate(zip(here, there)) if i not in along)
        )
    return out


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
    refused here (MemoryError). State without DTensors (DDP) is held whole on every rank, and
    HSDP's (every DTensor replicated along a mesh dimension) on each replica: no copy is taken,
    and a joiner gets a live rank's state, or its replica's shards.

    :meth:`step` copies this rank's part in place and sends the copies from a thread of its own
    while the next steps run (:meth:`wait` waits for it; the next snapshot and the exit do too);
    a failed exchange is logged and kept in ``error``, and the previous snapshot still counts.
    """

    def __init__(self, state: Any, *, every: int, copies: int = 1, timeout: float | None = None) -> None:
        self.state = state_sync.check_state(state)
        for name, value, low in (("every", every, 1), ("copies", copies, 1)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        # Here, not at the first exchange, which runs in a thread and only logs its failure.
        seconds = get_default_timeout() if timeout is None else validate_seconds(timeout, "timeout")
        if not dist.is_initialized():
            raise RuntimeError("PeerSnapshot needs the default group: call fastdist.init_process_group first")
        world = dist.get_world_size()
        if copies >= world:
            raise ValueError(f"copies must be < the world size ({world}), got {copies}")
        self.every, self.copies, self.world, self.rank = every, copies, world, dist.get_rank()
        self.timeout = seconds
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        self.holders = {r: holders(r, world, copies, local) for r in range(world)}
        self.keeps = [r for r in range(world) if self.rank in self.holders[r]]  # whose copies I hold
        # HSDP: every shard is also on a replica, which hands it to a joiner (no copy is needed).
        self.replicas = replicas(self.state)
        self.sharded = bool(state_sync.sharded_entries(self.state)) and self.replicas is None
        self._lock = threading.Lock()
        # step -> {rank: that rank's state dicts}: the committed snapshot (at most one kept).
        self._held: dict[int, dict[int, dict[str, Any]]] = {}
        self._pending: tuple[int, dict[int, dict[str, Any]]] | None = None  # complete, not yet counted
        self._epoch = 0  # bumped by halt(): an exchange of an older epoch issues nothing more
        self._thread: threading.Thread | None = None
        self.restored_step: int | None = None
        # The step of the last snapshot this rank began, and its own copy then (the state at that
        # step's start, kept until the next: a roll-back past it loads it back after the redo).
        self.at: int | None = None
        self._own_at: dict[str, Any] | None = None
        # On a replacement that rolled back behind the live ranks: their step, until it gets there.
        self.catch_up_to: int | None = None
        # run_step's last step done with this snapshot: (step, attempt, its StepStart), redone
        # when a death in the next step's exchange rolls the job back to that step's start.
        self.previous: tuple[int, Any, Any] | None = None
        self.taken = 0
        self.error: BaseException | None = None  # why the last exchange failed, if it did
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
        _live.add(self)

    def _own_copy(self) -> dict[str, Any]:
        return own_copy(self.state)

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
        of ``state`` as it is now. The own copy is taken here (a copy in memory); the exchange with
        the neighbours runs on a thread of its own while training goes on, and the snapshot counts
        once every rank holds every copy. Returns whether one was started."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {type(step).__name__}: {step!r}")
        if step % self.every or not self.sharded:
            return False
        self.take(step, background=True)
        return True

    def take(self, step: int, *, background: bool = False) -> None:
        """A snapshot of ``state`` as of ``step`` now: the own copy, the exchange with the
        neighbours, then the barrier that makes it count. ``background``: the exchange on a
        thread (see :meth:`wait`); else here, and a fault raises (the previous snapshot stays)."""
        self.wait()  # the previous exchange, if it is still running
        own = self._own_copy()
        deadline = current_time() + self.timeout
        with self._lock:
            epoch = self._epoch
            self._pending = None
            if self.at is None or step > self.at:  # (a roll-back's retake of an older step: not moved back)
                self.at, self._own_at = step, own
        if not background:
            self._exchange(step, own, deadline, epoch)
            return
        thread = threading.Thread(
            target=self._exchange_logged,
            args=(step, own, deadline, epoch),
            name=f"fastdist-snapshot-{step}",
            daemon=True,
        )
        with self._lock:
            self._thread = thread
        thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the snapshot exchange in flight (if any) to count or fail; returns whether
        none is left in flight. Bounded by the exchange's own deadline (``timeout`` shorter)."""
        with self._lock:
            thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        if thread.is_alive():
            return False
        with self._lock:
            if self._thread is thread:
                self._thread = None
        return True

    def halt(self) -> None:
        """Stops the exchange in flight from issuing anything more and from counting (recovery
        rebuilds the groups under it): what it received stays a candidate if complete."""
        with self._lock:
            self._epoch += 1
            self._thread = None

    def _post(self, epoch: int) -> Any:
        """Issues an op of the exchange of ``epoch``, unless the exchange was halted: the check
        and the issue under one lock, so nothing reaches a group rebuilt after :meth:`halt`."""

        def post(issue: Any) -> Any:
            with self._lock:
                if epoch != self._epoch:
                    raise _Halted("the snapshot's exchange was halted by a recovery")
                return issue()

        return post

    def _exchange_logged(self, step: int, own: dict[str, Any], deadline: float, epoch: int) -> None:
        try:
            self._exchange(step, own, deadline, epoch)
        except _Halted:
            pass
        except Exception as exc:  # noqa: BLE001 - the job goes on; the previous snapshot counts
            self.error = exc
            logger.warning(
                "rank %d: the snapshot of step %d was not taken (%s: %s); the snapshot of step %s "
                "still counts",
                self.rank,
                step,
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
                self.latest(),
            )

    def _exchange(self, step: int, own: dict[str, Any], deadline: float, epoch: int) -> None:
        post = self._post(epoch)
        packed = state_sync.Packed(own, torch.device("cpu"))
        got: dict[int, dict[str, Any]] = {self.rank: own}
        with fail_at(deadline):
            works = [w for h in self.holders[self.rank] for w in packed.isend(h, self.group, post)]
            for r in self.keeps:
                received = state_sync.receive(r, self.group, deadline, post=post)
                assert received is not None
                got[r] = received
            for w in works:
                w.wait()
            with self._lock:  # complete here: a candidate for a roll-back before it counts
                if epoch == self._epoch:
                    self._pending = (step, got)
            post(lambda: dist.barrier(group=self.group, async_op=True)).wait()  # every rank holds all
        with self._lock:
            if epoch == self._epoch:
                self._held = {step: got}
                self._pending = None
                self.taken += 1
                self.error = None

    # -- recovery ---------------------------------------------------------------------------

    def _all(self) -> dict[int, dict[int, dict[str, Any]]]:
        held = dict(self._held)
        if self._pending is not None:
            held.setdefault(self._pending[0], self._pending[1])
        return held

    def holdings(self) -> dict[int, list[int]]:
        """step -> the ranks whose copies this rank holds for it (the snapshot that counts, and
        one whose exchange this rank completed but that has not counted here yet: if it counted on
        another rank, every rank completed it, and a roll-back may use it)."""
        with self._lock:
            return {s: sorted(held) for s, held in self._all().items()}

    def copy_of(self, step: int, rank: int) -> dict[str, Any]:
        """The copy of ``rank``'s state dicts this rank holds for ``step`` (KeyError when it holds
        none)."""
        with self._lock:
            return self._all()[step][rank]

    def redoing_at(self) -> int | None:
        """The step run_step is at on this rank, when a roll-back to the start of the step before
        it would be redone there (it did that step with this snapshot, and began this one's)."""
        with self._lock:
            if self.previous is not None and self.at is not None and self.previous[0] == self.at - 1:
                return self.at
            return None

    def own_at(self, step: int) -> dict[str, Any] | None:
        """This rank's own copy of ``state`` at ``step``'s start, if the last snapshot it began
        was of that step (whether or not its exchange completed)."""
        with self._lock:
            return self._own_at if self.at == step else None

    def load(self, dicts: Mapping[str, Any]) -> None:
        """Loads a snapshot's state dicts (this rank's own, or its predecessor's) into ``state``."""
        load_into(self.state, dicts)
