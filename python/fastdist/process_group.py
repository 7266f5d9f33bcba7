"""Starting a job: ``fastdist.init_process_group`` is torch's, plus a store connection that
retries and says why it failed, watched groups, and what recovery needs kept (the backend, the
group timeout and the store). A process that starts while the job runs joins it."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import (
    metrics,
    shutdown,  # noqa: F401  (the exit hook: registered with the first import of fastdist)
)
from .deadlines import RendezvousTimeout, validate_seconds
from .diagnostics import uncaught
from .groups import pgstate
from .ops import listener, watching
from .recovery import joining, wrappers
from .recovery.recover import LINEAGE_PROBE
from .recovery.world import prepare_growth, read_world
from .store import job, keys, rendezvous
from .store.etcd import parse_url, security_of
from .store.job import JOB

logger = logging.getLogger(__name__)


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
    raised as :class:`RendezvousConnectionError` with their cause (see fastdist.store.rendezvous). Then
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

    ``device_id`` (a ``torch.device`` or a CUDA index) sets this process's CUDA device, and is
    not handed to torch: fastdist connects NCCL at the first collective, as torch does without
    it. (torch's eager init splits every new group, ``new_group`` and a DeviceMesh's, from the
    default group's communicator, which it takes from the backend registered in the group: a
    watched group's is fastdist's wrapper, which torch cannot split from.)

    ``FASTDIST_METRICS_PORT=PORT``: serves Prometheus metrics on PORT + LOCAL_RANK (see
    :func:`fastdist.serve_metrics`); ``FASTDIST_EVENTS=PATH``: writes an event per fault and
    recovery (fastdist.diagnostics.events).
    """
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
    _bind_device(kwargs.pop("device_id", None))
    job.die_with_agent()
    job.start_heartbeat()
    uncaught.record_uncaught()
    configure_nccl_error_handling(backend)
    conn = _connect(init_method, store, rank, world_size, td, connect, retries, backoff)
    store, init_method, rank, world_size = conn.store, conn.init_method, conn.rank, conn.world_size
    if rdzv is not None:
        if store is None:
            raise ValueError("rendezvous_timeout needs env://, tcp:// or a store")
        rendezvous.rendezvous(
            store,
            -1 if rank is None else rank,
            -1 if world_size is None else world_size,
            rdzv,
            hosts_store=conn.hosts_store,
        )
    job_store = _job_store(store)
    place = _place(job_store, rank, world_size, n_spares)
    watching.activate(None if td is None else td.total_seconds())
    wrappers.track_ddp()
    with joining.solo_groups() if place.joiner else contextlib.nullcontext():
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            timeout=td,
            store=store,
            rank=-1 if place.rank is None else place.rank,
            world_size=-1 if place.world_size is None else place.world_size,
            **kwargs,
        )
    _record_job(job_store, td, place)
    metrics.serve_from_environment()
    # The default group's state now, not on fastdist's arming thread: a first op may follow at
    # once, in a thread that then holds the GIL (see fastdist.groups.native_report.arm).
    pgstate.state_of(dist.distributed_c10d._get_default_group())
    if place.joiner:
        logger.info(
            "rank %d joins the running job: call fastdist.sync_state(state) to take its place", place.rank
        )
        return
    if job_store is not None:
        _all_started(job_store, dist.get_world_size(), td)
        if dist.get_rank() == 0 and keys.agent_hosts_store():
            job_store.set(job.inboxes_key(), dist.distributed_c10d._get_default_group().group_name)
        job.mark_running(job_store)
    listener.start(dist.distributed_c10d._get_default_store(), dist.get_rank())


@dataclass
class _Connection:
    """What :func:`_connect` made: the store (None: torch makes it from ``init_method``), the
    init method left for torch, the rank and world size (from the environment when read there),
    and whether this process hosts the store."""

    store: Any
    init_method: str | None
    rank: int | None
    world_size: int | None
    hosts_store: bool = False


