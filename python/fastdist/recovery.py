"""Starting a job, and recovering a timed-out group in place.

``fastdist.init_process_group`` is torch's, plus what recovery needs kept: the backend, the
group timeout and the store. ``fastdist.recover()``, called by every live rank after a timeout or
a :class:`GroupAbortedError`, rebuilds the group without restarting the processes:

1. The ranks agree on a new generation through the store: each adds itself to the generation's
   member list. The round closes when every rank of the old group is in or, with
   ``allow_shrink=True``, when the first rank's deadline passes; ``compare_set`` makes the first
   closing decision the one every rank sees.
2. The dead group is retired without running its destructor on this thread (fastdist holds it
   until its in-flight op has ended, then lets it go).
3. A fresh group is built on the members, under a store prefix of its own, renumbered in order
   of their old ranks. It replaces the default group when the default group is the one that died.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import threading
import time
import warnings
from typing import Any

import torch.distributed as dist

from . import _bell, _bounded, _groups, _keys, _polled, _watch, diagnostics, joining, state_sync
from ._bounded import GRACE_SECONDS, StoreUnanswered, bounded
from ._timeouts import (
    RendezvousTimeout,
    TimeoutLike,
    current_time,
    effective_deadline,
    fail_at,
    get_default_timeout,
    validate_seconds,
)
from .errors import FastdistError, RecoveryError

logger = logging.getLogger(__name__)


# What the default group was built with, for rebuilding it.
_lineage: dict[str, Any] = {"backend": None, "timeout": None, "root": None}
_LINEAGE_PROBE = _keys.key("lineage")


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    store: Any | None = None,
    timeout: Any | None = None,
    connect_timeout: Any | None = None,
    retries: int | None = 3,
    backoff: float = 0.5,
    rendezvous_timeout: Any | None = None,
    spares: int | None = None,
    **kwargs: Any,
) -> None:
    """``torch.distributed.init_process_group`` (env:// as torchrun sets it, ``tcp://``,
    ``file://``, ``etcd://HOST:PORT[,HOST:PORT...]/JOB_ID``, or a ``store``), keeping what
    :func:`recover` and the diagnostics need.

    ``etcd://`` keeps the job's store in etcd (:class:`fastdist.EtcdStore`): it survives losing
    any rank, rank 0 included; connection failures are diagnosed as below, per endpoint.

    For env:// (also the default when MASTER_ADDR is set) and tcp://, fastdist makes the store
    connection itself: retries with exponential backoff and jitter (``retries``, ``backoff``),
    the whole connect phase within ``connect_timeout`` (default 60 s) plus 10%, and failures
    raised as :class:`RendezvousConnectionError` with their cause (see fastdist.rendezvous). Then
    every rank checks that torch, fastdist and the world size match rank 0's. With
    ``rendezvous_timeout`` (a :class:`RendezvousTimeout` or seconds) the ranks also wait for each
    other within it, and missing ranks are named (:class:`RendezvousTimeoutError`).

    ``timeout`` (seconds or ``timedelta``) is the group's backend timeout, as in torch; fastdist
    calls still use their own ``timeout=``. For NCCL it sets ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``
    unless already set (see :func:`configure_nccl_error_handling`).

    A process that starts while the job runs (a replacement for a dead rank, same RANK) *joins*
    it: this returns at once with its groups on stand-in backends, and the script then builds its
    model and optimizer as on a first start and calls :func:`sync_state`, which takes the rank's
    place at the live ranks' next :func:`recover` and loads their state. ``spares=K`` (or
    ``FASTDIST_SPARES=K``): the last K processes of the launch hold no rank (the world size is
    the launched size minus K); each waits here, blocked, until ``fastdist run`` gives it a dead
    rank's place (it then joins), and exits 0 when the job ends without it.
    """
    from . import rendezvous as rdzv_mod

    td = None if timeout is None else _group_timedelta(validate_seconds(timeout, "timeout"))
    connect = 60.0 if connect_timeout is None else validate_seconds(connect_timeout, "connect_timeout")
    rdzv = rendezvous_timeout
    if rdzv is not None and not isinstance(rdzv, RendezvousTimeout):
        rdzv = RendezvousTimeout(rdzv)
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    if dist.is_initialized():
        raise RuntimeError(
            "fastdist.init_process_group: this process's default group is already initialized (rank "
            f"{dist.get_rank()} of {dist.get_world_size()}); after a fault call fastdist.recover(), "
            "or destroy the group first (torch.distributed.destroy_process_group())"
        )
    n_spares = joining.spares_arg(spares)
    configure_nccl_error_handling(backend)
    _lineage["reconnect"] = None
    target = _tcp_target(init_method, store)
    hosts_store = False
    if store is None and init_method is not None and init_method.startswith("etcd://"):
        from .etcd import parse_url

        endpoints, job, ttl = parse_url(init_method)
        rank, world_size = _rank_and_size(rank, world_size)
        store = rdzv_mod.connect_etcd(
            endpoints,
            job,
            ttl=ttl,
            connect_timeout=connect,
            retries=retries,
            backoff=backoff,
            store_timeout=td.total_seconds() if td is not None else 300.0,
        )
        rdzv_mod.check_versions(store, rank, world_size, *endpoints[0], timeout=connect)
        init_method = None
        diagnostics.store_location = f"etcd {','.join(f'{h}:{p}' for h, p in endpoints)} (job {job!r})"
    if target is not None:
        host, port = target
        rank, world_size = _rank_and_size(rank, world_size)
        # Under torchrun the agent hosts the store on MASTER_PORT: every worker is a client.
        agent = (init_method or "env://").startswith("env://") and _keys.agent_hosts_store()
        hosts_store = rank == 0 and not agent
        store = rdzv_mod.connect_store(
            host,
            port,
            is_master=hosts_store,
            world_size=world_size,
            connect_timeout=connect,
            retries=retries,
            backoff=backoff,
            store_timeout=td.total_seconds() if td is not None else 300.0,
        )
        rdzv_mod.check_versions(store, rank, world_size, host, port, timeout=connect)
        init_method = None
        hosted_by = "torchrun's agent" if agent else "in rank 0"
        diagnostics.store_location = f"{host}:{port} ({hosted_by})"
        if agent:
            # torchrun's agent keeps its store across restarts of the worker group: torch's own keys
            # (gloo's addresses) of the last attempt must not be read by this one.
            store = dist.PrefixStore(_keys.key("pg") + "/", store)
        store_seconds = td.total_seconds() if td is not None else 300.0

        def reconnect() -> Any:
            """A new connection to the job's store, under the prefixes of the default store: ours
            under torchrun's agent, then torch's group prefix ("GROUP_NAME/"), checked against a
            key written through the original at init."""
            fresh: Any = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=store_seconds))
            if agent:
                fresh = dist.PrefixStore(_keys.key("pg") + "/", fresh)
            fresh = dist.PrefixStore(f"{_lineage['group_name']}/", fresh)
            if not fresh.check([_LINEAGE_PROBE]):
                raise RuntimeError("a new connection to the store does not see the job's keys")
            return fresh

        _lineage["reconnect"] = reconnect
    if rdzv is not None:
        if store is None:
            raise ValueError("rendezvous_timeout needs env://, tcp:// or a store")
        rdzv_mod.rendezvous(
            store,
            -1 if rank is None else rank,
            -1 if world_size is None else world_size,
            rdzv,
            hosts_store=target is not None and hosts_store,
        )
    job_store = _job_store(store)
    joiner = False
    if n_spares and (job_store is None or rank is None or world_size is None):
        raise ValueError("spares need env://, tcp://, etcd:// or a store, with rank and world_size")
    if job_store is not None and rank is not None and world_size is not None:
        if n_spares >= world_size:
            raise ValueError(f"spares ({n_spares}) must be fewer than the processes launched ({world_size})")
        world_size -= n_spares
        if rank >= world_size:
            logger.info("launch rank %d: a spare, waiting for a dead rank's place", rank)
            rank = joining.wait_for_vacancy(job_store, rank)
            joiner = True
        elif not _lineage.get("started"):  # a process that made its groups before is no joiner
            joiner = joining.job_running(job_store)
    _watch.activate(None if td is None else td.total_seconds())
    with joining.solo_groups() if joiner else contextlib.nullcontext():
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            timeout=td,
            store=store,
            rank=-1 if rank is None else rank,
            world_size=-1 if world_size is None else world_size,
            **kwargs,
        )
    _lineage["job_store"] = job_store
    joining.set_job_store(job_store)
    _lineage["started"] = True
    _lineage.update(
        backend=dist.get_backend(),
        timeout=td,
        root=dist.distributed_c10d._get_default_store(),
    )
    if _lineage.get("reconnect") is not None:
        try:
            _lineage["group_name"] = dist.distributed_c10d._get_default_group().group_name
        except RuntimeError:  # a backend without a group name: no second connection then
            _lineage["reconnect"] = None
        else:
            _lineage["root"].set(_LINEAGE_PROBE, "1")  # what a new connection must see (reconnect)
    if joiner:
        logger.info("rank %d joins the running job: call fastdist.sync_state(state) to take its place", rank)
        return
    if job_store is not None:
        joining.mark_running(job_store)
    _bell.start(dist.distributed_c10d._get_default_store(), dist.get_rank())


# The longest timeout handed to torch (its TCPStore and backends count in nanoseconds somewhere:
# 10**6 days failed to connect at once). Anything longer, math.inf included, means no deadline.
MAX_TIMEOUT = datetime.timedelta(days=3650)


def _group_timedelta(seconds: float) -> datetime.timedelta:
    return MAX_TIMEOUT if seconds >= MAX_TIMEOUT.total_seconds() else datetime.timedelta(seconds=seconds)


def _job_store(store: Any) -> Any | None:
    """The job's store under fastdist's own keys (under torchrun's agent, below the prefix the
    workers' groups use), or None when torch made the store itself."""
    if isinstance(store, dist.PrefixStore) and _keys.agent_hosts_store():
        return store.underlying_store
    return store


def _rank_and_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """The arguments, else RANK and WORLD_SIZE from the environment (as torchrun sets them)."""
    rank = int(os.environ["RANK"]) if rank is None and "RANK" in os.environ else rank
    if world_size is None and "WORLD_SIZE" in os.environ:
        world_size = int(os.environ["WORLD_SIZE"])
    if rank is None or world_size is None:
        raise ValueError(
            "rank and world_size are needed (as arguments, or RANK and WORLD_SIZE in the environment)"
        )
    return rank, world_size


def _tcp_target(init_method: str | None, store: Any | None) -> tuple[str, int] | None:
    """(host, port) when fastdist should make the TCPStore connection itself."""
    if store is not None:
        return None
    if init_method is None:
        if "MASTER_ADDR" not in os.environ:
            return None
        init_method = "env://"
    if init_method.startswith("env://"):
        try:
            return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        except KeyError as exc:
            raise ValueError(f"env:// needs {exc.args[0]} in the environment") from None
        except ValueError:
            raise ValueError(
                f"MASTER_PORT must be a port number, got {os.environ['MASTER_PORT']!r}"
            ) from None
    if init_method.startswith("tcp://"):
        hostport = init_method[len("tcp://") :].split("?", 1)[0].rstrip("/")
        host, _, port = hostport.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"init_method must look like tcp://HOST:PORT, got {init_method!r}")
        return host.strip("[]"), int(port)
    return None


NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
# 2 = CleanUpOnly: torch's watchdog aborts the communicators of a failed work but does not tear
# the process down. torch's default (3) kills the process, which would undo a fastdist abort.
NCCL_ERROR_HANDLING_MODE = "2"


def configure_nccl_error_handling(backend: str | None) -> None:
    """Sets TORCH_NCCL_ASYNC_ERROR_HANDLING=2 for a backend that may be NCCL (``None`` lets torch
    pick NCCL on a GPU machine), so that torch's watchdog never kills a process after fastdist
    aborted a timed-out collective. A value the user set is kept, with a warning if it differs."""
    if backend is not None and "nccl" not in str(backend).lower():
        return
    current = os.environ.get(NCCL_ERROR_HANDLING)
    if current is None or _injected_by_launcher(NCCL_ERROR_HANDLING):
        # torchrun puts TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (tear down) into every worker unless the
        # user set it: that value is the launcher's default, not the user's choice.
        os.environ[NCCL_ERROR_HANDLING] = NCCL_ERROR_HANDLING_MODE
    elif current.strip() != NCCL_ERROR_HANDLING_MODE:
        warnings.warn(
            f"{NCCL_ERROR_HANDLING}={current} was set explicitly and is kept; with it torch's NCCL watchdog "
            f"may {'kill the process' if current.strip() in ('1', '3') else 'not clean up'} after a timeout "
            f"that fastdist handles. fastdist recommends {NCCL_ERROR_HANDLING}={NCCL_ERROR_HANDLING_MODE}.",
            RuntimeWarning,
            stacklevel=3,
        )


