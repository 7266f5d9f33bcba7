"""``fastdist run``'s command line: torchrun's parser plus fastdist's flags, and the checks that
refuse what cannot run, with one line naming the flag, before anything starts."""

from __future__ import annotations

import argparse
import errno
import socket
from typing import NoReturn

from .liveness import KILL_MISSING_AFTER, START_GRACE

# The longest --rdzv-id taken (it names the job's keys in the store).
MAX_RDZV_ID = 256


def get_args_parser() -> argparse.ArgumentParser:
    """torchrun's parser plus fastdist's flags."""
    from torch.distributed.run import get_args_parser as torchrun_parser

    parser = torchrun_parser()
    parser.prog = "fastdist run"
    parser.description = "torchrun, except that a dead worker is replaced and the others keep running"
    parser.add_argument(
        "--max-replacements",
        type=int,
        default=3,
        help="how many dead workers to replace (new processes) before the job ends (default 3)",
    )
    parser.add_argument(
        "--spares",
        type=int,
        default=0,
        help="the last N processes of --nproc-per-node hold no rank; each takes a dead rank's place",
    )
    parser.add_argument(
        "--kill-missing-after",
        type=float,
        default=KILL_MISSING_AFTER,
        help="a worker that a live rank's timeout named missing (it neither reached the op nor "
        "answered: stopped, or stuck in the kernel or a driver) and that has shown no sign of life "
        f"since is killed after this many seconds, and so replaced (default {KILL_MISSING_AFTER:.0f}; "
        "inf: never). A busy worker is not killed: its heartbeat thread answers, or it uses CPU (an "
        "evaluation, a loader wait, a checkpoint write, a long C call); a replacement still starting "
        f"is not killed before it joins the job or {START_GRACE:.0f} s pass",
    )
    parser.add_argument(
        "--node-wait",
        type=float,
        default=60.0,
        help="several nodes: an agent started while the job runs waits this long (seconds) for a "
        "node whose agent is gone, and takes its place (default 60)",
    )
    return parser


def _refuse(text: str) -> NoReturn:
    """Ends the launcher with one line on stderr (exit code 1), before anything was started."""
    raise SystemExit(f"fastdist run: {text}")


def _node_counts(nnodes: str) -> tuple[int, int]:
    """--nnodes (N or MIN:MAX) as (the fewest, the most) nodes."""
    from torch.distributed.run import parse_min_max_nnodes

    try:
        low, high = parse_min_max_nnodes(nnodes)
    except (ValueError, RuntimeError):
        _refuse(f"--nnodes must be N or MIN:MAX (whole numbers), got {nnodes!r}")
    if not 0 < low <= high:
        _refuse(f"--nnodes must be at least 1 (and MIN <= MAX), got {nnodes!r}")
    return int(low), int(high)


def _local_workers(nproc: str) -> int:
    """--nproc-per-node as a count of processes (torch's words for auto/cpu/gpu), at least 1."""
    from torch.distributed.run import determine_local_world_size

    try:
        count = int(determine_local_world_size(nproc))
    except ValueError as exc:
        _refuse(f"--nproc-per-node {nproc}: {exc}")
    if count < 1:
        _refuse(f"--nproc-per-node must be at least 1, got {nproc}")
    return count


def _store_port(args: argparse.Namespace) -> int | None:
    """The port this agent's store will listen on: --master-port, with torch's static rendezvous
    (one node: several need c10d). Else none to check: torch picks a free port (no
    --master-port), or the rendezvous endpoint's host listens."""
    static = args.rdzv_backend == "static" and not args.rdzv_endpoint and not args.standalone
    if not static or args.node_rank != 0 or args.master_port is None:
        return None
    return int(args.master_port)


def _port_taken(port: int) -> bool:
    """Whether something on this host already listens on ``port`` (as torch's TCPStore binds:
    every address, SO_REUSEADDR, so that a port a finished job left in TIME_WAIT is free)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def busy_port_line(port: int, flag: str = "--master-port") -> str:
    """The line that says ``port`` (given as ``flag``) is taken on this host."""
    return (
        f"port {port} ({flag}) is already in use on this host (another job's store, or another "
        "process): give a free port, or stop what holds it"
    )


def check_args(args: argparse.Namespace) -> tuple[int, int]:
    """Refuses what cannot run, one line naming the flag, before anything starts (torch would
    start an agent and fail with a traceback, or, for spares that leave no worker, train
    nothing and exit 0). Returns (the local worker count, the most nodes)."""
    if args.max_replacements < 0:
        _refuse("--max-replacements must be >= 0")
    if args.spares < 0:
        _refuse("--spares must be >= 0")
    if args.max_restarts:
        _refuse("--max-restarts restarts every worker; use --max-replacements")
    if not args.node_wait > 0:  # (NaN too)
        _refuse("--node-wait must be > 0")
    if not args.kill_missing_after > 0:
        _refuse("--kill-missing-after must be > 0 (inf: never)")
    if len(str(args.rdzv_id)) > MAX_RDZV_ID:
        # (it prefixes every key of the job in the store: a 20,000-character one failed there,
        # and was told as the store's node lost)
        _refuse(f"--rdzv-id is {len(str(args.rdzv_id))} characters long: at most {MAX_RDZV_ID}")
    _, max_nodes = _node_counts(str(args.nnodes))
    if max_nodes > 1:
        if args.rdzv_backend != "c10d" or not args.rdzv_endpoint:
            _refuse("several nodes need --rdzv-backend c10d --rdzv-endpoint HOST:PORT")
        if args.spares:
            _refuse("--spares is for one node (--nnodes 1) for now")
    workers = _local_workers(str(args.nproc_per_node))
    if args.spares >= workers:
        _refuse(
            f"--spares {args.spares} leaves no process of --nproc-per-node {workers} to train: give fewer"
        )
    port = _store_port(args)
    if port is not None and _port_taken(port):
        _refuse(busy_port_line(port))
    return workers, max_nodes
