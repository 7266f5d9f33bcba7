"""The CPU double of ProcessGroupNCCL (tests/support/doubles/nccl_double.h), built here with torch's
cpp_extension against the torch installed (never part of fastdist's wheel) and registered through
torch's public third-party backend API. It follows ProcessGroupNCCL's contract and its failure
behaviour as torch's own source states them (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, 2.11
to 2.14): ``WorkNCCL::isSuccess()`` raises; a synchronous op (``async_op=False``) runs on the
caller's current stream and hands back no work; a work's future completes at enqueue; ``wait()``
only orders streams (returns at once); completion only through ``is_completed()`` (the end event's
query); an aborted communicator's ops read as completed with no error; a watchdog of its own
enforces the group's timeout on its *copies* of the works, sets the backend's ``getError()``,
aborts the communicator and then sleeps out a dump holding the list's lock; the destructor joins
that watchdog. A group made on it is a watched group and takes the C++ path real NCCL takes
(WatchedBackend, polled), through fastdist's interface for an NCCL-like backend
(``_fastdist_stream_marker``), which no product code names.

The data moves through a gloo backend underneath, asynchronously to the host as on a GPU (after
``wait()`` returns, the tensor may not hold the result yet): values are real, so DDP and FSDP2
train on it and their models can be compared with an undisturbed run. ``configure(delay=)``: each
op counts as run ``delay`` seconds after gloo finished it and the ops before it ran
(``math.inf``: never, like a kernel behind a peer that never comes), unless the communicator is
aborted first; ``abort_hangs`` makes ``abort()`` itself hang, like a stuck ncclCommAbort;
``dump_sleep`` is the watchdog's sleep after a failed op (torch: 4 x 15 s). NCCL itself is for
tests/gpu on a GPU.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

_HERE = Path(__file__).resolve().parent


def _build():  # type: ignore[no-untyped-def]
    from torch.utils import cpp_extension

    build = _HERE.parents[1] / "build" / "test-doubles" / f"torch-{torch.__version__}"
    build.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name="fastdist_test_doubles",
        sources=[str(_HERE / "doubles" / "nccl_double.cpp"), str(_HERE / "doubles" / "module.cpp")],
        extra_include_paths=[str(_HERE.parents[1] / "csrc")],
        extra_cflags=["-O0", "-w"],  # test code: compiled fast, not run fast
        build_directory=str(build),
        verbose=os.environ.get("FASTDIST_VERBOSE_BUILD") == "1",
    )


_doubles = _build()
NcclDouble = _doubles.NcclDouble
NAME: str = NcclDouble.NAME
has_error = _doubles.has_error


def configure(delay: float = 0.0, abort_hangs: bool = False, dump_sleep: float = 60.0) -> None:
    """How long each op runs once it can (seconds; ``math.inf``: never), whether abort hangs, and
    how long the watchdog sleeps after a failed op."""
    NcclDouble.configure(delay=delay, abort_hangs=abort_hangs, dump_sleep=dump_sleep)


def aborts() -> int:
    """How many times fastdist aborted a communicator of the double in this process."""
    return int(NcclDouble.aborts())


# The watchdog's timeout of the doubles made from now on, when not the group's own (None): a user
# who gave NCCL a shorter timeout (pg_options) than fastdist's deadlines.
watchdog_timeout: float | None = None


def make(store, rank: int, world_size: int, timeout) -> NcclDouble:
    """A double over a gloo backend on ``store`` (torch's ProcessGroupGloo as torch.distributed
    resolves it), whose watchdog enforces ``timeout`` (a timedelta), as ProcessGroupNCCL's does."""
    seconds = timeout.total_seconds() if timeout is not None else math.inf
    watchdog = watchdog_timeout if watchdog_timeout is not None else seconds
    return NcclDouble(
        dist.distributed_c10d.ProcessGroupGloo(store, rank, world_size, timeout), watchdog, seconds
    )


def _create(store, rank, world_size, timeout):
    return make(store, rank, world_size, timeout)


def register() -> None:
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, devices=["cpu"])