def _injected_by_launcher(name: str) -> bool:
    """Whether torchrun's agent put ``name`` into this worker's environment itself: the agent (this
    process's parent) was started without it. Where the parent's environment cannot be read, the
    value torchrun injects ("1") counts as injected."""
    if not _keys.under_torchrun():
        return False
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            parent = f.read().split(b"\0")
    except OSError:
        return os.environ.get(name, "").strip() == "1"
    prefix = name.encode() + b"="
    return not any(entry.startswith(prefix) for entry in parent)


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (default: the default group, as rebuilt by recover)."""
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    """The size of ``group`` (default: the default group, as rebuilt by recover)."""
    return dist.get_world_size(group)


def sync_state(state: Any, *, timeout: TimeoutLike = None) -> bool:
    """Loads the live ranks' state into ``state`` on a process that joined a running job, and
    returns True; returns False at once on a first start (nothing to load).

    ``state`` is a dict of objects with ``state_dict()`` / ``load_state_dict()`` (what
    ``torch.distributed.checkpoint`` takes: the model, the optimizer, the user's step counter),
    built as on a first start. The joiner takes its rank's place at the live ranks'
    ``recover(state=...)``: every group it made is connected for real, and a live rank sends its
    state over the default group. Bounded by ``timeout`` (default: the default timeout); raises
    :class:`RecoveryError` when the live ranks do not take it in, or when ``state`` holds sharded
    tensors (FSDP2), which no live rank has.
    """
    state = state_sync.check_state(state)
    if not joining.is_pending():
        return False
    if timeout is None:
        timeout = get_default_timeout()
    pg = dist.distributed_c10d._get_default_group()
    st = _groups.state_of(pg)
    # The live ranks agree on the generation after the last one agreed: this rank's next.
    st.generation = int(_lineage["root"].add(f"{_keys.key('recover', st.name)}/latest", 0))
    recover(timeout=timeout, state=state)
    joining.set_pending(False)
    _bell.start(dist.distributed_c10d._get_default_store(), dist.get_rank())
    return True


def recover(
    group: Any = None, *, timeout: TimeoutLike = None, allow_shrink: bool = False, state: Any = None
) -> Any:
    """Rebuilds ``group`` (default: the default group) after a timeout or a
    :class:`GroupAbortedError`; every live rank of the group must call it. Returns the new group
    (for the default group, it also becomes the default).

    Without ``allow_shrink`` every rank must turn up before ``timeout``, else
    :class:`RecoveryError` names the missing ones. With ``allow_shrink=True`` the ranks that have
    not turned up by the first rank's deadline are left out and the rest are renumbered in the
    order of their old ranks; a rank that turns up later gets :class:`RecoveryError`.

    On NCCL the timed-out group's communicators are still being aborted when the timeout is
    raised; ``recover`` waits for that abort first (torch's abort frees device memory, so it
    also waits for kernels still running on the GPU), bounded by ``FASTDIST_ABORT_TIMEOUT``.

    ``state`` (a dict of Statefuls, as :func:`sync_state` takes): when a process joined in the
    place of a dead rank (a replacement or a spare), the lowest live rank sends it this state;
    the others pass theirs too (it is not read). Without ``state`` a joiner cannot be brought
    up to date, and recovery raises :class:`RecoveryError` on every rank rather than train on
    with a rank that holds other weights.
    """
    if state is not None:
        state = state_sync.check_state(state)
    start = current_time()
    deadline = effective_deadline(timeout, start)
    if not isinstance(allow_shrink, bool):
        raise TypeError(f"allow_shrink must be a bool, got {type(allow_shrink).__name__}: {allow_shrink!r}")
    pg = _groups.resolve(group)
    if pg is None:
        raise ValueError("this process is not a member of the group it asked to recover")
    return _one_at_a_time(pg, deadline, lambda: _recover(pg, start, deadline, allow_shrink, state))


class _Turns:
    """Recoveries of one group in one process, one at a time: a thread that calls recover() while
    another thread's recovery of the group runs waits for it and shares its outcome (its group,
    or its error), rather than join the agreement a second time as the same rank."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.running = False
        self.finished = 0
        self.waiting = 0
        # Kept only while a thread waits for it: an error holds its frames, and they the groups.
        self.outcome: tuple[Any, BaseException | None] = (None, None)


