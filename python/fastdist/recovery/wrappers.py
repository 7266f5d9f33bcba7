"""The DDP and FSDP2 modules on watched groups, and resetting them after a fault: a failed step
leaves DDP's reducer waiting for a reduction that never finished, and FSDP2 mid-iteration."""

from __future__ import annotations

import gc
import itertools
import logging
import os
import sys
import threading
import weakref
from typing import Any

from ..errors import FastdistError
from ..groups import registry

logger = logging.getLogger(__name__)

# DistributedDataParallel modules on watched groups, so that recover() can reset their reducers
# (a backward that failed leaves DDP waiting for a reduction that never finished), each with its
# place in the order they were made (a joiner's modules are matched with a live rank's by it).
_ddp_modules: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_made = itertools.count()


def track_ddp() -> None:
    """Patches DistributedDataParallel, once, so that every DDP module made is recorded here in the
    order made (for :func:`reset_ddp` and a joiner's layouts), and its logging data on a watched
    group names the wrapped backend as on that backend itself."""
    from torch.nn.parallel import DistributedDataParallel

    if getattr(DistributedDataParallel.__init__, "_fastdist", False):
        return
    original = DistributedDataParallel.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _ddp_modules[self] = next(_made)

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


def _modules_on(group: Any) -> list[Any]:
    """The DDP modules on ``group``, in the order this process made them."""
    on = [(order, m) for m, order in list(_ddp_modules.items()) if getattr(m, "process_group", None) is group]
    return [m for _, m in sorted(on, key=lambda om: om[0])]


def ddp_layouts_wanted(group: Any) -> bool:
    """Whether any DDP module is on ``group`` (whose new reducer wants a live rank's buckets)."""
    return bool(_modules_on(group))


def _signature(parameters: list[Any]) -> list[str]:
    """What a layout's parameter indices refer to: each parameter's shape, dtype and device type."""
    return [f"{tuple(p.shape)}:{p.dtype}:{p.device.type}" for p in parameters]


def ddp_layouts(group: Any) -> list[dict[str, Any] | None]:
    """The gradient buckets of every DDP module on ``group`` as its reducer has them now, in the
    order the modules were made: for each, ``params`` (its parameters' signatures) and
    ``buckets`` (lists of parameter indices, in the order they are reduced); None for a module
    whose buckets cannot be read. After DDP's first iteration they are the buckets it rebuilt in
    the order gradients came, which a new reducer does not know. (torch reads them out as zeroed
    copies of the buckets: memory the size of the gradients, for a moment.)"""
    out: list[dict[str, Any] | None] = []
    for module in _modules_on(group):
        try:
            parameters, _ = module._build_params_for_reducer()
            index = {id(p): i for i, p in enumerate(parameters)}
            buckets = [
                [index[id(p)] for p in bucket.parameters()]
                for bucket in module.reducer._get_zeros_like_grad_buckets()
            ]
        except (AttributeError, KeyError, RuntimeError) as exc:
            logger.debug("fastdist: the buckets of a DDP module cannot be read: %r", exc)
            out.append(None)
            continue
        out.append({"params": _signature(parameters), "buckets": buckets})
    return out


def _buckets_of(layout: Any, parameters: list[Any]) -> list[list[int]] | None:
    """``layout``'s buckets when they lay out exactly ``parameters`` (the same signatures, every
    index once); else None."""
    if not isinstance(layout, dict) or layout.get("params") != _signature(parameters):
        return None
    buckets = layout.get("buckets")
    if not isinstance(buckets, list) or not all(isinstance(b, list) and b for b in buckets):
        return None
    flat = [i for b in buckets for i in b]
    if sorted(flat) != list(range(len(parameters))) or not all(isinstance(i, int) for i in flat):
        return None
    return [list(b) for b in buckets]


def fresh_ddp_reducers(groups: list[Any], layouts: dict[int, list[Any]] | None = None) -> int:
    """Gives every DDP module on one of ``groups`` a new reducer, as its constructor builds one
    (torch's own recipe, ``DistributedDataParallel.__setstate__``): a process that joined has
    a new DDP whose gradient buckets are laid out by parameter order, while the live ranks' were
    rebuilt in the order gradients came; an all-reduce over buckets laid out differently sums
    unrelated gradients. Afterwards every rank starts from the same layout, and rebuilds it the
    same way after the next step. Returns how many were rebuilt.

    ``layouts`` (by ``id`` of the group: what :func:`ddp_layouts` gave on one rank of it, the same
    on every member): each module's new reducer gets the buckets of the module made in the same
    place there, when they lay out the same parameters. With the buckets a live rank rebuilt,
    every member reduces the next step as an undisturbed run does (gloo sums each element in an
    order that depends on its offset in its bucket: other buckets, other float sums)."""
    n = 0
    for group in groups:
        given = (layouts or {}).get(id(group)) or []
        for place, module in enumerate(_modules_on(group)):
            parameters, expect_sparse = module._build_params_for_reducer()
            names = module._build_debug_param_to_name_mapping(parameters)
            layout = given[place] if place < len(given) else None
            buckets = _buckets_of(layout, parameters) if layout is not None else None
            if layout is not None and buckets is None:
                logger.warning(
                    "fastdist: DDP module %d on its group has other parameters than the same module on the "
                    "rank that handed over its buckets: its reducer starts from DDP's first layout",
                    place,
                )
            _init_reducer(module, parameters, expect_sparse, names, buckets)
            if module.static_graph:
                module.reducer._set_static_graph()
            module._has_rebuilt_buckets = False
            n += 1
    return n


