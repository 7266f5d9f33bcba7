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
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..deadlines import fail_at

# A chunk on the wire: large enough that per-op costs vanish, small enough that a joiner that
# dies mid-transfer is noticed within one chunk's time.
CHUNK_BYTES = 64 << 20
# Tensors up to this size are packed into one buffer (one op for many); larger ones go as they are,
# without a copy, into the joiner's own tensor where it has one of that shape.
PACK_BYTES = 1 << 20
_ALIGN = 16


class _Slot:
    """Where a tensor of a state_dict travels: ``offset`` in the packed buffer, or the ``direct``
    tensor's index (-1: packed)."""

    __slots__ = ("direct", "dtype", "nbytes", "offset", "shape")

    def __init__(
        self, offset: int, direct: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> None:
        self.offset, self.direct, self.nbytes, self.dtype, self.shape = offset, direct, nbytes, dtype, shape

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.offset, self.direct, self.nbytes, self.dtype, self.shape)

    def __setstate__(self, s: tuple[Any, ...]) -> None:
        self.offset, self.direct, self.nbytes, self.dtype, self.shape = s


class _Packing:
    """What _pack collects: the packed tensors with their offsets, the direct ones."""

    def __init__(self) -> None:
        self.packed: list[tuple[int, torch.Tensor]] = []
        self.direct: list[torch.Tensor] = []
        self.size = 0


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
    tensor_module = sys.modules.get("torch.distributed.tensor")
    if tensor_module is None:  # never imported: no DTensor exists (and importing it costs 0.1 s)
        return []
    DTensor = tensor_module.DTensor
    out = []
    for key, obj in state.items():
        if any(isinstance(t, DTensor) for t in _leaves(obj.state_dict(), torch.Tensor)):
            out.append(key)
    return out


def _leaves(value: Any, kind: type) -> list[Any]:
    """Every ``kind`` in a state_dict-like tree of dicts, lists and tuples."""
    if isinstance(value, kind):
        return [value]
    children = (
        value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else ()
    )
    return [leaf for v in children for leaf in _leaves(v, kind)]