_turns: dict[int, _Turns] = {}
_turns_lock = threading.Lock()


def _one_at_a_time(pg: Any, deadline: float, attempt: Any) -> Any:
    with _turns_lock:
        turns = _turns.setdefault(id(pg), _Turns())
    with turns.cond:
        if turns.running:
            seen = turns.finished
            turns.waiting += 1
            try:
                ok = turns.cond.wait_for(
                    lambda: turns.finished > seen, timeout=max(0.0, min(deadline - current_time(), 1e6))
                )
                result, error = turns.outcome
            finally:
                turns.waiting -= 1
                if turns.waiting == 0:
                    turns.outcome = (None, None)
            if not ok:
                st = _groups.state_of(pg)
                raise RecoveryError(
                    group=st.name,
                    rank=st.my_global_rank,
                    generation=st.generation + 1,
                    missing_ranks=None,
                    reason="another thread of this rank is recovering the group, and it did not finish "
                    "within this call's timeout",
                )
            if error is not None:
                raise error
            return result
        turns.running = True
    result, error = None, None
    try:
        result = attempt()
        return result
    except BaseException as exc:
        error = exc
        raise
    finally:
        with turns.cond:
            turns.running = False
            turns.finished += 1
            if turns.waiting:
                turns.outcome = (result, error)
            turns.cond.notify_all()


