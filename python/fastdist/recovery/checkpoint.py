"""Checkpoints on disk, for what memory cannot recover: ``fastdist.save_checkpoint`` and
``fastdist.load_checkpoint``, torch.distributed.checkpoint (DCP) on the same ``state`` that
``recover(state=)`` and :class:`fastdist.PeerSnapshot` take.

A rank and every holder of its snapshot copies dying together leaves no copy in memory
(``recover()`` raises RecoveryError saying so): the job restarts and loads the last checkpoint.
DCP saves each rank's own shards (FSDP2's DTensors) and reshards on load. A model and an optimizer
in ``state`` are saved through torch's ``get_state_dict`` family (fully qualified names, not the
optimizer's parameter ids), so the checkpoint loads into a model built afresh.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..deadlines import TimeoutLike, current_time, effective_deadline, fail_at
from . import state_sync


class _Model:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, sd)


class _Optimizer:
    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.opt)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.opt, sd)


def _statefuls(state: Any) -> dict[str, Any]:
    state = state_sync.check_state(state)
    modules = [v for v in state.values() if isinstance(v, torch.nn.Module)]
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.optim.Optimizer):
            if len(modules) != 1:
                raise ValueError(
                    f"state[{key!r}] is an optimizer and state holds {len(modules)} modules: a checkpoint "
                    "names an optimizer's state by its model's parameters, so state must hold exactly one "
                    "model (or wrap models and optimizers in a Stateful of your own)"
                )
            out[key] = _Optimizer(modules[0], value)
        elif isinstance(value, torch.nn.Module):
            out[key] = _Model(value)
        else:
            out[key] = value
    return out


def _path(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}: {path!r}")
    return os.fspath(path)


def save_checkpoint(state: Any, path: str | os.PathLike[str], *, timeout: TimeoutLike = None) -> None:
    """Saves ``state`` (a dict of Statefuls) to the directory ``path`` with
    torch.distributed.checkpoint: every rank calls it, and writes its own shards. ``timeout``
    bounds it (default: the enclosing deadline scope, else the default timeout)."""
    import torch.distributed.checkpoint as dcp

    statefuls, where = _statefuls(state), _path(path)
    with fail_at(effective_deadline(timeout, current_time())):
        dcp.save(statefuls, checkpoint_id=where)


def load_checkpoint(state: Any, path: str | os.PathLike[str], *, timeout: TimeoutLike = None) -> None:
    """Loads the checkpoint that :func:`save_checkpoint` wrote to ``path`` into ``state`` (in
    place; the model and optimizer built as on a first start): every rank calls it. The
    fallback when a dead rank's shards are nowhere in memory::

        snap = fastdist.PeerSnapshot(state, every=10)           # in memory, every 10 steps
        if os.path.exists(ckpt):
            fastdist.load_checkpoint(state, ckpt)               # a restart: the last one on disk
        ...
        if progress.step % 500 == 0:
            fastdist.save_checkpoint(state, ckpt)               # on disk, every 500 steps
    """
    import torch.distributed.checkpoint as dcp

    statefuls, where = _statefuls(state), _path(path)
    if not os.path.exists(os.path.join(where, ".metadata")):
        raise FileNotFoundError(
            f"no checkpoint at {where!r} (it has no .metadata: save_checkpoint writes one)"
        )
    with fail_at(effective_deadline(timeout, current_time())):
        dcp.load(statefuls, checkpoint_id=where)
