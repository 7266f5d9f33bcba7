"""fastdist: real deadlines for torch.distributed.

    from fastdist import barrier
    barrier(timeout=10)   # returns when all ranks arrived, or raises CollectiveTimeoutError

Importing fastdist starts no thread: the deadline engine starts with the first deadline.
"""

from __future__ import annotations

from ._version import __version__
from .collectives import (
    Work,
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    batch_isend_irecv,
    broadcast,
    gather,
    irecv,
    isend,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
    send,
    wait,
)
from .deadlines import (
    DeadlineScope,
    RendezvousTimeout,
    current_time,
    fail_after,
    fail_at,
    get_default_timeout,
    get_timeout_handler,
    set_default_timeout,
    set_timeout_handler,
)
from .errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    FastdistError,
    GroupAbortedError,
    MetricsPortError,
    RecoveryError,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
    RpcTimeoutError,
)
from .groups.checks import checks_enabled, set_checks
from .groups.pgstate import is_dead
from .groups.registry import history
from .metrics import serve_metrics
from .object_collectives import all_gather_object, broadcast_object_list, gather_object, scatter_object_list
from .process_group import get_rank, get_world_size, init_process_group
from .recovery.checkpoint import load_checkpoint, save_checkpoint
from .recovery.growing import grow, sync_state
from .recovery.recover import recover
from .recovery.snapshot import PeerSnapshot
from .steps import run_step
from .store.etcd import EtcdAccessError, EtcdSecurity, EtcdStore

# fastdist.rpc is a submodule (import fastdist.rpc): it imports torch.distributed.rpc.
# fastdist.lightning and fastdist.accelerate too: they import those frameworks.

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DeadlineScope",
    "EtcdAccessError",
    "EtcdSecurity",
    "EtcdStore",
    "FastdistError",
    "GroupAbortedError",
    "MetricsPortError",
    "PeerSnapshot",
    "RecoveryError",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousTimeout",
    "RendezvousTimeoutError",
    "RpcTimeoutError",
    "Work",
    "__version__",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "checks_enabled",
    "current_time",
    "fail_after",
    "fail_at",
    "gather",
    "gather_object",
    "get_default_timeout",
    "get_rank",
    "get_timeout_handler",
    "get_world_size",
    "grow",
    "history",
    "init_process_group",
    "irecv",
    "is_dead",
    "isend",
    "load_checkpoint",
    "recover",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "run_step",
    "save_checkpoint",
    "scatter",
    "scatter_object_list",
    "send",
    "serve_metrics",
    "set_checks",
    "set_default_timeout",
    "set_timeout_handler",
    "sync_state",
    "wait",
]
