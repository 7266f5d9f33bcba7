"""Every timeout-bounded wrapper gives torch's results on a healthy 3-rank job, on gloo and on the CPU
double of NCCL."""

from __future__ import annotations

import every_op_ranks
import pytest
from mp import describe, run_ranks


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["gloo", "nccl_double"])
def test_every_op_on_three_ranks(backend: str) -> None:
    # nccl_double: the C++ double of ProcessGroupNCCL (tests/support/fake_nccl.py), on the path real NCCL
    # takes: point-to-point, batch_isend_irecv (coalesced), a subgroup, torch's own async op.
    results = run_ranks(every_op_ranks.every_op, 3, env={"FASTDIST_TEST_BACKEND": backend})
    info = describe(results)
    for r in results:
        assert r.returncode == 0, info
        assert r.has("ok"), info
