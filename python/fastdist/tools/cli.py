"""The ``fastdist`` command (also ``python -m fastdist``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..diagnostics import dump
from . import demo, doctor, launcher


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``fastdist`` command with ``argv`` (default: the command line); returns its exit
    status. ``fastdist run`` hands every later argument to fastdist.tools.launcher untouched."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        # torchrun's own flags and the script's: not for this parser.
        return launcher.main(argv[1:])
    parser = argparse.ArgumentParser(prog="fastdist", description="Real deadlines for torch.distributed.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo_parser = sub.add_parser("demo", help="run a local multi-rank gloo job in which one rank hangs")
    demo.add_arguments(demo_parser)
    sub.add_parser("run", help="torchrun that replaces a dead worker (fastdist run --help)", add_help=False)
    doctor_parser = sub.add_parser(
        "doctor", help="check whether this machine can join a job, and say what to fix"
    )
    doctor.add_arguments(doctor_parser)
    report_parser = sub.add_parser(
        "report",
        help="merge the fault dumps the ranks wrote to FASTDIST_DUMP_DIR: last ops, stacks, divergence",
    )
    dump.add_arguments(report_parser)

    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo.run(args)
    if args.command == "report":
        return dump.run(args)
    return doctor.run(args)  # argparse refused any other command
