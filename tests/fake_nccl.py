"""The CPU double of ProcessGroupNCCL (``fastdist._watched.NcclDouble``, csrc/watched/nccl_double.h),
registered through torch's public third-party backend API. It follows ProcessGroupNCCL's contract
as torch's own source states it (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, 2.11 and 2.13):
``WorkNCCL::isSuccess()`` raises; a synchronous op (``async_op=False``) runs on the caller's
current stream and hands back no work; a work's future completes at enqueue; ``wait()`` only
orders streams (returns at once); completion only through ``is_completed()`` (the end event's
query); an aborted communicator's ops read as completed with no error. A group made on it is a
watched group and takes the C++ path real NCCL takes (WatchedBackend, polled).

The data moves through a gloo backend underneath, asynchronously to the host as on a GPU (after
``wait()`` returns, the tensor may not hold the result yet): values are real, so DDP and FSDP2
train on it and their models can be compared with an undisturbed run. ``configure(delay=)``: each
op counts as run ``delay`` seconds after gloo finished it and the ops before it ran
(``math.inf``: never, like a kernel behind a peer that never comes), unless the communicator is
aborted first; ``abort_hangs`` makes ``abort()`` itself hang, like a stuck ncclCommAbort. NCCL
itself is for tests/gpu on a GPU.
"""

from __future__ import annotations

import torch.distributed as dist
from fastdist._native import _watched

NcclDouble = _watched.NcclDouble
NAME: str = NcclDouble.NAME


def configure(delay: float = 0.0, abort_hangs: bool = False) -> None:
    """How long each op runs once it can (seconds; ``math.inf``: never), and whether abort hangs."""
    NcclDouble.configure(delay=delay, abort_hangs=abort_hangs)


def aborts() -> int:
    """How many times a communicator of the double was aborted in this process."""
    return int(NcclDouble.aborts())


def make(store, rank: int, world_size: int, timeout) -> NcclDouble:
    """A double over a gloo backend on ``store`` (torch's ProcessGroupGloo as torch.distributed
    resolves it: a joining rank's stand-in while fastdist makes its groups locally)."""
    return NcclDouble(dist.distributed_c10d.ProcessGroupGloo(store, rank, world_size, timeout))


def _create(store, rank, world_size, timeout):
    return make(store, rank, world_size, timeout)


def register() -> None:
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, devices=["cpu"])
