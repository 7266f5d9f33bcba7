"""What the framework jobs (tests/*_job.py) share."""

from __future__ import annotations

from typing import Any


class Position:
    """A loop's position, handed to a replacement with the model: the accumulation windows done."""

    def __init__(self) -> None:
        self.windows = 0

    def state_dict(self) -> dict[str, Any]:
        return {"windows": self.windows}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.windows = int(sd["windows"])
