"""Handing a live rank's training state to a rank that joined the job (a replacement or a spare).

``state`` is what ``torch.distributed.checkpoint`` takes: a dict of objects with ``state_dict()``
and ``load_state_dict()`` (a model, an optimizer, the user's step counter). The sender packs every
tensor of every ``state_dict()`` into one byte buffer (each tensor 16-byte aligned) and sends it
over the group in chunks, after a header: the pickled structure with the tensors' places. The
store carries nothing of it. Sharded state (FSDP2's DTensors) cannot be handed over: the dead
rank's shards exist nowhere else, and both sides say so.
"""

from __future__ import annotations

import collections
import io
import pickle
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ._timeouts import fail_at

# A chunk of the byte stream: large enough that per-op costs vanish, small enough that a joiner
# that dies mid-transfer is noticed within one chunk's time.
CHUNK_BYTES = 64 << 20
_ALIGN = 16


class _Slot:
    """Where a tensor stood in a state_dict: its place in the byte buffer."""

    __slots__ = ("dtype", "nbytes", "offset", "shape")

    def __init__(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.offset, self.nbytes, self.dtype, self.shape = offset, nbytes, dtype, shape

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.offset, self.nbytes, self.dtype, self.shape)

    def __setstate__(self, s: tuple[Any, ...]) -> None:
        self.offset, self.nbytes, self.dtype, self.shape = s


def check_state(state: Any, name: str = "state") -> dict[str, Any]:
    """``state`` as a dict of Statefuls, or TypeError naming what is wrong."""
    if not isinstance(state, Mapping):
        raise TypeError(
            f"{name} must be a dict of objects with state_dict()/load_state_dict(), got {state!r}"
        )
    for key, obj in state.items():
        if not isinstance(key, str):
            raise TypeError(f"{name}'s keys must be str, got {key!r}")
        if not (
            callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
        ):
            raise TypeError(
                f"{name}[{key!r}] must have state_dict() and load_state_dict() "
                f"(torch.distributed.checkpoint's Stateful), got {type(obj).__name__}"
            )
    return dict(state)


def sharded_entries(state: Mapping[str, Any]) -> list[str]:
    """The keys of ``state`` whose state_dict holds a DTensor (FSDP2's shards, or state derived
    from them): a rank's part of those lives only on that rank."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return []
    out = []
    for key, obj in state.items():
        tensors: list[torch.Tensor] = []
        _walk(obj.state_dict(), tensors.append)
        if any(isinstance(t, DTensor) for t in tensors):
            out.append(key)
    return out


def _walk(value: Any, visit: Any) -> None:
    if isinstance(value, torch.Tensor):
        visit(value)
    elif isinstance(value, Mapping):
        for v in value.values():
            _walk(v, visit)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _walk(v, visit)


def _pack(value: Any, tensors: list[torch.Tensor], offset: list[int]) -> Any:
    """``value`` with every tensor replaced by its _Slot; the tensors appended to ``tensors``."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        nbytes = t.numel() * t.element_size()
        slot = _Slot(offset[0], nbytes, t.dtype, tuple(t.shape))
        offset[0] += -(-nbytes // _ALIGN) * _ALIGN
        tensors.append(t)
        return slot
    if isinstance(value, Mapping):
        return _like(value, ((k, _pack(v, tensors, offset)) for k, v in value.items()))
    if isinstance(value, list):
        return [_pack(v, tensors, offset) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_pack(v, tensors, offset) for v in value)
    return value


def _like(original: Mapping[str, Any], items: Any) -> Any:
    """A dict (an OrderedDict for one) of ``items``, keeping a module state_dict's ``_metadata``
    (the versions load_state_dict reads)."""
    out: Any = (
        collections.OrderedDict(items) if isinstance(original, collections.OrderedDict) else dict(items)
    )
    metadata = getattr(original, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata
    return out


def _unpack(value: Any, buf: torch.Tensor) -> Any:
    if isinstance(value, _Slot):
        raw = buf.narrow(0, value.offset, value.nbytes)
        return (
            raw.view(value.dtype).view(value.shape).clone()
            if value.nbytes
            else torch.empty(value.shape, dtype=value.dtype, device=buf.device)
        )
    if isinstance(value, Mapping):
        return _like(value, ((k, _unpack(v, buf)) for k, v in value.items()))
    if isinstance(value, list):
        return [_unpack(v, buf) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_unpack(v, buf) for v in value)
    return value


def _device_of(group: Any) -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else torch.device("cpu")
    )


def send(state: Mapping[str, Any] | None, joiners: list[int], group: Any, deadline: float) -> int:
    """Sends ``state`` (or word that there is none) to each of ``joiners`` (global ranks); every
    op bounded by ``deadline``. Returns the bytes sent to each."""
    device = _device_of(group)
    tensors: list[torch.Tensor] = []
    total = [0]
    skeleton = None if state is None else {k: _pack(v.state_dict(), tensors, total) for k, v in state.items()}
    header = pickle.dumps((skeleton, total[0]), protocol=pickle.HIGHEST_PROTOCOL)
    buf = torch.zeros(total[0], dtype=torch.uint8, device=device)
    off = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if n:
            buf.narrow(0, off, n).copy_(t.reshape(-1).view(torch.uint8))
        off += -(-n // _ALIGN) * _ALIGN
    meta = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
    with fail_at(deadline):
        for j in joiners:
            dist.send(torch.tensor([meta.numel()], dtype=torch.int64, device=device), j, group=group)
            dist.send(meta, j, group=group)
            for start in range(0, total[0], CHUNK_BYTES):
                dist.send(buf.narrow(0, start, min(CHUNK_BYTES, total[0] - start)), j, group=group)
    return total[0]


def receive(source: int, group: Any, deadline: float) -> dict[str, Any] | None:
    """The state dicts sent by ``source`` (None: the sender had no state to give)."""
    device = _device_of(group)
    with fail_at(deadline):
        size = torch.zeros(1, dtype=torch.int64, device=device)
        dist.recv(size, source, group=group)
        meta = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        dist.recv(meta, source, group=group)
        skeleton, total = pickle.load(io.BytesIO(meta.cpu().numpy().tobytes()))
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        for start in range(0, total, CHUNK_BYTES):
            dist.recv(buf.narrow(0, start, min(CHUNK_BYTES, total - start)), source, group=group)
    if skeleton is None:
        return None
    return {k: _unpack(v, buf) for k, v in skeleton.items()}
