"""The DDP and FSDP2 modules on watched groups, and resetting them after a fault: a failed step
leaves DDP's reducer waiting for a reduction that never finished, and FSDP2 mid-iteration."""

from __future__ import annotations

import gc
import os
import sys
import weakref
from typing import Any

from ..errors import FastdistError
from ..groups import registry

# DistributedDataParallel modules on watched groups, so that recover() can reset their reducers
# (a backward that failed leaves DDP waiting for a reduction that never finished).
_ddp_modules: weakref.WeakSet[Any] = weakref.WeakSet()


def track_ddp() -> None:
    from torch.nn.parallel import DistributedDataParallel

    if getattr(DistributedDataParallel.__init__, "_fastdist", False):
        return
    original = DistributedDataParallel.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _ddp_modules.add(self)

    __init__._fastdist = True  # type: ignore[attr-defined]
    __init__.__doc__ = original.__doc__
    DistributedDataParallel.__init__ = __init__  # type: ignore[method-assign]
    logging_data: Any = DistributedDataParallel._get_ddp_logging_data

    def _get_ddp_logging_data(self: Any) -> dict[str, Any]:
        return _as_torch_logs_it(self.process_group, logging_data(self))

    _get_ddp_logging_data.__doc__ = logging_data.__doc__
    DistributedDataParallel._get_ddp_logging_data = _get_ddp_logging_data  # type: ignore[method-assign]


def _env(name: str) -> str:
    return os.environ.get(name, "N/A")  # as torch's DDP logger reads it


def _as_torch_logs_it(pg: Any, data: dict[str, Any]) -> dict[str, Any]:
    """DDP's logging data on a watched group as on the backend it wraps: torch's logger takes the
    name from the group's backend type, "custom" for fastdist's wrapper (registered as a custom
    backend because the logger casts a gloo group's backend to ProcessGroupGloo), and so leaves
    out gloo's and NCCL's own fields."""
    if data.get("backend_name") != "custom":
        return data
    backends = registry.backends_of(pg)
    if not backends:
        return data
    inner = backends[0].inner
    name = inner.name()
    data["backend_name"] = name
    if name == "gloo":
        data["gloo_socket_ifname"] = _env("GLOO_SOCKET_IFNAME")
        data["gloo_device_transport"] = _env("GLOO_DEVICE_TRANSPORT")
        data["gloo_num_threads"] = int(inner.options._threads)
    elif name == "nccl":
        for key, var in (
            ("nccl_socket_ifname", "NCCL_SOCKET_IFNAME"),
            ("nccl_blocking_wait", "NCCL_BLOCKING_WAIT"),
            ("nccl_async_error_handling", "NCCL_ASYNC_ERROR_HANDLING"),
            ("nccl_debug", "NCCL_DEBUG"),
            ("nccl_nthreads", "NCCL_NTHREADS"),
            ("nccl_ib_timeout", "NCCL_IB_TIMEOUT"),
        ):
            data[key] = _env(var)
    return data


def reset_ddp(old_groups: list[Any], replacement: Any | None = None) -> int:
    """Resets every DDP module on one of ``old_groups`` after a recovery: its reducer forgets the
    failed iteration and, with ``replacement`` (a shrunk default group), moves to that group, so
    that gradients are averaged over the new world size. Returns how many were reset."""
    ids = {id(g) for g in old_groups}
    n = 0
    for module in list(_ddp_modules):
        pg = getattr(module, "process_group", None)
        if id(pg) in ids:
            module._update_process_group(replacement if replacement is not None else pg)
            n += 1
    return n


def fresh_ddp_reducers(groups: list[Any]) -> int:
    """Gives every DDP module on one of ``groups`` a new reducer, as its constructor builds one
    (torch's own recipe, ``DistributedDataParallel.__setstate__``): a process that joined has
    a new DDP whose gradient buckets are laid out by parameter order, while the live ranks' were
    rebuilt in the order gradients came; an all-reduce over buckets laid out differently sums
    unrelated gradients. Afterwards every rank starts from the same layout, and rebuilds it the
    same way after the next step. Returns how many were rebuilt."""
    ids = {id(g) for g in groups}
    n = 0
    for module in list(_ddp_modules):
        if id(getattr(module, "process_group", None)) not in ids:
            continue
        parameters, expect_sparse = module._build_params_for_reducer()
        names = module._build_debug_param_to_name_mapping(parameters)
        module._ddp_init_helper(parameters, expect_sparse, names, module.static_graph)
        if module.static_graph:
            module.reducer._set_static_graph()
        module._has_rebuilt_buckets = False
        n += 1
    return n


def reset_fsdp() -> int:
    """Resets the per-iteration state of every root FSDP2 module (``reset_iter_state``, torch's
    own recovery hook for a forward or backward that raised), so that the next step starts from
    sharded parameters. Returns how many were reset."""
    if "torch.distributed.fsdp" not in sys.modules:
        return 0
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return 0
    # type(), not isinstance(): isinstance reads __class__, which some objects in the heap answer
    # with a warning (torch's deprecated torch.distributed.reduce_op).
    roots = [m for m in gc.get_objects() if issubclass(type(m), FSDPModule) and _fsdp_is_root(m)]
    for m in roots:
        if not hasattr(m, "reset_iter_state"):  # torch before 2.11: reshard what can be
            m.reshard()
            continue
        if not _fsdp_ran(m):  # never ran a step (a joiner's new model): nothing to reset
            continue
        try:
            m.reset_iter_state()
        except FastdistError:
            # It waits on the failed step's all-gathers, which raise their fault: forget them.
            for state in m._get_fsdp_state()._state_ctx.all_states:
                for group in state._fsdp_param_groups:
                    group._all_gather_result = None
            m.reset_iter_state()
    return len(roots)


def _fsdp_ran(module: Any) -> bool:
    """Whether the FSDP2 root ran its lazy init (its first forward; torch's FSDPCommContext makes
    ``all_gather_state`` there): before it, torch's reset_iter_state fails on state that does not
    exist yet."""
    try:
        return hasattr(module._get_fsdp_state()._comm_ctx, "all_gather_state")
    except (AttributeError, RuntimeError):
        return False


def _fsdp_is_root(module: Any) -> bool:
    try:
        return module._get_fsdp_state()._is_root is not False
    except (AttributeError, RuntimeError):
        return False
