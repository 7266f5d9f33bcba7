"""What the framework jobs (tests/*_job.py) share."""

from __future__ import annotations

from typing import Any

import torch


def result(
    rank: int, net: torch.nn.Module, opt: Any, optimizer_steps: int, losses: list[float], **extra: Any
) -> dict[str, Any]:
    """What a job saves after a run for tests/frameworks/test_frameworks.py to compare: the model's
    parameters, SGD's momentum and learning rates (``opt``: the torch optimizer), the scheduler's
    step count, the losses, the world size, and ``extra``."""
    return {
        "rank": rank,
        "params": {k: v.detach().clone() for k, v in net.state_dict().items()},
        "momentum": [opt.state[p]["momentum_buffer"].clone() for p in net.parameters()],
        "lr": [pg["lr"] for pg in opt.param_groups],
        "optimizer_steps": optimizer_steps,
        "losses": losses,
        "world": torch.distributed.get_world_size(),
        **extra,
    }


def die_in_snapshot_exchanges(deaths: list[tuple[int, int, bool, str]]) -> None:
    """Makes ranks SIGKILL themselves inside the exchange of a step-start snapshot (run_step's,
    Lightning's ``snapshot_copies``), each once (its ``marker`` file): ``deaths`` holds (step, rank,
    before_copy, marker). ``before_copy``: as the exchange issues its first op, before the rank's
    own copy left (the job rolls back to the previous step's start and redoes that step); else at
    the exchange's closing barrier, its copy sent and its neighbours' received (the step is
    redone from its own start)."""
    import os
    import signal
    import time

    from fastdist.recovery.snapshot import PeerSnapshot

    real = PeerSnapshot._post

    def _post(self: Any, epoch: int) -> Any:
        post = real(self, epoch)

        def dying(issue: Any) -> Any:
            pending = self._pending
            for step, rank, before_copy, marker in deaths:
                if self.rank != rank or os.path.exists(marker):
                    continue
                if (before_copy and self.at == step and pending is None) or (
                    not before_copy and pending and pending[0] == step
                ):
                    open(marker, "w").close()
                    if not before_copy:
                        time.sleep(0.5)  # (its sends drain)
                    os.kill(os.getpid(), signal.SIGKILL)
            return post(issue)

        return dying

    PeerSnapshot._post = _post  # type: ignore[method-assign]
