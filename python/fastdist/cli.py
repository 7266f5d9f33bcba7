"""The ``fastdist`` command (also ``python -m fastdist``)."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="fastdist", description="Real deadlines for torch.distributed.")
    sub = parser.add_subparsers(dest="command", required=True)

    from . import demo

    demo_parser = sub.add_parser("demo", help="run a local multi-rank gloo job in which one rank hangs")
    demo.add_arguments(demo_parser)

    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo.run(args)
    parser.error(f"unknown command {args.command!r}")
    return 2
