"""A test double for the NCCL code path, registered through torch's public third-party backend
API (``torch.distributed.Backend.register_backend``). It is a double for fastdist's logic, not a
claim about NCCL: like ProcessGroupNCCL, its works' futures complete when the op is *issued*,
and only ``work.is_completed()`` says when it "ran". Each op completes ``DELAY`` seconds after it
is issued (``math.inf``: never, like a GPU kernel stuck behind a hung peer) unless ``abort()``
aborts it first. ``ABORT_HANGS`` makes ``abort()`` itself hang, like a stuck ncclCommAbort.

World size 1 only: enough for the single-process logic (wait for completion, deadline, abort,
dead group, recover, reaping); multi-rank NCCL behaviour is for tests/gpu on real GPUs.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist
from torch.futures import Future

NAME = "fake_nccl"
DELAY = 0.0
ABORT_HANGS = False
aborted_groups = []


class FakeWork(dist.Work):
    def __init__(self, pg: "FakeNcclBackend", result) -> None:
        super().__init__()
        self._pg = pg
        self._ready_at = time.monotonic() + DELAY
        fut = Future()
        fut.set_result(result)  # like NCCL: done at enqueue time, says nothing about the "GPU"
        self._fut = fut

    def is_completed(self) -> bool:
        return self._pg.aborted or time.monotonic() >= self._ready_at

    def is_success(self) -> bool:
        return self.is_completed() and not self._pg.aborted

    def wait(self, timeout=None) -> bool:
        if self._pg.aborted:
            raise RuntimeError("fake NCCL communicator was aborted")
        return True

    def get_future(self):
        return self._fut


class FakeNcclBackend(dist.ProcessGroup):
    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        if world_size != 1:
            raise ValueError("the fake NCCL backend supports world size 1 only")
        self.aborted = False

    def allreduce(self, tensor_list, opts=None):
        return FakeWork(self, tensor_list)

    def allgather(self, output_tensors, input_tensors, opts=None):
        for outs, inp in zip(output_tensors, input_tensors):
            outs[0].copy_(inp)
        return FakeWork(self, output_tensors)

    def broadcast(self, tensor_list, opts=None):
        return FakeWork(self, tensor_list)

    def barrier(self, opts=None):
        return FakeWork(self, [])

    def abort(self) -> None:
        aborted_groups.append(self)
        if ABORT_HANGS:
            threading.Event().wait()
        self.aborted = True

    def shutdown(self) -> None:
        pass

    def getBackendName(self) -> str:
        return NAME


def _create(store, rank, world_size, timeout):
    return FakeNcclBackend(rank, world_size)


def register() -> None:
    import fastdist._polled

    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, devices=["cpu"])
    fastdist._polled.POLLED_BACKENDS.add(NAME)