def _recover(pg: Any, start: float, deadline: float, allow_shrink: bool, state: dict[str, Any] | None) -> Any:
    st = _groups.state_of(pg)
    is_default = dist.is_initialized() and pg is dist.distributed_c10d._get_default_group()
    if is_default and _lineage["root"] is None:
        _lineage.update(
            backend=dist.get_backend(), timeout=None, root=dist.distributed_c10d._get_default_store()
        )
    store = _lineage["root"] if is_default else st.store
    gen = st.generation + 1
    me = st.my_global_rank
    if store is None:
        raise RecoveryError(
            group=st.name,
            rank=me,
            generation=gen,
            reason="the group has no store to agree through",
            missing_ranks=None,
        )

    try:
        if _bounded.stuck():
            # A store call given up on earlier (a partition) still holds the old connection until
            # TCP's next retransmission, which backs off to minutes (and clone() waits behind it
            # too): a new connection answers at once once the network is back.
            make = _lineage.get("reconnect") or store.clone
            store = bounded(lambda _a: make(), deadline - current_time() + GRACE_SECONDS, "a new connection")
            if is_default:
                _lineage["root"] = store
        # Bounded: a store cut off by the network would otherwise hold this rank for minutes.
        joiner = joining.is_pending() and is_default
        members = bounded(
            lambda abandoned: _agree(store, st, gen, deadline, allow_shrink, abandoned, joiner),
            deadline - current_time() + GRACE_SECONDS,
            "the recovery agreement's store work",
        )
    except (RuntimeError, ConnectionError) as exc:  # dist.DistError and its kin: the store is gone
        diagnostics.store_failure = (
            str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        )
        raise RecoveryError(
            group=st.name, rank=me, generation=gen, missing_ranks=None, reason=diagnostics.store_gone_reason()
        ) from None
    new_rank, new_size = members.index(me), len(members)
    _groups.next_generation(st.name)
    # The agreed generation is used up, whatever happens next: if a member vanishes while the
    # group is rebuilt (RecoveryError at the deadline), the next recover() agrees on the one after.
    st.generation = gen
    if len(members) == st.size and _watch.is_watched(pg):
        # Everyone came back: rebuild in place, under the same ProcessGroup objects that DDP,
        # FSDP2, DeviceMesh and user code hold.
        if not _polled.wait_aborts():
            logger.warning(
                "rank %d: torch is still aborting the communicators of a timed-out group; rebuilding anyway",
                me,
            )
        groups = _rebuild_in_place(pg, is_default, gen, deadline)
        _watch.reset_ddp(groups)
        _watch.reset_fsdp()
        logger.info("rank %d: group %r rebuilt in place as generation %d", me, st.name, gen)
        joiners = _joiners(store, st, gen) if is_default else []
        if joiners:
            _watch.fresh_ddp_reducers(groups)
            _hand_over(pg, st, gen, state, joiners, deadline)
            if me == joiners[0]:  # every member read the list before the hand-over's barrier
                with contextlib.suppress(RuntimeError):  # a store without delete keeps it
                    store.delete_key(_joiners_key(st, gen))
        return pg
    if st.dead_reason is None:
        _groups.mark_dead(pg, "replaced by fastdist.recover()", level=logging.INFO)
    if not _polled.wait_aborts():
        logger.warning(
            "rank %d: torch is still aborting the communicators of a timed-out group; rebuilding anyway", me
        )
    _groups.hold(pg)
    if is_default:
        old_groups = _watch.watched_groups() or [pg]
        new = _rebuild_default(gen, new_rank, new_size)
        _watch.reset_ddp(old_groups, new)
        _watch.retire(old_groups)
    else:
        new = dist.new_group(members, timeout=_lineage["timeout"], use_local_synchronization=True)
        _watch.retire([pg])
    _groups.release_finished()
    logger.info(
        "rank %d: group %r rebuilt as generation %d: rank %d of %d", me, st.name, gen, new_rank, new_size
    )
    return new


