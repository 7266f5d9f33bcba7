"""Entry point of one rank in a multi-process test: ``rank_main.py FILE:FUNCTION RANK WORLD PORT``.

FUNCTION(ctx) is the rank code, in FILE: a test module, or the rank module named after it
(tests/groups/test_watched.py's ranks are in tests/groups/watched_ranks.py)."""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# A rank behaves as a process started from a terminal: a suite started in the background by a
# non-interactive shell hands its children SIGINT ignored, and Python then installs no
# KeyboardInterrupt handler (the Ctrl-C tests would wait out their deadlines).
signal.signal(signal.SIGINT, signal.default_int_handler)

from mp import RECORD_PREFIX, RELEASE_KEY


class Context:
    def __init__(self, rank: int, world_size: int, port: int) -> None:
        from torch.distributed import TCPStore

        self.rank = rank
        self.world_size = world_size
        self.port = port
        self.store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))

    def record(self, event: str, **fields: Any) -> None:
        fields["event"] = event
        fields.setdefault("wall", time.time())
        print(RECORD_PREFIX + json.dumps(fields), flush=True)

    def init(self) -> None:
        import fastdist
        import torch.distributed as dist

        # A watched group, as fastdist.init_process_group makes it: every op on it is bounded.
        # FASTDIST_TEST_BACKEND=nccl_double: on the CPU double of NCCL (tests/support/fake_nccl.py).
        backend = os.environ.get("FASTDIST_TEST_BACKEND", "gloo")
        if backend != "gloo":
            import fake_nccl

            fake_nccl.register()
        prefix = dist.PrefixStore("pg", self.store)
        fastdist.init_process_group(
            backend, store=prefix, rank=self.rank, world_size=self.world_size, timeout=60
        )

    def wait_release(self) -> None:
        """Plays an absent rank: stays alive, in no collective, until the harness releases it."""
        self.record("absent")
        self.store.wait([RELEASE_KEY], timedelta(seconds=120))


def main() -> None:
    scenario, rank, world_size, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    ctx = Context(rank, world_size, port)
    try:
        path, _, func = scenario.rpartition(":")
        sys.path.insert(0, os.path.dirname(path))
        getattr(importlib.import_module(Path(path).stem), func)(ctx)
    except Exception:
        ctx.record("crash", traceback=traceback.format_exc())
        sys.stdout.flush()
        raise
    ctx.record("ending")


if __name__ == "__main__":
    main()
