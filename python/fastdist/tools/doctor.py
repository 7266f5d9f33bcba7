"""``fastdist doctor``: checks, one line each with the verdict and the fix, whether this machine
can join a job: name resolution, the port, reachability, a store round trip and its latency,
versions against what rank 0 published, and which backends are usable here."""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

from ..store import keys, rendezvous
from ..store.etcd import EtcdAccessError, make_client, parse_url, raise_refusal, security_of, tls_failure


@dataclass
class Check:
    """One line of ``fastdist doctor``: the check's ``name``, whether it passed (``ok``; None:
    information only, not needed to join), what it found (``detail``) and what to do about a failure
    (``fix``)."""

    name: str
    ok: bool | None  # None: information only, not needed to join
    detail: str
    fix: str = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the arguments of ``fastdist doctor`` to ``parser``."""
    parser.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR"), help="default: $MASTER_ADDR")
    parser.add_argument(
        "--master-port",
        type=int,
        default=int(os.environ.get("MASTER_PORT", "0")) or None,
        help="default: $MASTER_PORT",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", "0")) or None,
        help="default: $WORLD_SIZE",
    )
    # Inside a torchrun worker the agent holds MASTER_PORT and every worker connects as a client:
    # rank 0 included, so the port must be listening, not free.
    in_worker = keys.agent_hosts_store()
    parser.add_argument(
        "--rank",
        type=int,
        default=int(os.environ["RANK"]) if "RANK" in os.environ and not in_worker else None,
        help="this machine's rank; rank 0 needs the port free, the others need it listening (default: $RANK, "
        "else a worker; inside a torchrun worker, a client of the agent's store)",
    )
    parser.add_argument(
        "--timeout", type=float, default=3.0, help="seconds for each network check (default 3)"
    )
    parser.add_argument(
        "--store",
        default=None,
        help="check an etcd store instead: etcd://HOST:PORT[,HOST:PORT...]/JOB_ID (each endpoint in turn)",
    )
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    parser.add_argument(
        "--torch-only",
        action="store_true",
        help="only the checks of this machine (torch, gloo, NCCL): no store is reached",
    )


def run_checks(addr: str, port: int, world_size: int | None, rank: int | None, timeout: float) -> list[Check]:
    """Whether this machine can join the job whose store rank 0 hosts at ``addr``:``port``: name
    resolution, then for rank 0 whether the port is free, for another rank whether something listens
    on it, how long a connect takes, a store round trip and the versions against rank 0's record (up
    to the first check that fails); then this machine's own checks (torch, gloo, NCCL). ``timeout``:
    seconds for each network check."""
    checks: list[Check] = []
    try:
        ip = rendezvous.resolve(addr, min(timeout, rendezvous.RESOLVE_TIMEOUT))
        checks.append(Check("resolve", True, f"{addr} -> {ip}"))
    except OSError as exc:
        checks.append(
            Check(
                "resolve", False, f"{addr}: {exc}", "check MASTER_ADDR for typos, and DNS or /etc/hosts here"
            )
        )
        return checks + _local_checks()
    cause, took = rendezvous.probe(ip, port, timeout)
    master = rank == 0
    if master:
        try:
            in_use = cause is None or rendezvous.port_in_use(ip, port)
        except OSError as exc:  # not an address of this machine
            checks.append(
                Check(
                    "port",
                    False,
                    f"rank 0 must run on {addr} itself, and {ip} is not an address here ({exc.strerror})",
                    "run rank 0 on the machine MASTER_ADDR names",
                )
            )
            return checks + _local_checks()
        if in_use:
            holder = rendezvous.port_holder(port)
            checks.append(
                Check(
                    "port",
                    False,
                    f"{ip}:{port} is already in use{' by ' + holder if holder else ''}",
                    "pick another MASTER_PORT, or stop the process holding it",
                )
            )
        else:
            checks.append(Check("port", True, f"{ip}:{port} is free for rank 0's store"))
        return checks + _local_checks()
    if cause == "refused":
        checks.append(
            Check(
                "port",
                False,
                f"nothing is listening on {ip}:{port}",
                "start rank 0 first, on that machine, with the same MASTER_PORT",
            )
        )
        return checks + _local_checks()
    if cause == "unreachable":
        checks.append(
            Check(
                "reach",
                False,
                f"no answer from {ip}:{port} within {timeout:g} s",
                "a firewall or a wrong network: check the route (nc -vz HOST PORT)",
            )
        )
        return checks + _local_checks()
    checks.append(Check("port", True, f"something is listening on {ip}:{port}"))
    checks.append(Check("reach", True, f"TCP connect in {took * 1000:.2f} ms"))
    checks.append(_store_check(ip, port, timeout))
    if checks[-1].ok:
        checks.append(_version_check(ip, port, world_size, timeout))
    return checks + _local_checks()


def _store_check(ip: str, port: int, timeout: float) -> Check:
    from torch.distributed import TCPStore

    try:
        t0 = time.monotonic()
        store = TCPStore(ip, port, None, False, timedelta(seconds=timeout))
        key = f"fastdist/doctor/{os.getpid()}"
        store.set(key, "1")
        store.get(key)
        store.delete_key(key)
        return Check(
            "store", True, f"connect + set/get/delete round trip in {(time.monotonic() - t0) * 1000:.2f} ms"
        )
    except Exception as exc:  # noqa: BLE001 - torch raises several kinds here; reported as a failed check
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return Check(
            "store",
            False,
            f"the TCPStore at {ip}:{port} did not answer: {text}",
            "something else listens on that port, or the store is overloaded: check MASTER_PORT",
        )


def _version_check(ip: str, port: int, world_size: int | None, timeout: float) -> Check:
    from torch.distributed import TCPStore

    mine = rendezvous.versions()
    store = TCPStore(ip, port, None, False, timedelta(seconds=timeout))
    if not store.check([rendezvous.VERSION_KEY]):
        return Check(
            "versions",
            None,
            f"torch {mine['torch']}, fastdist {mine['fastdist']}, Python {mine['python']} "
            "(rank 0 has published none to compare with)",
        )
    theirs = keys.parse_record(store.get(rendezvous.VERSION_KEY), rendezvous.VERSION_FIELDS)
    if theirs is None:
        return Check(
            "versions",
            False,
            f"the record at {rendezvous.VERSION_KEY!r} is not fastdist's: is another job using this port?",
        )
    diffs = [
        f"{k} {theirs.get(k)} there, {mine[k]} here"
        for k in ("torch", "fastdist")
        if theirs.get(k) != mine[k]
    ]
    if world_size is not None and theirs.get("world_size") not in (None, world_size):
        diffs.append(f"world size {theirs.get('world_size')} there, {world_size} here")
    if diffs:
        return Check(
            "versions",
            False,
            "; ".join(diffs),
            "install the same torch and fastdist everywhere, and one WORLD_SIZE",
        )
    return Check("versions", True, f"torch {mine['torch']}, fastdist {mine['fastdist']} match rank 0")


def run_etcd_checks(url: str, timeout: float) -> list[Check]:
    """Per endpoint of an etcd:// store: resolve, reach, and a read round trip with the server's
    version and its cluster's leader. Ready when at least one endpoint answers (the job moves on
    to the next one while one cannot be reached); every endpoint that cannot is a FAIL line."""

    endpoints, job, _ttl = parse_url(url)
    sec = security_of(url)
    checks: list[Check] = []
    for host, port in endpoints:
        where = f"etcd {host}:{port}"
        try:
            ip = rendezvous.resolve(host, min(timeout, rendezvous.RESOLVE_TIMEOUT))
        except OSError as exc:
            checks.append(
                Check("resolve", False, f"{where}: {exc}", "check the endpoint's name, and DNS here")
            )
            continue
        cause, took = rendezvous.probe(ip, port, timeout)
        if cause == "refused":
            checks.append(
                Check("port", False, f"{where}: nothing is listening", "start etcd there (docs/etcd.md)")
            )
            continue
        if cause == "unreachable":
            checks.append(
                Check(
                    "reach",
                    False,
                    f"{where}: unreachable, no answer within {timeout:g} s",
                    "a firewall, a partition or a wrong network: check the route (nc -vz HOST PORT)",
                )
            )
            continue
        checks.append(Check("reach", True, f"{where}: TCP connect in {took * 1000:.2f} ms"))
        try:
            from etcd3gw import exceptions as ex

            client = make_client(host, port, sec, timeout=(timeout, timeout))
            t0 = time.monotonic()
            try:
                client.get(f"/fastdist/{job}/__doctor__")
            except (ex.ConnectionFailedError, ex.ConnectionTimeoutError) as exc:
                tls = tls_failure(str(getattr(exc, "detail_text", None) or exc), sec, (host, port))
                if tls is None:
                    raise
                raise EtcdAccessError("certificate", f"{where}: {tls}") from None
            except ex.Etcd3Exception as exc:
                raise_refusal(exc, where, sec, job)
                raise
            rtt = time.monotonic() - t0
            status = client.status()
            led = int(status.get("leader", 0)) != 0
            version = status.get("version", "?")
            checks.append(
                Check(
                    "store",
                    led,
                    f"{where}: etcd {version}, read in {rtt * 1000:.2f} ms; the cluster "
                    + ("has a leader" if led else "HAS NO LEADER"),
                    "" if led else "a majority of the cluster's members must be up",
                )
            )
        except EtcdAccessError as exc:
            fix = {
                "certificate": "check ca= (the CA that signed the server's certificate), cert= and key=",
                "password": "check user= and FASTDIST_ETCD_PASSWORD",
                "permission": f"grant the user's role READWRITE on the prefix /fastdist/{job}/ "
                "(etcdctl role grant-permission)",
            }[exc.part]
            checks.append(Check(exc.part, False, str(exc), fix))
        except Exception as exc:  # noqa: BLE001 - whatever the server said is the verdict
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            checks.append(
                Check("store", False, f"{where}: accepts connections but is no working etcd: {text}", "")
            )
    if any(c.name == "store" and c.ok for c in checks):  # one answering endpoint is enough to run
        checks = [Check(c.name, None if c.ok is False else c.ok, c.detail, c.fix) for c in checks]
    return checks + _local_checks()


def _local_checks() -> list[Check]:
    import torch
    import torch.distributed as dist

    from .._native import SUPPORTED_TORCH, torch_supported

    lo, hi = (".".join(map(str, v)) for v in SUPPORTED_TORCH)
    out = [
        Check(
            "torch",
            torch_supported(),
            f"torch {torch.__version__} ({'supported' if torch_supported() else 'not supported'}: "
            f"fastdist supports {lo} to {hi})",
            ""
            if torch_supported()
            else f"install a torch from {lo} to {hi}, then rebuild fastdist against it",
        ),
        Check(
            "gloo",
            dist.is_gloo_available() or None,
            "gloo is usable here" if dist.is_gloo_available() else "gloo is not built into this torch",
        ),
    ]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if dist.is_nccl_available() and gpus:
        out.append(Check("nccl", None, f"NCCL is usable here, with {gpus} GPU{'s' if gpus != 1 else ''}"))
    else:
        out.append(
            Check(
                "nccl",
                None,
                "NCCL is not usable here (" + ("no GPU" if not gpus else "torch built without NCCL") + ")",
            )
        )
    return out


def run(args: argparse.Namespace) -> int:
    """Runs ``fastdist doctor``: the checks ``args`` ask for (this machine's only, an etcd store's,
    or those of the store at ``--master-addr``:``--master-port``), printed one per line or as JSON.
    Returns 0 when none failed, else 1. Raises SystemExit with a message when the arguments name
    no store, or a ``--store`` that is not ``etcd://``."""
    if args.torch_only:
        checks = _local_checks()
    elif args.store:
        if not args.store.startswith("etcd://"):
            raise SystemExit(
                f"fastdist doctor: --store takes etcd://HOST:PORT[,...]/JOB_ID, got {args.store!r}"
            )
        checks = run_etcd_checks(args.store, args.timeout)
    elif not args.master_addr or not args.master_port:
        raise SystemExit(
            "fastdist doctor: give --master-addr and --master-port (or set MASTER_ADDR and MASTER_PORT), "
            "or --store etcd://..."
        )
    else:
        checks = run_checks(args.master_addr, args.master_port, args.world_size, args.rank, args.timeout)
    healthy = all(c.ok is not False for c in checks)
    if args.json:
        print(json.dumps({"ok": healthy, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        for c in checks:
            mark = {True: " ok ", False: "FAIL", None: "info"}[c.ok]
            print(f"[{mark}] {c.name:<9} {c.detail}" + (f"\n       fix: {c.fix}" if c.fix else ""))
        print("ready to join" if healthy else "NOT ready to join: fix the lines marked FAIL")
    return 0 if healthy else 1