def _pack(value: Any, into: _Packing) -> Any:
    """``value`` with every tensor replaced by its _Slot, the tensor recorded in ``into``."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        nbytes = t.numel() * t.element_size()
        if nbytes > PACK_BYTES:
            into.direct.append(t.contiguous())
            return _Slot(-1, len(into.direct) - 1, nbytes, t.dtype, tuple(t.shape))
        slot = _Slot(into.size, -1, nbytes, t.dtype, tuple(t.shape))
        into.packed.append((into.size, t))
        into.size += -(-nbytes // _ALIGN) * _ALIGN
        return slot
    if isinstance(value, Mapping):
        return _like(value, ((k, _pack(v, into)) for k, v in value.items()))
    if isinstance(value, list):
        return [_pack(v, into) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_pack(v, into) for v in value)
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


def _targets(skeleton: Any, own: Any, out: dict[int, torch.Tensor]) -> None:
    """For each direct slot of ``skeleton``, the joiner's own tensor at the same place in its
    state_dict when it has the slot's shape and dtype and is contiguous: received into, it is
    loaded without a copy (load_state_dict's copy onto itself is a no-op)."""
    if isinstance(skeleton, _Slot):
        if (
            skeleton.direct >= 0
            and isinstance(own, torch.Tensor)
            and tuple(own.shape) == skeleton.shape
            and own.dtype == skeleton.dtype
            and own.is_contiguous()
        ):
            out[skeleton.direct] = own.detach()
    elif isinstance(skeleton, Mapping) and isinstance(own, Mapping):
        for k, v in skeleton.items():
            if k in own:
                _targets(v, own[k], out)
    elif isinstance(skeleton, (list, tuple)) and isinstance(own, (list, tuple)) and len(own) == len(skeleton):
        for v, o in zip(skeleton, own):
            _targets(v, o, out)


def _unpack(value: Any, buf: torch.Tensor, direct: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, _Slot):
        if value.direct >= 0:
            return direct[value.direct]
        if not value.nbytes:
            return torch.empty(value.shape, dtype=value.dtype, device=buf.device)
        return buf.narrow(0, value.offset, value.nbytes).view(value.dtype).view(value.shape)
    if isinstance(value, Mapping):
        return _like(value, ((k, _unpack(v, buf, direct)) for k, v in value.items()))
    if isinstance(value, list):
        return [_unpack(v, buf, direct) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_unpack(v, buf, direct) for v in value)
    return value


def _chunks(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` (contiguous) as flat byte views of at most CHUNK_BYTES."""
    flat = t.view(-1).view(torch.uint8) if t.numel() else t.view(-1)
    return [
        flat.narrow(0, i, min(CHUNK_BYTES, flat.numel() - i)) for i in range(0, flat.numel(), CHUNK_BYTES)
    ]


def _now(issue: Callable[[], Any]) -> Any:
    return issue()


def device_of(group: Any) -> torch.device:
    """The device ``group``'s state travels on: this process's current CUDA device on an NCCL group,
    else the CPU."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else torch.device("cpu")
    )


class Packed:
    """State dicts ready for the wire: the header's length, the header (the structure, pickled,
    with each tensor's place), then the packed buffer and the large tensors, in chunks."""

    def __init__(self, dicts: Mapping[str, Any] | None, device: torch.device) -> None:
        packing = _Packing()
        skeleton = None if dicts is None else {k: _pack(v, packing) for k, v in dicts.items()}
        header = pickle.dumps((skeleton, packing.size), protocol=pickle.HIGHEST_PROTOCOL)
        buf = torch.zeros(packing.size, dtype=torch.uint8, device=device)
        for off, t in packing.packed:
            n = t.numel() * t.element_size()
            if n:
                buf.narrow(0, off, n).copy_(t.reshape(-1).view(torch.uint8))
        self.meta = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
        self.size = torch.tensor([self.meta.numel()], dtype=torch.int64, device=device)
        self.wire = [c for t in (buf, *packing.direct) for c in _chunks(t)]
        self.nbytes = packing.size + sum(t.numel() * t.element_size() for t in packing.direct)

    def send(self, dst: int, group: Any) -> None:
        """Sends every piece to ``dst`` (a global rank) on ``group``, one blocking send each: the
        header's length, the header, then the chunks."""
        for t in (self.size, self.meta, *self.wire):
            dist.send(t, dst, group=group)

    def isend(self, dst: int, group: Any, post: Callable[[Any], Any] = _now) -> list[Any]:
        """The same as :meth:`send`, each piece posted at once: the works to wait on. ``post``
        issues each (a gate may refuse it)."""
        return [post(lambda t=t: dist.isend(t, dst, group=group)) for t in (self.size, self.meta, *self.wire)]


def send(state: Mapping[str, Any] | None, joiners: list[int], group: Any, deadline: float) -> int:
    """Sends ``state`` (or word that there is none) to each of ``joiners`` (global ranks); every
    op bounded by ``deadline``. Returns the bytes sent to each."""
    return send_dicts(
        None if state is None else {k: v.state_dict() for k, v in state.items()}, joiners, group, deadline
    )


def send_dicts(dicts: Mapping[str, Any] | None, joiners: list[int], group: Any, deadline: float) -> int:
    """:func:`send` of state dicts already made (a snapshot's)."""
    packed = Packed(dicts, device_of(group))
    with fail_at(deadline):
        for j in joiners:
            packed.send(j, group)
    return packed.nbytes


def receive(
    source: int,
    group: Any,
    deadline: float,
    into: Mapping[str, Any] | None = None,
    post: Callable[[Any], Any] = _now,
) -> dict[str, Any] | None:
    """The state dicts sent by ``source`` (None: the sender had no state to give). Large tensors
    land in ``into``'s own (a dict of Statefuls) where they match, else in new ones. ``post``
    issues each receive (a gate may refuse it)."""
    device = device_of(group)

    def recv(t: torch.Tensor) -> None:
        post(lambda: dist.irecv(t, source, group=group)).wait()

    with fail_at(deadline):
        size = torch.zeros(1, dtype=torch.int64, device=device)
        recv(size)
        meta = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        recv(meta)
        skeleton, total = pickle.load(io.BytesIO(meta.cpu().numpy().tobytes()))
        slots = [s for s in _leaves(skeleton, _Slot) if s.direct >= 0]
        own: dict[int, torch.Tensor] = {}
        if skeleton is not None and into is not None:
            for key, obj in into.items():
                if key in skeleton:
                    _targets(skeleton[key], obj.state_dict(), own)
        direct = {
            s.direct: own.get(s.direct, torch.empty(s.shape, dtype=s.dtype, device=device)) for s in slots
        }
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        for t in (buf, *(direct[s.direct] for s in sorted(slots, key=lambda s: s.direct))):
            for chunk in _chunks(t):
                recv(chunk)
    if skeleton is None:
        return None
    return {k: _unpack(v, buf, direct) for k, v in skeleton.items()}