def _init_reducer(
    module: Any, parameters: list[Any], expect_sparse: Any, names: Any, buckets: list[list[int]] | None
) -> None:
    """torch's ``_ddp_init_helper`` (a new reducer, logger and hooks) with ``buckets`` as the
    bucket assignment, in the order they are reduced, instead of the one it computes (None: its
    own). It takes the assignment from ``dist._compute_bucket_assignment_by_size`` and reverses
    it, so that function answers with ``buckets`` reversed, for this thread and this call only."""
    if buckets is None:
        module._ddp_init_helper(parameters, expect_sparse, names, module.static_graph)
        return
    import torch.distributed as dist

    compute = dist._compute_bucket_assignment_by_size
    thread = threading.get_ident()
    given = [list(b) for b in reversed(buckets)]

    def assign(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != thread:
            return compute(*args, **kwargs)
        return given, [int(module.bucket_bytes_cap)] * len(given)

    dist._compute_bucket_assignment_by_size = assign
    try:
        module._ddp_init_helper(parameters, expect_sparse, names, module.static_graph)
    finally:
        dist._compute_bucket_assignment_by_size = compute


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
        if not _fsdp_ran(m):  # never ran a step (a joiner's new model): nothing to reset
            continue
        if not hasattr(m, "reset_iter_state"):  # torch before 2.13 has no such hook
            _reset_iter_state(m._get_fsdp_state())
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


def _reset_iter_state(root: Any) -> None:
    """torch 2.13's ``FSDPState._reset_iter_state`` (torch/distributed/fsdp/_fully_shard/
    _fsdp_state.py and ``FSDPParamGroup._reset_iter_state``), for a torch without it (2.11, 2.12):
    waits on the failed step's collective events, forgets its gradients, and reshards *every*
    parameter group of the tree, then clears the iteration's trackers. (A non-recursive
    ``reshard()`` on the root, what was here before, left the inner modules unsharded and the
    model silently wrong.) Attributes are read where they exist: 2.11 keeps one reduce-scatter
    state where 2.13 keeps a list."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    stream = root._device_handle.current_stream()
    comm = root._comm_ctx

    def wait_event(event: Any) -> None:
        if event is not None:
            stream.wait_event(event)

    if (ag := getattr(comm, "all_gather_state", None)) is not None:
        wait_event(ag.event)
        comm.all_gather_state = None
    for rs in list(getattr(comm, "reduce_scatter_states", [])) + [
        getattr(comm, "reduce_scatter_state", None)
    ]:
        if rs is not None:
            wait_event(rs.event)
    if hasattr(comm, "reduce_scatter_states"):
        comm.reduce_scatter_states.clear()
    if hasattr(comm, "reduce_scatter_state"):
        comm.reduce_scatter_state = None
    for event in getattr(comm, "_last_post_reduce_events", {}).values():
        wait_event(event)
    getattr(comm, "_last_post_reduce_events", {}).clear()
    comm.post_forward_order.clear()
    for state in root._state_ctx.all_states:
        state._modules_to_run_forward.clear()
        state._training_state = TrainingState.IDLE
        # torch 2.11 keeps one parameter group per state (or none), 2.13 a list.
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            groups = [g] if (g := getattr(state, "_fsdp_param_group", None)) is not None else []
        for group in groups:
            result = group._all_gather_result
            if result is not None:  # the failed step's all-gather: its fault is known, not waited
                wait_event(getattr(result, "all_gather_event", None))
                group._all_gather_result = None
            wait_event(group._post_reduce_event)
            group._post_reduce_event = None
            if group._all_reduce_state is not None:
                wait_event(group._all_reduce_state.event)
            group._all_reduce_state = None
            if group._reshard_after_forward_event is not None:
                group._wait_all_gather_streams_on_event(group._reshard_after_forward_event)
                group._reshard_after_forward_event = None
            group._partial_reduce_output = None
            group._post_forward_indices.clear()
            group._training_state = TrainingState.IDLE
            group._to_sharded()
    root._state_ctx.iter_forward_root = None
    root._state_ctx.post_backward_final_callback_queued = False


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
