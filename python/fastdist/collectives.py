"""Timeout-bounded collectives: fastdist's own functions.

Each takes the same arguments as its ``torch.distributed`` namesake plus ``timeout=``, and either
returns what torch returns or raises :class:`CollectiveTimeoutError` by the deadline (the sooner
of ``timeout=`` and the innermost open scope). A function checks its arguments, then hands its
op to fastdist.ops.dispatch, which issues it on the group and waits: on a watched group the watched
backend enforces the deadline (and gives gloo a per-call timeout a little later, which frees
gloo's worker thread so that a dead group never holds a thread or blocks exit for long).

With ``async_op=True`` a function returns a :class:`Work` handle; its deadline was fixed when
the op was issued, and it is watched even if nobody waits on it.

Why one file of about 750 lines: one public function per torch collective, each with its own
signature, docstring and argument checks; what they share (issuing, waiting, the deadline) is
fastdist.ops's.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

from ._native import _core
from .deadlines import DeadlineScope, TimeoutLike, current_time, effective_deadline, fail_at
from .errors import CollectiveTimeoutError
from .groups import pgstate
from .ops import arguments, dispatch
from .ops.work import Work, backend_options, fail, wait_until

__all__ = [
    "Work",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "gather",
    "irecv",
    "isend",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
    "wait",
]

_monotonic = _core.monotonic


def _result(work: Any, async_op: bool) -> Work | None:
    return work if async_op else None


def wait(work: Any, timeout: TimeoutLike = None) -> Any:
    """Bounds any torch ``Work`` or ``torch.futures.Future`` (or a fastdist :class:`Work`) by a
    deadline: returns the future's value (``True`` for a ``Work``), or raises
    :class:`CollectiveTimeoutError` with ``op="wait"``. The group of a raw torch ``Work`` is
    unknown, so it is not marked dead."""
    start = current_time()
    deadline = effective_deadline(timeout, start)
    if getattr(work, "_fastdist_handle", False):  # a fastdist Work or fastdist.rpc.RpcFuture
        return work.wait(DeadlineScope(deadline))
    if type(work) is torch.futures.Future and work.done():
        return work.wait()  # nothing to wait for: no deadline to set
    if not (hasattr(work, "wait") and (hasattr(work, "get_future") or hasattr(work, "add_done_callback"))):
        raise TypeError(f"work must be a torch Work or torch.futures.Future, got {type(work).__name__}")
    finished, _token, has_future = wait_until(work, deadline)
    if finished:
        return work.wait() if has_future else True  # a Future: its value (or its error, raised)
    fail(
        CollectiveTimeoutError(
            op="wait",
            seq=None,
            rank=dist.get_rank() if dist.is_initialized() else -1,
            world_size=dist.get_world_size() if dist.is_initialized() else -1,
            group="?",
            timeout=deadline - start,
            elapsed=current_time() - start,
            missing_ranks=None,
            desynced=None,
            last_seen=None,
            cause=None,
        )
    )


def barrier(group: Any = None, *, timeout: TimeoutLike = None, raise_on_timeout: bool = True) -> bool:
    """Waits until every rank of ``group`` (default: the default group) called ``barrier``.

    Returns True once all arrived. At the deadline raises :class:`CollectiveTimeoutError` on
    every rank that waited, or returns False when ``raise_on_timeout=False``::

        if not fastdist.barrier(timeout=10, raise_on_timeout=False):
            ...  # someone is missing; the group is now aborted

    ``timeout``: seconds, a ``timedelta``, ``math.inf``, a :class:`RendezvousTimeout` or an open
    scope; ``None`` means :func:`get_default_timeout`. After a timeout the group is aborted and
    every later fastdist call on it raises :class:`GroupAbortedError` at once.
    """
    start = _monotonic()
    deadline = effective_deadline(timeout, start)
    if raise_on_timeout is not True and raise_on_timeout is not False:
        arguments.check_bool(raise_on_timeout, "raise_on_timeout")
    try:
        dispatch.run("barrier", group, start, deadline, _issue_barrier, (), BarrierOptions, str)
    except CollectiveTimeoutError:
        if raise_on_timeout:
            raise
        return False
    return True


def _issue_barrier(pg: Any, opts: Any) -> Any:
    return pg.barrier(opts)


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
    *,
    timeout: TimeoutLike = None,
) -> Work | None:
    """``torch.distributed.all_gather`` with a deadline: fills ``tensor_list`` (one tensor per
    rank, in rank order) with every rank's ``tensor``, or raises
    :class:`CollectiveTimeoutError` at the deadline.

    After a timeout the tensors in ``tensor_list`` may still be written by the backend until
    its own timeout fires, a little later (10% of the budget, 0.1 to 1 s); do not reuse them before that.
    """
    start = _monotonic()
    deadline = effective_deadline(timeout, start)
    if not isinstance(tensor_list, list):
        arguments.check_tensor_list(tensor_list, "tensor_list")
    if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
        arguments.check_tensor(tensor, "tensor")
    if async_op is not False:
        arguments.check_bool(async_op, "async_op")
    dtype = tensor.dtype
    for t in tensor_list:  # one pass: types (for the exact message), dtypes, layout
        if not isinstance(t, torch.Tensor):
            arguments.check_tensor_list(tensor_list, "tensor_list")
        if not t.is_contiguous():
            arguments.not_contiguous("tensor_list", t)
        if t.dtype != dtype:
            raise ValueError(f"tensor_list must hold tensors of tensor's dtype ({dtype}), got {t.dtype}")
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
        tensor_list = [torch.view_as_real(t) for t in tensor_list]

    work = dispatch.run(
        "all_gather",
        group,
        start,
        deadline,
        _issue_all_gather,
        (tensor_list, tensor),
        AllgatherOptions,
        _sig_all_gather,
        async_op,
    )
    return work if async_op else None


def _issue_all_gather(pg: Any, opts: Any, tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> Any:
    if len(tensor_list) != pg.size():
        raise ValueError(
            f"tensor_list must hold one tensor per rank of the group ({pg.size()}), got {len(tensor_list)}"
        )
    return pg.allgather([tensor_list], [tensor], opts)


def _sig_all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> str:
    return arguments.sig(tensor, tensor_list)


def all_reduce(
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    *,
    timeout: TimeoutLike = None,
) -> Work | None:
    """``torch.distributed.all_reduce`` with a deadline."""
    start = _monotonic()
    deadline = effective_deadline(timeout, start)
    if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
        arguments.check_tensor(tensor, "tensor")
    if async_op is not False:
        arguments.check_bool(async_op, "async_op")
    work = dispatch.run(
        "all_reduce",
        group,
        start,
        deadline,
        _issue_all_reduce,
        (tensor, op),
        AllreduceOptions,
        _sig_reducing,
        async_op,
        (("reduceOp", op),),
    )
    return work if async_op else None


def _issue_all_reduce(pg: Any, opts: Any, tensor: torch.Tensor, _op: Any) -> Any:
    return pg.allreduce([arguments.real(tensor)], opts)


def _sig_reducing(*args: Any) -> str:
    """The tensors, then the reduce op (the last argument)."""
    return f"{arguments.sig(*args[:-1])}, {args[-1]}"


def _with_root(group: Any, rank: int | None, name: str) -> tuple[Any, Any]:
    """The group resolved (``dispatch.run`` takes it as it is), and ``rank`` (a global rank, the
    argument ``name``) as a rank of it: None for a process outside the group, or no rank."""
    pg = pgstate.resolve(group)
    if pg is None or rank is None:
        return (dist.GroupMember.NON_GROUP_MEMBER if pg is None else pg), None
    return pg, arguments.group_rank(pg, rank, name)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    *,
    timeout: TimeoutLike = None,
) -> Work | None:
    """``torch.distributed.reduce`` with a deadline (``dst`` is a global rank)."""
    start = current_time()
    deadline = effective_deadline(timeout, start)
    arguments.check_tensor(tensor, "tensor")
    arguments.check_rank(dst, "dst")
    arguments.check_bool(async_op, "async_op")
    t = arguments.real(tensor)
    group, root = _with_root(group, dst, "dst")

    def issue(pg: Any, opts: Any) -> Any:
        opts = backend_options(
            ReduceOptions, deadline, current_time(), (("reduceOp", op), ("rootRank", root), ("rootTensor", 0))
        )
        return pg.reduce([t], opts)

    return _result(
        dispatch.run(
            "reduce",
            group,
            start,
            deadline,
            issue,
            (),
            None,
            lambda: f"{arguments.sig(tensor)}, dst={dst}, {op}",
            async_op,
        ),
        async_op,
    )


def broadcast(
    tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False, *, timeout: TimeoutLike = None
) -> Work | None:
    """``torch.distributed.broadcast`` with a deadline (``src`` is a global rank)."""
    start = current_time()
    deadline = effective_deadline(timeout, start)
    arguments.check_tensor(tensor, "tensor")
    arguments.check_rank(src, "src")
    arguments.check_bool(async_op, "async_op")
    t = arguments.real(tensor)
    group, root = _with_root(group, src, "src")

    def issue(pg: Any, opts: Any) -> Any:
        opts = backend_options(
            BroadcastOptions, deadline, current_time(), (("rootRank", root), ("rootTensor", 0))
        )
        return pg.broadcast([t], opts)

    return _result(
        dispatch.run(
            "broadcast",
            group,
            start,
            deadline,
            issue,
            (),
            None,
            lambda: f"{arguments.sig(tensor)}, src={src}",
            async_op,
        ),
        async_op,
    )


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
    *,
    timeout: TimeoutLike = None,
) -> Work | None:
    """``torch.distributed.all_gather_into_tensor`` with a deadline."""
    start = current_time()
    deadline = effective_deadline(timeout, start)
    arguments.check_tensor(output_tensor, "output_tensor")
    arguments.check_tensor(input_tensor, "input_tensor")
    arguments.check_bool(async_op, "async_op")
    return _result(
        dispatch.run(
            "all_gather_into_tensor",
            group,
            start,
            deadline,
            _issue_all_gather_into_tensor,
            (output_tensor, input_tensor),
            AllgatherOptions,
            arguments.sig,
            async_op,
        ),
        async_op,
    )


def _issue_all_gather_into_tensor(pg: Any, opts: Any, output: torch.Tensor, input: torch.Tensor) -> Any:
    return pg._allgather_base(arguments.real(output), arguments.real(input), opts)


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    *,
    timeout: TimeoutLike = None,
) -> Work | None:
    """``torch.distributed.reduce_scatter`` with a deadline."""
    start = current_time()
    deadline = effective_deadline(timeout, start)
    arguments.check_tensor(output, "output")
    arguments.check_tensor_list(input_list, "input_list")
    arguments.check_bool(async_op, "async_op")

    return _result(
        dispatch.run(
            "reduce_scatter",
            group,
            start,
            deadline,
            _issue_reduce_scatter,
            (output, input_list, op),
            ReduceScatterOptions,
            _sig_reducing,
            async_op,
            (("reduceOp", op),),
        ),
        async_op,
    )


def _issue_reduce_scatter(
    pg: Any, opts: Any, output: torch.Tensor, input_list: list[torch.Tensor], _op: Any
) -> Any:
    return pg.reduce_scatter([output], [input_list], opts)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    *,
    timeout: TimeoutLike = None,
) -> Work | None:
    """``torch.distributed.reduce_scatter_tensor`` with a deadline."""
    start = current_time()
    deadline = effective_deadline(timeout, start)
    arguments.check_tensor(output, "output")
    arguments.check_tensor(input, "input")
    arguments.check_bool(async_op, "async_op")

    return _result(
        dispatch.run(
            "reduce_scatter_tensor",
            group,
            start,
            deadline,
            _issue_reduce_scatter_tensor,
            (output, input, op),
            ReduceScatterOptions,
            _sig_reducing,
            async_op,
            (("reduceOp", op),),
        ),
        async_op,
    )


def _issue_reduce_scatter_tensor(
    pg: Any, opts: Any, output: torch.Tensor, input: torch.Tensor, _op: Any
) -> Any:
    return pg._reduce_scatter_base(output, input, opts)


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: Any = None,
    async_op: bool = False,
    *,
    timeout: TimeoutLike = None,
) -> Work | None:
    """``torch.distributed.gather`` with a deadline (``dst`` is a global rank; ``gather_list``
    only on ``dst``)."""
    return _rooted(
        "gather",
        GatherOptions,
        tensor,
        gather_list,
        dst,
        ("dst", "gather_list"),
        group,
        async_op,
        timeout,
        lambda pg, t, lst, opts: pg.gather(lst, [t], opts),
    )


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: Any = None,
    async_op: bool = False,
    *,
    timeout: TimeoutLike = None,
) -> Work | None:
    """``torch.distributed.scatter`` with a deadline (``src`` is a global rank;
    ``scatter_list`` only on ``src``)."""
    return _rooted(
        "scatter",
        ScatterOptions,
        tensor,
        scatter_list,
        src,
        ("src", "scatter_list"),
        group,
        async_op,
        timeout,
        lambda pg, t, lst, opts: pg.scatter([t], lst, opts),
    )


def _rooted(
    op: str,
    kind: type,
    tensor: torch.Tensor,
    tensors: list[torch.Tensor] | None,
    root: int,
    names: tuple[str, str],
    group: Any,
    async_op: bool,
    timeout: TimeoutLike,
    call: Callable[[Any, torch.Tensor, list[list[torch.Tensor]], Any], Any],
) -> Work | None:
    """gather and scatter: one tensor per rank in a list that only the root rank gives."""
    start = current_time()
    deadline = effective_deadline(timeout, start)
    root_name, list_name = names
    arguments.check_tensor(tensor, "tensor")
    arguments.check_rank(root, root_name)
    if tensors is not None:
        arguments.check_tensor_list(tensors, list_name)
    arguments.check_bool(async_op, "async_op")
    group, root_rank = _with_root(group, root, root_name)

    def issue(pg: Any, _opts: Any) -> Any:
        opts = backend_options(kind, deadline, current_time(), (("rootRank", root_rank),))
        if pg.rank() != root_rank:
            return call(pg, tensor, [], opts)
        if tensors is None or len(tensors) != pg.size():
            raise ValueError(
                f"{list_name} must hold one tensor per rank of the group ({pg.size()}) on {root_name}"
            )
        return call(pg, tensor, [tensors], opts)

    return _result(
        dispatch.run(
            op,
            group,
            start,
            deadline,
            issue,
            (),
            None,
            lambda: f"{arguments.sig(tensor)}, {root_name}={root}",
            async_op,
        ),
        async_op,
    )


def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: Any = None,
    async_op: bool = False,
    *,
    timeout: TimeoutLike = None,
) -> Work | None:
    """``torch.distributed.all_to_all`` with a deadline."""
    start = current_time()
    deadline = effective_deadline(timeout, start)
    arguments.check_tensor_list(output_tensor_list, "output_tensor_list")
    arguments.check_tensor_list(input_tensor_list, "input_tensor_list")
    arguments.check_bool(async_op, "async_op")

    return _result(
        dispatch.run(
            "all_to_all",
            group,
            start,
            deadline,
            _issue_all_to_all,
            (output_tensor_list, input_tensor_list),
            AllToAllOptions,
            arguments.sig,
            async_op,
        ),
        async_op,
    )


def _issue_all_to_all(pg: Any, opts: Any, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> Any:
    return pg.alltoall(outputs, inputs, opts)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Any = None,
    async_op: bool = False,
    *,
    timeout: TimeoutLike = None,
) -> Work | None:
    """``torch.distributed.all_to_all_single`` with a deadline."""
    start = current_time()
    deadline = effective_deadline(timeout, start)
    arguments.check_tensor(output, "output")
    arguments.check_tensor(input, "input")
    arguments.check_bool(async_op, "async_op")
    out_splits = list(output_split_sizes or [])
    in_splits = list(input_split_sizes or [])

    return _result(
        dispatch.run(
            "all_to_all_single",
            group,
            start,
            deadline,
            _issue_all_to_all_single,
            (output, input, out_splits, in_splits),
            AllToAllOptions,
            _sig_all_to_all_single,
            async_op,
        ),
        async_op,
    )


def _issue_all_to_all_single(
    pg: Any, opts: Any, output: torch.Tensor, input: torch.Tensor, out_splits: list[int], in_splits: list[int]
) -> Any:
    return pg.alltoall_base(arguments.real(output), arguments.real(input), out_splits, in_splits, opts)


def _sig_all_to_all_single(
    output: torch.Tensor, input: torch.Tensor, out_splits: list[int], in_splits: list[int]
) -> str:
    return f"{arguments.sig(output, input)}, {out_splits}, {in_splits}"


# ---------------------------------------------------------------------------------------------
# Point to point. gloo's send/recv take no per-call timeout and have no future: they are waited
# on with torch's own bounded wait, and a timed-out one leaves the group dead.


def _p2p(
    op: str,
    tensor: torch.Tensor,
    peer: int | None,
    group: Any,
    tag: int,
    timeout: TimeoutLike,
    async_op: bool,
) -> Any:
    start = current_time()
    deadline = effective_deadline(timeout, start)
    arguments.check_tensor(tensor, "tensor")
    name = "dst" if op in ("send", "isend") else "src"
    if peer is not None or name == "dst":
        arguments.check_rank(peer, name)
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise TypeError(f"tag must be an int, got {type(tag).__name__}: {tag!r}")
    t = arguments.real(tensor)
    sender: list[Any] = []
    group, peer_rank = _with_root(group, peer, name)

    def issue(pg: Any, _opts: Any) -> Any:
        if op in ("send", "isend"):
            assert peer_rank is not None  # checked above
            return pg.send([t], peer_rank, tag)
        if peer_rank is None:
            w = pg.recv_anysource([t], tag)
            sender.append(w)
            return w
        return pg.recv([t], peer_rank, tag)

    work = dispatch.run(
        op,
        group,
        start,
        deadline,
        issue,
        (),
        None,
        lambda: f"{arguments.sig(tensor)}, {name}={peer}, tag={tag}",
        async_op,
    )
    if async_op or work is None:
        return work
    if op == "recv":
        if sender:
            pg = pgstate.resolve(group)
            src_group_rank = sender[0]._source_rank()
            st = pgstate.state_of(pg)
            return st.global_rank(src_group_rank)
        return peer
    return None


def send(
    tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, *, timeout: TimeoutLike = None
) -> None:
    """``torch.distributed.send`` with a deadline."""
    _p2p("send", tensor, dst, group, tag, timeout, False)


def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Any = None,
    tag: int = 0,
    *,
    timeout: TimeoutLike = None,
) -> int:
    """``torch.distributed.recv`` with a deadline; returns the sender's rank."""
    return int(_p2p("recv", tensor, src, group, tag, timeout, False))


