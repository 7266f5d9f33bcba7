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
