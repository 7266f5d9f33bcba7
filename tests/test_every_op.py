"""Every timeout-bounded wrapper gives torch's results on a healthy 3-rank gloo job."""

from __future__ import annotations

import every_op_ranks
import pytest
from mp import describe, run_ranks


@pytest.mark.timeout(90)
def test_every_op_on_three_ranks() -> None:
    results = run_ranks(every_op_ranks.every_op, 3)
    info = describe(results)
    for r in results:
        assert r.returncode == 0, info
        assert r.has("ok"), info