def _joiners_key(st: _groups.GroupState, gen: int) -> str:
    return f"{_keys.key('recover', st.name)}/{gen}/joiners"


def _joiners(store: Any, st: _groups.GroupState, gen: int) -> list[int]:
    """The global ranks that joined the job in generation ``gen`` (replacements, spares)."""
    key = _joiners_key(st, gen)
    if not store.check([key]):
        return []
    return sorted({int(r) for r in bytes(store.get(key)).split()})


def _hand_over(
    pg: Any,
    st: _groups.GroupState,
    gen: int,
    state: dict[str, Any] | None,
    joiners: list[int],
    deadline: float,
) -> None:
    """A live rank's ``state`` to the ranks that joined; on a joiner, loaded into its ``state``."""
    me = st.my_global_rank
    names = ", ".join(f"rank {r}" for r in joiners)

    def fail(reason: str) -> RecoveryError:
        return RecoveryError(group=st.name, rank=me, generation=gen, reason=reason, missing_ranks=None)

    sharded = state_sync.sharded_entries(state) if state is not None else []
    if sharded:
        raise fail(
            f"{names} joined in a dead rank's place, but the state entries {', '.join(map(repr, sharded))} "
            "hold sharded tensors (FSDP2/DTensor): the dead rank's shards are on no live rank. Restart the "
            "job from a checkpoint"
        )
    if len(joiners) >= st.size:
        raise fail(
            "every rank of the group joined anew (all of the first processes died): no live rank holds "
            "the state. Restart the job from a checkpoint"
        )
    source = joining.source_of(st.size, joiners)
    try:
        if me in joiners:
            received = state_sync.receive(source, pg, deadline, into=state)
        else:
            received = None
            if me == source:
                state_sync.send(state, joiners, pg, deadline)
        # Every member learns whether the hand-over worked (a joiner that died mid-transfer fails
        # the source's send, and this barrier everywhere else).
        with fail_at(deadline):
            dist.barrier(group=pg)
    except FastdistError as exc:
        raise fail(f"handing the state to {names} failed: {exc}") from None
    if state is None:
        raise fail(
            f"{names} joined in a dead rank's place, but recover() was called without state=: "
            "the joiners cannot be brought up to date (pass the same state dict that sync_state() takes)"
        )
    if me not in joiners:
        return
    if received is None:
        raise fail("the live ranks called recover() without state=: there is no state to load")
    if set(received) != set(state):
        raise fail(f"the live ranks' state has keys {sorted(received)}, this rank's {sorted(state)}")
    for key, obj in state.items():
        obj.load_state_dict(received[key])
    logger.info("rank %d: loaded the state of rank %d (generation %d)", me, source, gen)