def _connect(
    init_method: str | None,
    store: Any,
    rank: int | None,
    world_size: int | None,
    td: datetime.timedelta | None,
    connect: float,
    retries: int | None,
    backoff: float,
) -> _Connection:
    """The job's store, connected by fastdist for etcd://, env:// and tcp:// (retried, its failures
    explained; the versions checked against rank 0's), and where it is in :data:`JOB` (for
    messages, and a new connection after a partition)."""
    JOB.reconnect = None
    store_seconds = td.total_seconds() if td is not None else 300.0
    if store is None and init_method is not None and init_method.startswith("etcd://"):
        endpoints, job_id, ttl = parse_url(init_method)
        rank, world_size = _rank_and_size(rank, world_size)
        store = rendezvous.connect_etcd(
            endpoints,
            job_id,
            ttl=ttl,
            security=security_of(init_method),
            connect_timeout=connect,
            retries=retries,
            backoff=backoff,
            store_timeout=store_seconds,
        )
        rendezvous.check_versions(store, rank, world_size, *endpoints[0], timeout=connect)
        JOB.location = f"etcd {','.join(f'{h}:{p}' for h, p in endpoints)} (job {job_id!r})"
        return _Connection(store, None, rank, world_size)
    target = _tcp_target(init_method, store)
    if target is None:
        return _Connection(store, init_method, rank, world_size)
    host, port = target
    rank, world_size = _rank_and_size(rank, world_size)
    # Under torchrun the agent hosts the store on MASTER_PORT: every worker is a client.
    agent = (init_method or "env://").startswith("env://") and keys.agent_hosts_store()
    hosts_store = rank == 0 and not agent
    store = rendezvous.connect_store(
        host,
        port,
        is_master=hosts_store,
        world_size=world_size,
        connect_timeout=connect,
        retries=retries,
        backoff=backoff,
        store_timeout=store_seconds,
    )
    rendezvous.check_versions(store, rank, world_size, host, port, timeout=connect)
    hosted_by = "torchrun's agent" if agent else "in rank 0"
    JOB.location = f"{host}:{port} ({hosted_by})"
    if agent:
        # torchrun's agent keeps its store across restarts of the worker group: torch's own keys
        # (gloo's addresses) of the last attempt must not be read by this one.
        store = dist.PrefixStore(keys.pg_prefix(), store)

    def reconnect() -> Any:
        """A new connection to the job's store, under the prefixes of the default store: ours
        under torchrun's agent, then torch's group prefix ("GROUP_NAME/"), checked against a
        key written through the original at init."""
        fresh: Any = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=store_seconds))
        if agent:
            fresh = dist.PrefixStore(keys.pg_prefix(), fresh)
        fresh = dist.PrefixStore(f"{JOB.group_name}/", fresh)
        if not fresh.check([LINEAGE_PROBE]):
            raise RuntimeError("a new connection to the store does not see the job's keys")
        return fresh

    JOB.reconnect = reconnect
    return _Connection(store, None, rank, world_size, hosts_store)


@dataclass
class _Place:
    """Where this process stands in the job (:func:`_place`): its rank and the world size it
    joins with, the size launched (spares left out), whether it joins a running job, and the
    world as the job's last shrink or growth left it (epoch, size)."""

    rank: int | None
    world_size: int | None
    launched: int | None
    joiner: bool = False
    grower: bool = False
    world: tuple[int, int] | None = None


def _place(job_store: Any, rank: int | None, world_size: int | None, n_spares: int) -> _Place:
    """A spare waits here for a dead rank's place; a process that finds the job running joins
    it, as the rank it replaces or, when the job shrank since its launch, as one rank more."""
    if n_spares and (job_store is None or rank is None or world_size is None):
        raise ValueError("spares need env://, tcp://, etcd:// or a store, with rank and world_size")
    if job_store is None or rank is None or world_size is None:
        return _Place(rank, world_size, world_size)
    if n_spares >= world_size:
        raise ValueError(f"spares ({n_spares}) must be fewer than the processes launched ({world_size})")
    world_size -= n_spares
    joiner = False
    if rank >= world_size:
        logger.info("launch rank %d: a spare, waiting for a dead rank's place", rank)
        rank = joining.wait_for_vacancy(job_store, rank)
        # Scripts and frameworks that read RANK see the rank this process now holds (its
        # launch rank was a spare's); LOCAL_RANK, its device, stays.
        os.environ["RANK"] = str(rank)
        if "ROLE_RANK" in os.environ:
            os.environ["ROLE_RANK"] = str(rank)
        # A rank that died before the job ran (in its group creation, say) leaves the others
        # waiting for it there: the spare takes its place in that first start, as the rank's
        # own process would have (a joiner would wait in sync_state for a hand-over nobody
        # can give, the others in torch's group creation for it).
        joiner = job.job_running(job_store)
    elif not JOB.started:  # a process that made its groups before is no joiner
        joiner = job.job_running(job_store)
    place = _Place(rank, world_size, world_size, joiner, world=read_world(job_store))
    if joiner and place.world is not None and place.world[1] < world_size:
        # The job shrank since its launch: this process joins as one rank more, admitted by
        # the live ranks' fastdist.grow() (in sync_state).
        place.grower, place.rank, place.world_size = True, place.world[1], place.world[1] + 1
        logger.info(
            "a process joining the shrunk job: rank %d of %d once admitted", place.rank, place.world_size
        )
    return place


