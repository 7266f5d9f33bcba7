"""Cost of one engine deadline, register + cancel, from Python. Goal: <= 0.5 us."""

from __future__ import annotations

import pytest
from fastdist import _core


@pytest.mark.timeout(120)
def test_register_cancel(benchmark) -> None:
    eng = _core.default_engine()
    deadline = eng.now() + 3600
    add = eng.add

    def register_cancel() -> None:
        add(deadline).cancel()

    benchmark.pedantic(
        register_cancel,
        rounds=2000 if not __import__("conftest").SMOKE else 5,
        iterations=100,
        warmup_rounds=1,
    )
    assert eng.stats()["pending"] == 0
