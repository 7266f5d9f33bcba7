"""Timeout-bounded collectives of picklable Python objects.

Each one is built from fastdist's tensor collectives (a round for the sizes, one for the data),
all sharing the call's one deadline. Unlike torch's versions they need no numpy. As in torch,
unpickling runs arbitrary code: use them only among ranks you trust.
"""

from __future__ import annotations

import ctypes
import pickle
from typing import Any

import torch

from .collectives import all_gather, broadcast, gather, scatter
from .deadlines import DeadlineScope, TimeoutLike, current_time, effective_deadline
from .groups import pgstate
from .ops.arguments import check_rank as _check_rank

__all__ = ["all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"]


def _to_bytes_tensor(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _from_bytes_tensor(t: torch.Tensor, size: int) -> Any:
    t = t.contiguous()
    return pickle.loads(ctypes.string_at(t.data_ptr(), size))


def _padded(data: torch.Tensor, size: int) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8)
    out[: data.numel()] = data
    return out


def _check_list(value: object, name: str) -> None:
    if not isinstance(value, list):
        raise TypeError(f"{name} must be a list, got {type(value).__name__}")


def _scope(timeout: TimeoutLike) -> DeadlineScope:
    return DeadlineScope(effective_deadline(timeout, current_time()))


def all_gather_object(
    object_list: list[Any], obj: Any, group: Any = None, *, timeout: TimeoutLike = None
) -> None:
    """``torch.distributed.all_gather_object`` with one deadline for the whole exchange:
    ``object_list[i]`` becomes rank i's ``obj``."""
    scope = _scope(timeout)
    _check_list(object_list, "object_list")
    pg = pgstate.resolve(group)
    if pg is None:
        return
    ws = pg.size()
    if len(object_list) != ws:
        raise ValueError(
            f"object_list must have one slot per rank of the group ({ws}), got {len(object_list)}"
        )
    data = _to_bytes_tensor(obj)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(ws)]
    all_gather(sizes, torch.tensor([data.numel()], dtype=torch.long), group, timeout=scope)
    longest = max(int(s.item()) for s in sizes)
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(ws)]
    all_gather(out, _padded(data, longest), group, timeout=scope)
    for i in range(ws):
        object_list[i] = _from_bytes_tensor(out[i], int(sizes[i].item()))


def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int = 0,
    group: Any = None,
    *,
    timeout: TimeoutLike = None,
) -> None:
    """``torch.distributed.gather_object`` with one deadline: on ``dst`` (a global rank),
    ``object_gather_list[i]`` becomes rank i's ``obj``."""
    scope = _scope(timeout)
    _check_rank(dst, "dst")
    if object_gather_list is not None:
        _check_list(object_gather_list, "object_gather_list")
    pg = pgstate.resolve(group)
    if pg is None:
        return
    ws = pg.size()
    st = pgstate.state_of(pg)
    is_dst = st.my_global_rank == dst
    if is_dst and (object_gather_list is None or len(object_gather_list) != ws):
        raise ValueError(f"object_gather_list must have one slot per rank of the group ({ws}) on dst")
    data = _to_bytes_tensor(obj)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(ws)]
    all_gather(sizes, torch.tensor([data.numel()], dtype=torch.long), group, timeout=scope)
    longest = max(int(s.item()) for s in sizes)
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(ws)] if is_dst else None
    gather(_padded(data, longest), out, dst, group, timeout=scope)
    if is_dst:
        assert out is not None and object_gather_list is not None
        for i in range(ws):
            object_gather_list[i] = _from_bytes_tensor(out[i], int(sizes[i].item()))


def broadcast_object_list(
    object_list: list[Any], src: int = 0, group: Any = None, *, timeout: TimeoutLike = None
) -> None:
    """``torch.distributed.broadcast_object_list`` with one deadline: every rank's
    ``object_list`` (of the same length everywhere) becomes ``src``'s."""
    scope = _scope(timeout)
    _check_list(object_list, "object_list")
    _check_rank(src, "src")
    pg = pgstate.resolve(group)
    if pg is None:
        return
    is_src = pgstate.state_of(pg).my_global_rank == src
    if is_src:
        parts = [_to_bytes_tensor(o) for o in object_list]
        sizes = torch.tensor([p.numel() for p in parts], dtype=torch.long)
    else:
        sizes = torch.zeros(len(object_list), dtype=torch.long)
    broadcast(sizes, src, group, timeout=scope)
    total = int(sizes.sum().item())
    data = torch.cat(parts) if is_src and parts else torch.empty(total, dtype=torch.uint8)
    broadcast(data, src, group, timeout=scope)
    if not is_src:
        offset = 0
        for i, n in enumerate(sizes.tolist()):
            object_list[i] = _from_bytes_tensor(data[offset : offset + n], n)
            offset += n


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int = 0,
    group: Any = None,
    *,
    timeout: TimeoutLike = None,
) -> None:
    """``torch.distributed.scatter_object_list`` with one deadline: rank i's
    ``scatter_object_output_list[0]`` becomes ``scatter_object_input_list[i]`` of ``src``."""
    scope = _scope(timeout)
    _check_list(scatter_object_output_list, "scatter_object_output_list")
    if len(scatter_object_output_list) < 1:
        raise ValueError("scatter_object_output_list must have at least one slot")
    _check_rank(src, "src")
    pg = pgstate.resolve(group)
    if pg is None:
        return
    ws = pg.size()
    is_src = pgstate.state_of(pg).my_global_rank == src
    if is_src:
        if scatter_object_input_list is None or len(scatter_object_input_list) != ws:
            raise ValueError(
                f"scatter_object_input_list must hold one object per rank of the group ({ws}) on src"
            )
        parts = [_to_bytes_tensor(o) for o in scatter_object_input_list]
        longest = torch.tensor([max(p.numel() for p in parts)], dtype=torch.long)
    else:
        longest = torch.zeros(1, dtype=torch.long)
    broadcast(longest, src, group, timeout=scope)
    n = int(longest.item())
    my_size = torch.zeros(1, dtype=torch.long)
    scatter(
        my_size,
        [torch.tensor([p.numel()], dtype=torch.long) for p in parts] if is_src else None,
        src,
        group,
        timeout=scope,
    )
    mine = torch.empty(n, dtype=torch.uint8)
    scatter(mine, [_padded(p, n) for p in parts] if is_src else None, src, group, timeout=scope)
    scatter_object_output_list[0] = _from_bytes_tensor(mine, int(my_size.item()))