def _agree(
    store: Any,
    st: _groups.GroupState,
    gen: int,
    deadline: float,
    allow_shrink: bool,
    abandoned: threading.Event | None = None,
    joiner: bool = False,
) -> list[int]:
    """The sorted global ranks of the new generation, the same on every member. ``abandoned``
    (set when the caller stopped waiting for an unanswering store): this rank must not join the
    agreement late, as a member nobody will see."""
    key = _keys.key("recover", st.name)
    me = st.my_global_rank
    # The last generation agreed (set by one member of it), read as a counter: one operation,
    # 0 before the first recovery.
    latest = store.add(f"{key}/latest", 0)
    if latest >= gen:
        raise RecoveryError(
            group=st.name,
            rank=me,
            generation=gen,
            missing_ranks=None,
            reason=f"the other ranks already rebuilt the group as generation {latest} without this rank",
        )
    # O(1) store operations per rank: an add (arrival order), an append to one member list, and
    # a blocking wait on one key that holds the decision, read once: "all" (set by the last to
    # arrive) or "deadline:COUNT" (set at the first deadline by that rank's closer, with how many
    # had arrived). The member list is read only when the group shrinks: with everyone in, the
    # members are the old ranks.
    base = f"{key}/{gen}"
    if abandoned is not None and abandoned.is_set():
        raise StoreUnanswered("the caller gave up on the store before this rank joined the agreement")
    if joiner:  # before counting in: whoever sees the round complete sees this too
        store.append(f"{base}/joiners", f"{me}\n")
    n = store.add(f"{base}/count", 1)
    store.append(f"{base}/members", f"{n}:{me}\n")
    gone = _groups.gone(st) if allow_shrink else set()
    if n >= st.size:
        decision = bytes(store.compare_set(f"{base}/closed", "", "all"))
    else:
        seen: list[bytes] = []  # the decision, as this rank's closer found it (set or read)

        def close() -> None:
            count = store.add(f"{base}/count", 0)
            seen.append(bytes(store.compare_set(f"{base}/closed", "", f"deadline:{count}")))

        if gone:
            # This rank saw ranks go (their connections closed, no answer to the ring): the round
            # closes as soon as every other rank is in, not at the deadline. Polled, briefly: the
            # others are on their way. (A presumed-gone rank that turns up after all is left out,
            # as at a deadline.)
            while not seen and current_time() < deadline:
                if store.check([f"{base}/closed"]):
                    break
                if store.add(f"{base}/count", 0) >= st.size - len(gone):
                    close()
                    break
                time.sleep(0.005)
            if not seen and not store.check([f"{base}/closed"]):
                close()
        elif not _bell.wait_key(store, f"{base}/closed", deadline, close):
            raise StoreUnanswered("nobody could close the recovery agreement: the store is failing")
        decision = seen[0] if seen else bytes(store.get(f"{base}/closed"))
    # Whoever closed it first decided for everyone: the last arrival (then no one can have fixed
    # fewer), or a deadline (then the arrivals it counted; a later one is left out).
    count = st.size if decision == b"all" else _counted(decision)
    if count < st.size and not allow_shrink:
        arrived = _arrivals(store.get(f"{base}/members"), count)
        missing = [st.global_rank(r) for r in range(st.size) if st.global_rank(r) not in arrived]
        raise RecoveryError(
            group=st.name,
            rank=me,
            generation=gen,
            reason="not every rank turned up before the deadline",
            missing_ranks=missing,
        )
    final = min(count, st.size)
    if n > final:
        raise RecoveryError(
            group=st.name,
            rank=me,
            generation=gen,
            missing_ranks=None,
            reason="this rank turned up after the others had closed the new generation without it",
        )
    if final >= st.size:
        members = [st.global_rank(r) for r in range(st.size)]
    else:
        members = _members(store, base, final)
    # The generation's housekeeping, shared out by arrival order (at most one operation each
    # from 10 members up): record it as the latest, and delete generation gen - 2's keys (gen - 1's
    # reports stay: a straggler of it, left out, reads them to learn that the others timed out
    # rather than blame them as dead).
    chores = [f"{key}/latest", *_keys_of_generation(st, gen - 2)]
    try:
        for i in range(n - 1, len(chores), final):
            if i == 0:
                store.set(chores[0], str(gen))
            else:
                store.delete_key(chores[i])
    except RuntimeError:  # a store without delete (FileStore): the keys stay
        pass
    return members


# How long the members wait for an arrival counted but not yet in the member list (it added
# itself, then appends: microseconds apart unless it died in between).
APPEND_SECONDS = 0.5


def _members(store: Any, base: str, final: int) -> list[int]:
    """The sorted global ranks of the first ``final`` arrivals of a shrunk generation."""
    end = current_time() + APPEND_SECONDS
    while True:
        arrived = _arrivals(store.get(f"{base}/members"), final)
        if len(arrived) >= final or current_time() >= end:
            return sorted(arrived)
        time.sleep(0.005)


def _counted(decision: bytes) -> int:
    """The count a deadline's closer fixed ("deadline:COUNT"); 0 for anything else (a value not
    fastdist's: nobody is counted in, and recovery says so)."""
    what, _, count = decision.partition(b":")
    return int(count) if what == b"deadline" and count.isdigit() else 0


_ARRIVAL = re.compile(rb"^(\d+):(\d+)$", re.MULTILINE)


def _arrivals(raw: bytes, upto: int) -> set[int]:
    """The global ranks among the first ``upto`` arrivals in a member list ("ORDER:RANK" lines).
    (Parsed by one regular expression: every member reads the whole list when a group shrinks.)"""
    return {int(rank) for order, rank in _ARRIVAL.findall(raw) if int(order) <= upto}


