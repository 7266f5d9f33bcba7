"""The README's and docs/'s Python examples do not rot. Every ```python block is named
(``<!-- example: NAME -->`` above it, tests/docs/docs_ranks.py); each compiles and every
``fastdist.*`` name in it exists; those in docs_ranks.SETUPS run as written on two processes and
are checked for what they must have done. The others (NOT_RUN_HERE) are parts of jobs that need
what this suite starts elsewhere (a framework's launcher, etcd, a GPU): each names the test that
runs that job."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import docs_ranks
import pytest
from mp import describe, free_port, run_ranks

ROOT = Path(__file__).resolve().parents[2]
_NAME = re.compile(r"\bfastdist(?:\.[A-Za-z_]\w*)+")

# The examples not run here as written, each with the test that runs its job (a real job of the
# same calls, with a fault), and why this one is not: the reason is what the block needs.
_FW = "tests/frameworks/test_frameworks.py::"
NOT_RUN_HERE = {
    "lightning-ddp": (_FW + "test_trainer_under_fastdist_run_replaces_a_killed_worker", "8 GPUs"),
    "etcd-init": (
        "tests/store/test_etcd.py::test_three_ranks_on_etcd_time_out_recover_and_survive_losing_rank_0",
        "an etcd cluster",
    ),
    "etcd-tls": (
        "tests/store/test_etcd_tls.py::test_a_job_rendezvous_through_etcd_url_with_tls_and_a_password",
        "etcd with TLS",
    ),
    "nccl-ddp": (
        "tests/gpu/test_nccl_gpu.py::test_a_stalled_step_raises_in_time_and_is_redone_exactly_on_nccl",
        "a GPU",
    ),
}


def test_every_example_is_named_and_either_runs_here_or_names_the_test_of_its_job() -> None:
    names = set(docs_ranks.blocks())  # ValueError: a block without a name, or a name used twice
    assert len(names) >= 26, sorted(names)  # the pattern still finds them
    kinds = [set(docs_ranks.SETUPS), set(docs_ranks.IN_PROCESS), set(NOT_RUN_HERE)]
    assert sum(map(len, kinds)) == len(set().union(*kinds)), "an example in two lists"
    accounted = set().union(*kinds)
    assert names == accounted, (
        f"not on a page: {sorted(accounted - names)}; "
        f"neither run nor accounted for: {sorted(names - accounted)}"
    )
    for name, (test, _why) in NOT_RUN_HERE.items():
        path, _, func = test.partition("::")
        assert f"def {func}(" in (ROOT / path).read_text(), f"{name}: {test} does not exist"


def _resolve(name: str) -> None:
    parts = name.split(".")
    obj = importlib.import_module("fastdist")
    for k, part in enumerate(parts[1:], 2):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            obj = importlib.import_module(".".join(parts[:k]))  # a submodule (ImportError if none)


@pytest.mark.timeout(60)
def test_every_python_example_in_the_docs_compiles_and_names_what_exists() -> None:
    missing = []
    for where, src in docs_ranks.blocks().values():
        compile(src, where, "exec")  # SyntaxError names the page and the line
        for name in sorted(set(_NAME.findall(src))):
            try:
                _resolve(name)
            except ImportError:
                missing.append(f"{where}: {name}")
    assert not missing, missing


# What two ranks must agree on, or hold, after an example (its check's fields, docs_ranks).
_EXPECTED = {
    "api-bounded": {"gathered": [[0.0, 0.0], [1.0, 1.0]]},
    "api-scopes": {"gathered": [[0.0, 0.0], [1.0, 1.0]]},
    "api-async": {"grad": [2.0, 2.0, 2.0]},
    "api-recover": {"grad": [8.0]},  # three all_reduces (sums) of ones over two ranks
    "replacement-progress": {"step": 4},
    "accelerate-loop": {"losses": 2},  # one loss a rank, gathered
    "fabric-loop": {"step": 4},  # 48 samples, batches of 4, over 3 ranks
}


@pytest.mark.timeout(100)
@pytest.mark.parametrize("name", sorted(docs_ranks.SETUPS))
def test_the_example_runs_as_written_on_two_ranks(name: str, tmp_path: Path) -> None:
    env = {
        "FASTDIST_DOC_EXAMPLE": name,
        "FASTDIST_DOC_TMP": str(tmp_path),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    world = docs_ranks.WORLD.get(name, 2)
    results = run_ranks(docs_ranks.run_example, world, timeout=80, env=env)
    info = describe(results)
    ran = [r.record("ran") for r in results]
    assert all(r.returncode == 0 for r in results), info
    for rank, rec in enumerate(ran):
        if "world" in rec:  # the group it made, or the one it stands in
            assert (rec["rank"], rec["world"]) == (rank, world), info
        for key, want in _EXPECTED.get(name, {}).items():
            assert rec[key] == want, (key, rec, info)
    if "params" in ran[0]:  # a training loop: every rank ends with the same model
        assert all((r["params"], r["step"]) == (ran[0]["params"], ran[0]["step"]) for r in ran), info


@pytest.mark.timeout(60)
def test_the_lightning_strategy_examples_run_as_written() -> None:
    """frameworks.md's FSDP2 strategies, made as the page makes them (nothing is launched)."""
    assert docs_ranks.run_in_process("lightning-fsdp2") == {
        "step_timeout": 60.0,
        "collective_timeout": 120.0,
        "copies": 0,
    }
    made = docs_ranks.run_in_process("lightning-fsdp2-snapshots")
    assert made["step_timeout"] == 60.0 and made["copies"] == 1, made
