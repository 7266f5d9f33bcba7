"""Issue 26: torch's own distributed tests pass on groups fastdist watches, as they do on plain gloo.

The chosen tests (torch 2.13.0, gloo, 3 processes a test, file:// init as torch's own CI runs
them): the barrier timeouts, whose error text torch matches against `` (Timed out|closed|timeout) ``,
DDP, and DDP's logging data (its ``backend_name`` and gloo's own fields, as on plain gloo). They
run in one pytest process of their own (tests/torch_suite/torch_suite.py), on watched groups. Each costs
about 10 s of process starts on 2 cores, so the suite keeps these four:
``FASTDIST_TORCH_SUITE_MORE=1`` adds all_reduce, send/recv, broadcast and subgroup tests, and
``FASTDIST_TORCH_SUITE_BASELINE=1`` runs the same tests on plain gloo first and compares (all of
them pass there: measured on this machine with both variables set).

Left out, with the reason: ``test_barrier_timeout_group`` needs 8 processes. (torch's DDP logger
names a watched group's backend "custom": fastdist's wrapper is registered as a custom backend,
since the logger casts a gloo group's backend to ProcessGroupGloo. ``_get_ddp_logging_data`` on a
watched group reports the wrapped backend's name and fields: fastdist.recovery.wrappers.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

TESTS = (
    "test_barrier_timeout_global",
    "test_barrier_timeout_full_group",
    "test_DistributedDataParallelCPU",
    "test_ddp_logging_data_cpu",
)
MORE = ("test_all_reduce_sum", "test_send_recv", "test_broadcast", "test_get_rank_size_group")
HERE = Path(__file__).parent


def _run(watched: bool) -> tuple[set[str], str]:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(
            os.environ,
            BACKEND="gloo",
            WORLD_SIZE="3",
            TEMP_DIR=tmp,
            INIT_METHOD=f"file://{tmp}/init",
            FASTDIST_WATCHED="1" if watched else "0",
            PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        )
        ids = [f"{HERE / 'torch_suite.py'}::TestTorchSuite::{name}" for name in _tests()]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-rA",
                "-p",
                "no:cacheprovider",
                "-W",
                "ignore::DeprecationWarning",
            ]
            + ids,
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
            cwd=tmp,
        )
    out = proc.stdout + proc.stderr
    return set(re.findall(r"^PASSED \S+::TestTorchSuite::(\w+)", out, re.MULTILINE)), out


def _tests() -> tuple[str, ...]:
    return TESTS + (MORE if os.environ.get("FASTDIST_TORCH_SUITE_MORE") == "1" else ())


@pytest.mark.timeout(900)
def test_torch_suite_passes_on_watched_groups() -> None:
    assert torch.__version__.startswith("2.13."), torch.__version__  # the list was chosen on 2.13
    if os.environ.get("FASTDIST_TORCH_SUITE_BASELINE") == "1":
        plain, out = _run(watched=False)
        assert plain == set(_tests()), out[-4000:]
    watched, out = _run(watched=True)
    assert watched == set(_tests()), out[-6000:]