def _keys_of_generation(st: _groups.GroupState, gen: int) -> list[str]:
    """fastdist's keys of generation ``gen`` of the group: once every member is two generations
    past it nothing reads them, and without deleting them the store would gain a dozen keys per
    timeout and recovery (gloo's own keys go in _forget_connections)."""
    if gen < 0:
        return []
    rec = _keys.key("recover", st.name, gen)
    diag = _keys.key("diag", st.name, gen)
    return [f"{rec}/{k}" for k in ("count", "members", "closed")] + [
        f"{diag}/{k}"
        for k in ("fault", "status", "count", "complete", "summary")
        + tuple(f"taker/{t}" for t in range(1, diagnostics.TAKER_TURNS + 1))
    ]


def _rebuild_in_place(pg: Any, is_default: bool, gen: int, deadline: float) -> list[Any]:
    """Swaps a fresh backend into every watched backend of ``pg`` (for the default group: of every
    watched group, the subgroups made from it too, oldest first, the same order on every rank),
    each on a store prefix of its own for this generation. Torch's connection set-up is bounded by
    what is left of ``deadline``."""
    groups = _watch.watched_groups() if is_default else [pg]
    root = _lineage["root"] if _lineage["root"] is not None else _groups.state_of(pg).store
    if root is None:  # recover() refused a group without a store before agreeing
        raise RuntimeError("no store to rebuild the group through")
    for g in groups:
        gst = _groups.state_of(g)
        for backend in _watch.backends_of(g):
            left = deadline - current_time()
            if left <= 0:
                raise RecoveryError(
                    group=gst.name,
                    rank=gst.my_global_rank,
                    generation=gen,
                    missing_ranks=None,
                    reason="the deadline passed while the groups were rebuilt",
                )
            prefix = dist.PrefixStore(_keys.key(f"gen{gen}", gst.name, backend.name()) + "/", root)
            fresh = _fresh_backend(backend, prefix, min(left, 1e6), gst)
            backend.swap_inner(fresh)
            _forget_connections(root, gst, backend, gen - 2)
        _groups.revive(gst)
        gst.generation = gen
        gst.seq = 0
    _groups.release_finished()
    return groups


def _forget_connections(root: Any, st: _groups.GroupState, backend: Any, gen: int) -> None:
    """Deletes the address this rank's gloo published for generation ``gen`` of a rebuilt backend
    (its first device's, ``DEVICE/RANK`` under the generation's prefix): every member agreed a
    later generation, so nobody connects through it any more. Each member deletes its own: one
    operation per rank, not one per rank pair. (NCCL's keys are its own; they stay.)"""
    if gen < 1 or backend.inner.name() != "gloo":
        return
    old = dist.PrefixStore(_keys.key(f"gen{gen}", st.name, backend.name()) + "/", root)
    try:
        old.delete_key(f"0/{backend.rank()}")
    except RuntimeError:  # a store without delete
        pass


def _fresh_backend(old: Any, store: Any, seconds: float, st: _groups.GroupState) -> Any:
    """A new backend of ``old``'s kind (gloo or NCCL) for the same rank and size."""
    td = datetime.timedelta(seconds=seconds)
    inner = old.inner
    name = inner.name()
    fresh: Any
    try:
        if name == "gloo":
            fresh = dist.ProcessGroupGloo(store, old.rank(), old.size(), td)
        elif name == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = td
            fresh = dist.ProcessGroupNCCL(store, old.rank(), old.size(), opts)
        else:
            raise RecoveryError(
                group=st.name,
                rank=st.my_global_rank,
                generation=st.generation + 1,
                missing_ranks=None,
                reason=f"cannot rebuild a {name} backend in place",
            )
    except RuntimeError as exc:  # a member vanished while the connections were made
        raise RecoveryError(
            group=st.name,
            rank=st.my_global_rank,
            generation=st.generation + 1,
            missing_ranks=None,
            reason=f"rebuilding the connections failed: {str(exc).strip().splitlines()[0]}",
        ) from None
    try:
        fresh._set_sequence_number_for_group()
    except (RuntimeError, AttributeError):
        pass
    return fresh


def _rebuild_default(gen: int, rank: int, world_size: int) -> Any:
    # The dead group is held by fastdist (see _groups.hold), so dropping torch's references to
    # it here does not run its destructor, which could block on an op still in flight.
    dist.destroy_process_group()
    root = _lineage["root"]
    store = dist.PrefixStore(_keys.key(f"gen{gen}") + "/", root)
    kwargs = {} if _lineage["timeout"] is None else {"timeout": _lineage["timeout"]}
    dist.init_process_group(
        backend=_lineage["backend"], store=store, rank=rank, world_size=world_size, **kwargs
    )
    return dist.distributed_c10d._get_default_group()
