"""torch's own distributed tests (``torch.testing._internal.distributed.distributed_test``) on
groups made by ``fastdist.init_process_group``, run by tests/torch_suite/test_torch_suite.py.

torch's module reads BACKEND, WORLD_SIZE and TEMP_DIR when it is imported, and its test processes
(spawned) import this module again: the runner sets them in the environment. With
FASTDIST_WATCHED=1 every ``torch.distributed.init_process_group`` torch's tests make (a rank's
start, and the tests that destroy and remake the default group) is fastdist's, so every group the
tests use is watched; with 0 the same tests run on plain gloo.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import fastdist
import torch.distributed as dist
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

if os.environ.get("FASTDIST_WATCHED") == "1":
    _torch_init = dist.init_process_group
    _inside = threading.local()

    def _init(*args: Any, **kwargs: Any) -> None:
        if getattr(_inside, "on", False):  # fastdist's own call of torch's
            _torch_init(*args, **kwargs)
            return
        _inside.on = True
        try:
            fastdist.init_process_group(*args, **kwargs)
        finally:
            _inside.on = False

    dist.init_process_group = _init


class TestTorchSuite(TestDistBackend, DistributedTest._DistTestBase):  # type: ignore[misc,name-defined]
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()
