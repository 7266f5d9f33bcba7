"""The rebuild of a recovery: fresh backends swapped into the same ProcessGroup objects (in
place), each generation under a store prefix of its own, or a new default group for a shrink or
growth. Split out of recover.py, which coordinates."""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch.distributed as dist

from ..deadlines import (
    current_time,
)
from ..groups import pgstate, registry
from ..store import keys
from ..store.job import JOB
from . import joining

logger = logging.getLogger(__name__)


def _rebuild_in_place(pg: Any, is_default: bool, gen: int, deadline: float) -> list[Any]:
    """Swaps a fresh backend into every watched backend of ``pg`` (for the default group: of every
    watched group, the subgroups made from it too, oldest first, the same order on every rank),
    each on a store prefix of its own for this generation. Torch's connection set-up is bounded by
    what is left of ``deadline``."""
    groups = registry.watched_groups() if is_default else [pg]
    root = JOB.root if JOB.root is not None else pgstate.state_of(pg).store
    # A subgroup recovered on its own numbers its generations from its last rebuild by the
    # default group's recovery, which sets them to the default group's: its keys are apart from
    # those (under the default group's generation), or a later recovery of the default group
    # would meet a generation's addresses published before and connect to a live backend.
    own = "" if is_default else f"own{_default_generation()}"
    if root is None:  # recover() refused a group without a store before agreeing
        raise RuntimeError("no store to rebuild the group through")
    for g in groups:
        gst = pgstate.state_of(g)
        for backend in registry.backends_of(g):
            left = deadline - current_time()
            if left <= 0:
                raise gst.recovery_error(gen, "the deadline passed while the groups were rebuilt")
            prefix = dist.PrefixStore(_rebuild_prefix(gen, gst, backend, own), root)
            fresh = _fresh_backend(backend, prefix, min(left, 1e6), gst)
            backend.swap_inner(fresh)
            _forget_connections(root, gst, backend, gen - 2, own)
        pgstate.revive(gst)
        gst.generation = gen
        gst.checks_seq = 0
    pgstate.release_finished()
    return groups


def _default_generation() -> int:
    return (
        pgstate.state_of(dist.distributed_c10d._get_default_group()).generation
        if dist.is_initialized()
        else 0
    )


def _rebuild_prefix(gen: int, st: pgstate.GroupState, backend: Any, own: str) -> str:
    """The store prefix of generation ``gen`` of ``backend`` (of group ``st``) rebuilt in place;
    ``own``: a subgroup's own recovery (see _rebuild_in_place)."""
    return keys.key(f"gen{gen}", st.name, backend.name(), *([own] if own else [])) + "/"


def _forget_connections(root: Any, st: pgstate.GroupState, backend: Any, gen: int, own: str) -> None:
    """Deletes the address this rank's gloo published for generation ``gen`` of a rebuilt backend
    (its first device's, ``DEVICE/RANK`` under the generation's prefix): every member agreed a
    later generation, so nobody connects through it any more. Each member deletes its own: one
    operation per rank, not one per rank pair. (NCCL's keys are its own; they stay.)"""
    if gen < 1 or backend.inner.name() != "gloo":
        return
    old = dist.PrefixStore(_rebuild_prefix(gen, st, backend, own), root)
    try:
        old.delete_key(f"0/{backend.rank()}")
    except RuntimeError:  # a store without delete
        pass


def _fresh_backend(old: Any, store: Any, seconds: float, st: pgstate.GroupState) -> Any:
    """A new backend of ``old``'s kind (gloo, NCCL, or a third-party backend registered with
    ``torch.distributed.Backend.register_backend``) for the same rank and size.

    gloo gets what is left of recover()'s budget (``seconds``) as its timeout: it bounds the
    connections made here, and every op gets its own timeout from fastdist. An NCCL-like backend
    keeps the group's own timeout (:func:`_group_timeout`): its watchdog enforces that timeout on
    every op and aborts the communicator when it passes, after which the op in flight reads as
    completed with no error; a timeout shorter than fastdist's deadlines would let torch's
    watchdog act first."""
    inner = old.inner
    name = inner.name()
    td = datetime.timedelta(seconds=seconds) if not old.polled else _group_timeout(inner)
    fresh: Any
    try:
        if name == "gloo":
            fresh = dist.ProcessGroupGloo(store, old.rank(), old.size(), td)
        elif name == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = td
            fresh = dist.ProcessGroupNCCL(store, old.rank(), old.size(), opts)
        elif name.upper() in dist.Backend._plugins:  # a third-party backend: torch's own creator
            plugin = dist.Backend._plugins[name.upper()]
            if plugin.extended_api:
                raise st.recovery_error(
                    st.generation + 1, f"cannot rebuild a {name} backend (extended API) in place"
                )
            with joining.real_classes():  # (a joiner's stand-ins are still in place here)
                fresh = plugin.creator_fn(store, old.rank(), old.size(), td)
        else:
            raise st.recovery_error(st.generation + 1, f"cannot rebuild a {name} backend in place")
    except RuntimeError as exc:  # a member vanished while the connections were made
        raise st.recovery_error(
            st.generation + 1,
            f"rebuilding the connections failed: {str(exc).strip().splitlines()[0]}",
        ) from None
    try:
        fresh._set_sequence_number_for_group()
    except (RuntimeError, AttributeError):
        pass
    return fresh


def _group_timeout(inner: Any) -> datetime.timedelta:
    """The timeout the group was made with: the backend's own options (ProcessGroupNCCL's),
    else the one given to fastdist.init_process_group, else torch's default for the backend."""
    timeout = getattr(pgstate.backend_options(inner), "_timeout", None)
    if isinstance(timeout, datetime.timedelta):
        return timeout
    if isinstance(JOB.timeout, datetime.timedelta):
        return JOB.timeout
    nccl_default = getattr(dist.constants, "default_pg_nccl_timeout", None)
    return nccl_default if nccl_default is not None else dist.constants.default_pg_timeout


def rebuild_default(gen: int, rank: int, world_size: int) -> Any:
    """Replaces the default group with a new one of ``world_size`` ranks, this process as ``rank``,
    on the job's store under generation ``gen``'s prefix (the backend and timeout the job was
    started with); returns it."""
    # The dead group is held by fastdist (see _groups.hold), so dropping torch's references to
    # it here does not run its destructor, which could block on an op still in flight.
    dist.destroy_process_group()
    root = JOB.root
    store = dist.PrefixStore(keys.key(f"gen{gen}") + "/", root)
    kwargs = {} if JOB.timeout is None else {"timeout": JOB.timeout}
    dist.init_process_group(backend=JOB.backend, store=store, rank=rank, world_size=world_size, **kwargs)
    return dist.distributed_c10d._get_default_group()
