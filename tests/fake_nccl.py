"""A test double for the NCCL code path, registered through torch's public third-party backend
API (``torch.distributed.Backend.register_backend``). It is a double for fastdist's logic, not a
claim about NCCL: like ProcessGroupNCCL, its works' futures complete when the op is *issued*,
and only ``work.is_completed()`` says when it "ran". Each op completes ``DELAY`` seconds after it
is issued (``math.inf``: never, like a GPU kernel stuck behind a hung peer) unless ``abort()``
aborts it first. ``ABORT_HANGS`` makes ``abort()`` itself hang, like a stuck ncclCommAbort.

With several ranks an op also waits, like a collective, until every rank of the group issued
the same op as its same-numbered op (counted in the group's store). Only completion is modelled:
tensors are not exchanged, so values are meaningless there (world size 1: the identity). That
is enough for fastdist's logic (wait for completion, deadline, abort, dead group, recover,
reaping, the missing/desynced report); NCCL itself is for tests/gpu on real GPUs.
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
    def __init__(self, pg: FakeNcclBackend, result, key: str | None = None) -> None:
        super().__init__()
        self._pg = pg
        self._key = key  # the store counter of ranks that issued this op (several ranks)
        self._all_arrived = key is None
        self._ready_at = time.monotonic() + DELAY
        fut = Future()
        fut.set_result(result)  # like NCCL: done at enqueue time, says nothing about the "GPU"
        self._fut = fut

    def is_completed(self) -> bool:
        if self._pg.aborted:
            return True
        if not self._all_arrived:
            self._all_arrived = self._pg.store.add(self._key, 0) >= self._pg.size()
        return self._all_arrived and time.monotonic() >= self._ready_at

    def is_success(self) -> bool:
        return self.is_completed() and not self._pg.aborted

    def wait(self, timeout=None) -> bool:
        if self._pg.aborted:
            raise RuntimeError("fake NCCL communicator was aborted")
        return True

    def get_future(self):
        return self._fut


class FakeNcclBackend(dist.ProcessGroup):
    def __init__(self, store, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self.store = store
        self.aborted = False
        self._seq = 0

    def _work(self, op: str, result) -> FakeWork:
        if self.size() == 1:
            return FakeWork(self, result)
        self._seq += 1
        key = f"fake_nccl/{self._seq}/{op}"
        self.store.add(key, 1)
        return FakeWork(self, result, key)

    def allreduce(self, tensor_list, opts=None):
        return self._work("allreduce", tensor_list)

    def allgather(self, output_tensors, input_tensors, opts=None):
        for outs, inp in zip(output_tensors, input_tensors):
            for out in outs:
                out.copy_(inp)
        return self._work("allgather", output_tensors)

    def broadcast(self, tensor_list, opts=None):
        return self._work("broadcast", tensor_list)

    def barrier(self, opts=None):
        return self._work("barrier", [])

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
    return FakeNcclBackend(store, rank, world_size)


def register() -> None:
    import fastdist.ops.polled

    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, devices=["cpu"])
    fastdist.groups.pgstate.POLLED_BACKENDS.add(NAME)
