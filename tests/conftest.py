from __future__ import annotations

import sys
from pathlib import Path

# The tests are in folders by layer (api, ops, groups, diagnostics, recovery, store, launcher,
# frameworks, docs, torch_suite, gpu), each test file beside the rank scripts and jobs it runs;
# the harness they share (mp.py's run_ranks, the zygote, the NCCL double) is in support/.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))


# The longest tests (tens of seconds to two minutes each on 2 cores) start first, a share of them
# on each worker: pytest-xdist's worksteal gives each worker a contiguous share of the
# collection at first and steals from a list's end, so each share begins with its part of the
# long tests, and the workers end on short ones instead of one finishing a long one alone.
_LONGEST_FIRST = (
    "test_torch_suite.py::",
    "test_every_benchmark_runs_once_in_smoke_mode",
    "killed_in_the_snapshot_exchange",
    "test_hugging_face_trainer",
    "test_two_adjacent_deaths",
    "test_trainer_under_lightnings_launcher",
    "test_partitions_loss_and_a_flapping_link",
    "test_demo_names_the_stalled_rank",
    "test_trainer_fsdp2_under_torchrun",
    "runs_as_written_on_two_ranks[hf-trainer]",
    "runs_as_written_on_two_ranks[fabric-",
)


# Two kinds of test are a step of their own (make test-jobs, which .ci/run runs after make test
# on every submission), so that make test stays inside its cap on 2 cores; nothing is dropped
# (`pytest` alone runs them all): `frameworks`, the tests that start a training framework
# (Lightning, Fabric, Accelerate, the Hugging Face Trainer) or torch's own launcher (torchrun's
# agent, its restarts and rendezvous) or run torch's own distributed suite,
# and `nodes`, the jobs of several nodes (agents) and the network cut between processes.
_FRAMEWORK_FOLDERS = ("tests/frameworks/", "tests/torch_suite/", "tests/launcher/test_torchrun.py::")
_FRAMEWORK_EXAMPLES = ("[accelerate-", "[fabric-", "[hf-", "[lightning-")
_REPLACE = "tests/recovery/test_replace.py::"
_NODES = (
    "tests/diagnostics/test_netfaults.py::",
    f"{_REPLACE}test_a_dead_node_",
    f"{_REPLACE}test_the_node_hosting_",
    f"{_REPLACE}test_a_lost_node_",
)


def _marks(item: object) -> list[str]:
    node = str(getattr(item, "nodeid", ""))
    framework = node.startswith(_FRAMEWORK_FOLDERS) or (
        node.startswith("tests/docs/") and any(key in node for key in _FRAMEWORK_EXAMPLES)
    )
    return (["frameworks"] if framework else []) + (["nodes"] if node.startswith(_NODES) else [])


def pytest_collection_modifyitems(config: object, items: list) -> None:  # type: ignore[type-arg]
    import pytest

    for item in items:
        for mark in _marks(item):
            item.add_marker(getattr(pytest.mark, mark))

    def rank(item: object) -> int:
        node = str(getattr(item, "nodeid", ""))
        return next((i for i, key in enumerate(_LONGEST_FIRST) if key in node), len(_LONGEST_FIRST))

    longest = sorted((it for it in items if rank(it) < len(_LONGEST_FIRST)), key=rank)
    rest = [it for it in items if rank(it) == len(_LONGEST_FIRST)]
    first, second = longest[0::2], longest[1::2]
    half = (len(items) + 1) // 2
    cut = max(0, half - len(first))
    items[:] = first + rest[:cut] + second + rest[cut:]
