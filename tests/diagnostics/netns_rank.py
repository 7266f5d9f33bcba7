"""One rank of a network-fault test (tests/diagnostics/test_netfaults.py), run inside its own network
namespace: ``netns_rank.py SCENARIO RANK WORLD``. The job's store is on the ``store`` node (as
torchrun's agent on another host: every rank is a client); records go to stdout as JSON lines, and
the ranks and the test signal each other with files in $FDNET_CTRL (a directory all share)."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # tests/support: the harness

from mp import RECORD_PREFIX


class Context:
    def __init__(self, rank: int, world_size: int) -> None:
        import netns

        self.rank = rank
        self.world_size = world_size
        self.ctrl = Path(os.environ["FDNET_CTRL"])
        self.net = netns.Net.from_env()
        self.me = f"r{rank}"

    def record(self, event: str, **fields: Any) -> None:
        fields["event"] = event
        fields.setdefault("wall", time.time())
        print(RECORD_PREFIX + json.dumps(fields), flush=True)

    def signal(self, name: str) -> None:
        (self.ctrl / name).touch()

    def wait_for(self, name: str, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while not (self.ctrl / name).exists():
            if time.monotonic() > end:
                raise TimeoutError(f"no {name!r} signal within {timeout} s")
            time.sleep(0.02)


def main() -> None:
    scenario, rank, world_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    import netfaults_ranks

    ctx = Context(rank, world_size)
    try:
        getattr(netfaults_ranks, scenario)(ctx)
    except Exception:
        ctx.record("crash", traceback=traceback.format_exc())
        sys.stdout.flush()
        raise
    ctx.record("ending")


if __name__ == "__main__":
    main()
