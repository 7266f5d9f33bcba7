"""Issue 14: a fault reaches every rank at once, and the error says where every rank is."""

from __future__ import annotations

import pytest
from mp import describe, run_ranks

pytestmark = pytest.mark.timeout(120)


def test_the_error_says_where_each_rank_is_and_the_others_raise_at_once() -> None:
    results = run_ranks("where_stuck", 3, timeout=90)
    info = describe(results)
    for r in results:
        assert r.returncode == 0, info
        assert r.has("recovered_b"), info
    a0, a1 = results[0].record("a"), results[1].record("a")
    # Rank 0 timed out; its error names rank 2 where it is (function and line), and rank 1's op.
    assert a0["type"] == "CollectiveTimeoutError" and a0["missing"] == [2], info
    assert "rank 2 is not in a collective: scenarios_watched.py:" in a0["message"], info
    assert " in load_batch" in a0["stacks"]["2"][0], info
    assert "rank 1 is in all_reduce #" in a0["message"], info
    # Rank 1, in another op with a 60 s deadline, raised with rank 0, not at 60 s.
    assert a1["type"] == "GroupAbortedError" and "rank 0 timed out in barrier #" in a1["message"], info
    assert abs(results[1].record("a")["wall"] - results[0].record("a")["wall"]) < 0.25, info
    assert a1["elapsed"] < 2.0, info
    # A stopped rank cannot answer: the report says so.
    for r in results[:2]:
        b = r.record("b")
        assert b["missing"] == [2] and "rank 2 did not answer" in b["message"], info
