"""Fast-path overhead of fastdist's timeout-bounded collectives against raw torch.distributed,
2 gloo ranks on loopback, measured interleaved in one run. Goal: ratio of medians <= 1.05.

The pytest-benchmark figure is the fastdist call; the interleaved comparison, which is the
number that matters, is in each benchmark's extra_info (and printed).
"""

from __future__ import annotations

import pytest

from conftest import SMOKE

ROUNDS = 20 if SMOKE else 3000

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("op", ["barrier", "all_gather_1", "all_gather_1mb"])
def test_collective_overhead(benchmark, pair, op: str) -> None:
    rounds = ROUNDS if op != "all_gather_1mb" else max(10, ROUNDS // 10)
    result = pair.interleaved(f"raw_{op}", f"fd_{op}", rounds)
    benchmark.extra_info.update(result)
    print(f"\n{op}: raw {result['raw_median_us']:.1f} us, fastdist {result['fastdist_median_us']:.1f} us, "
          f"ratio {result['ratio_of_medians']:.3f}, added {result['added_us']:+.1f} us")
    # Also give pytest-benchmark its own timing of the fastdist call (paired with the peer).
    benchmark.pedantic(lambda: pair.run([f"fd_{op}"]), rounds=5 if SMOKE else 200, iterations=1)