def isend(
    tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, *, timeout: TimeoutLike = None
) -> Work:
    """``torch.distributed.isend`` with a deadline; returns a :class:`Work`."""
    return _p2p("isend", tensor, dst, group, tag, timeout, True)  # type: ignore[no-any-return]


def irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Any = None,
    tag: int = 0,
    *,
    timeout: TimeoutLike = None,
) -> Work:
    """``torch.distributed.irecv`` with a deadline; returns a :class:`Work`."""
    return _p2p("irecv", tensor, src, group, tag, timeout, True)  # type: ignore[no-any-return]


def batch_isend_irecv(p2p_op_list: list[Any], *, timeout: TimeoutLike = None) -> list[Work]:
    """``torch.distributed.batch_isend_irecv`` with one deadline for the whole batch: takes
    ``torch.distributed.P2POp`` objects (whose ``op`` is ``isend``/``irecv`` from torch or
    fastdist) and returns :class:`Work` handles, as torch does: one for the whole batch where the
    backend coalesces it (NCCL: issued one at a time, a large symmetric exchange can deadlock),
    else one per op."""
    if not isinstance(p2p_op_list, list) or not all(isinstance(p, dist.P2POp) for p in p2p_op_list):
        raise TypeError("p2p_op_list must be a list of torch.distributed.P2POp")
    start = current_time()
    deadline = effective_deadline(timeout, start)
    scope = DeadlineScope(deadline)
    names = []
    for p in p2p_op_list:
        fn = getattr(p.op, "__name__", "")
        if fn not in ("isend", "irecv"):
            raise ValueError(f"P2POp.op must be isend or irecv, got {p.op!r}")
        names.append(fn)
    groups = [pgstate.resolve(p.group) for p in p2p_op_list]
    if groups and all(g is not None and pgstate.state_of(g).watched is not None for g in groups):
        # Watched groups: torch's own batch (coalesced where the backend coalesces), every op of it
        # bounded by the scope's deadline in the watched backend.
        batch = [
            dist.P2POp(
                dist.isend if fn == "isend" else dist.irecv,
                p.tensor,
                p.peer,
                p.group,
                p.tag,
                **({} if p.peer is not None else {"group_peer": p.group_peer}),
            )
            for fn, p in zip(names, p2p_op_list)
        ]
        with fail_at(deadline):
            issued = dist.batch_isend_irecv(batch)
        return [dispatch.WatchedHandle("batch_isend_irecv", w, deadline) for w in issued]
    works: list[Work] = []
    for fn, p in zip(names, p2p_op_list):
        peer = getattr(p, "group_peer", None) if getattr(p, "peer", None) is None else p.peer
        works.append(_p2p(fn, p.tensor, peer, p.group, p.tag, scope, True))
    return works