def _record_job(job_store: Any, td: datetime.timedelta | None, place: _Place) -> None:
    """What recovery and growing need of the job, once torch made the default group."""
    JOB.store = job_store
    epoch = place.world[0] if place.world is not None else 0
    prepare_growth(epoch, place.launched or 0, place.grower)
    JOB.started, JOB.backend, JOB.timeout = True, dist.get_backend(), td
    JOB.root = dist.distributed_c10d._get_default_store()
    if JOB.reconnect is not None:
        try:
            JOB.group_name = dist.distributed_c10d._get_default_group().group_name
        except RuntimeError:  # a backend without a group name: no second connection then
            JOB.reconnect = None
        else:
            JOB.root.set(LINEAGE_PROBE, "1")  # what a new connection must see (reconnect)


# The longest timeout handed to torch (its TCPStore and backends count in nanoseconds somewhere:
# 10**6 days failed to connect at once). Anything longer, math.inf included, means no deadline.
MAX_TIMEOUT = datetime.timedelta(days=3650)


def _group_timedelta(seconds: float) -> datetime.timedelta:
    return MAX_TIMEOUT if seconds >= MAX_TIMEOUT.total_seconds() else datetime.timedelta(seconds=seconds)


def _all_started(job_store: Any, world_size: int, td: datetime.timedelta | None) -> None:
    """Waits until every rank of the first start has made its default group, before the job is
    marked running (a process that finds that mark is a joiner). gloo's group creation connects
    every rank, so this costs one store round trip there; NCCL's connects nobody (communicators
    are made at the first op), so without it a rank that started late would take itself for a
    replacement."""
    count = job_store.add(keys.key("started"), 1)
    everyone = keys.key("started", "all")
    if count >= world_size:
        job_store.set(everyone, "1")
        return
    job_store.wait([everyone], td if td is not None else datetime.timedelta(seconds=300))


def _job_store(store: Any) -> Any | None:
    """The job's store under fastdist's own keys (under torchrun's agent, below the prefix the
    workers' groups use), or None when torch made the store itself."""
    if isinstance(store, dist.PrefixStore) and keys.agent_hosts_store():
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


def _bind_device(device_id: Any) -> None:
    """``device_id`` as fastdist takes it (see :func:`init_process_group`): the CUDA device is set,
    nothing is connected eagerly."""
    if device_id is None:
        return
    if isinstance(device_id, bool) or not isinstance(device_id, (int, torch.device)):
        raise TypeError(
            f"device_id must be a torch.device or an int, got {type(device_id).__name__}: {device_id!r}"
        )
    device = torch.device("cuda", device_id) if isinstance(device_id, int) else device_id
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"device_id must be a CUDA device with an index, got {device}")
    torch.cuda.set_device(device)


NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
# 2 = CleanUpOnly: torch's watchdog aborts the communicators of a failed work but does not tear
# the process down. torch's default (3) kills the process, which would undo a fastdist abort.
NCCL_ERROR_HANDLING_MODE = "2"


# What else torch's NCCL watchdog does after a failed op, in 2.11 to 2.14.1 (Watchdog::runLoop,
# HeartbeatMonitor in ProcessGroupNCCL.cpp): it writes the dump signal and sleeps 4 x
# TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (60 s) holding the lock that enqueueing an op takes, so every
# op of the group and the group's destructor wait that long; and the heartbeat monitor of the first
# group, told by that signal (unless TORCH_NCCL_DUMP_ON_TIMEOUT=0), ends the process 480 s later
# with LOG(FATAL). fastdist reports the fault itself (who is missing, their stacks), so both are
# turned off unless the user set them: a process fastdist rescued is neither stalled nor killed.
NCCL_WATCHDOG_DEFAULTS = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0"}


def configure_nccl_error_handling(backend: str | None) -> None:
    """Sets TORCH_NCCL_ASYNC_ERROR_HANDLING=2 for a backend that may be NCCL (``None`` lets torch
    pick NCCL on a GPU machine), so that torch's watchdog never kills a process after fastdist
    aborted a timed-out collective. A value the user set is kept, with a warning if it differs.
    Also turns off the watchdog's dump, its sleep and the heartbeat monitor's kill that follow a
    failed op (NCCL_WATCHDOG_DEFAULTS), where the user did not set them."""
    if backend is not None and "nccl" not in str(backend).lower():
        return
    for name, value in NCCL_WATCHDOG_DEFAULTS.items():
        os.environ.setdefault(name, value)
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
    if not keys.under_torchrun():
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
