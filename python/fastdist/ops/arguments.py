"""Argument checks at the API edge: a wrong argument is a ``TypeError`` or ``ValueError`` naming
it, raised before anything is issued (no sequence number taken, nothing half done)."""

from __future__ import annotations

from typing import Any, NoReturn

import torch
import torch.distributed as dist


def check_bool(value: object, name: str) -> None:
    """Raises TypeError naming ``name`` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}: {value!r}")


def check_tensor(value: object, name: str) -> None:
    """Raises TypeError naming ``name`` unless ``value`` is a torch.Tensor, ValueError unless it is
    contiguous."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_contiguous():
        not_contiguous(name, value)


def not_contiguous(name: str, value: torch.Tensor) -> NoReturn:
    """Raises ValueError: the tensor ``value``, the argument ``name``, is not contiguous (gloo would
    silently use the wrong elements)."""
    # gloo reads and writes the tensor's storage as if it were contiguous: the result would be
    # silently wrong (torch does not check either).
    raise ValueError(
        f"{name} must be contiguous (gloo would silently use the wrong elements); got a tensor with "
        f"shape {list(value.shape)} and strides {list(value.stride())}: pass {name}.contiguous()"
    )


def check_tensor_list(value: object, name: str) -> None:
    """Raises TypeError naming ``name`` unless ``value`` is a list of torch.Tensor, ValueError
    unless each is contiguous."""
    if not isinstance(value, list) or not all(isinstance(t, torch.Tensor) for t in value):
        raise TypeError(f"{name} must be a list of torch.Tensor, got {type(value).__name__}")
    for t in value:
        if not t.is_contiguous():
            not_contiguous(name, t)


def check_rank(value: object, name: str) -> None:
    """Raises ValueError naming ``name`` unless ``value`` is a non-negative int (a rank; not a
    bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int rank, got {value!r}")


def sig(*tensors: Any) -> str:
    """The arguments as text, for the cross-rank checks: a tensor as its dtype and shape
    (``float32[4, 2]``), a list in brackets, anything else as its repr."""
    parts = []
    for t in tensors:
        if isinstance(t, list):
            parts.append("[" + ", ".join(sig(x) for x in t) + "]")
        elif isinstance(t, torch.Tensor):
            parts.append(f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}")
        else:
            parts.append(repr(t))
    return ", ".join(parts)


def group_rank(pg: Any, global_rank: int, name: str) -> int:
    """``global_rank`` (the argument ``name``) as a rank of ``pg``: the same number on the default
    group (or a backend that is not a ProcessGroup). Raises ValueError when it is not a rank of the
    group."""
    if not isinstance(pg, dist.ProcessGroup) or pg is dist.distributed_c10d._get_default_group():
        if global_rank >= pg.size():
            raise ValueError(f"{name}={global_rank} is not a rank of the group (size {pg.size()})")
        return global_rank
    try:
        return dist.get_group_rank(pg, global_rank)
    except (ValueError, RuntimeError):
        raise ValueError(f"{name}={global_rank} is not a rank of the group") from None


def real(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a real tensor for the backend: a complex one viewed as real
    (``torch.view_as_real``), any other as it is."""
    return torch.view_as_real(t) if t.is_complex() else t
