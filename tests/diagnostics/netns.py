"""A test network of Linux network namespaces on this machine: one namespace per node (each rank,
and the store's host), joined by veth pairs to a bridge that lives in a namespace of its own.
Addresses (10.77.0.0/24) exist only inside those namespaces; nothing touches the host's own
network, and traffic never leaves the machine. Faults:

- ``partition(node)``: every packet in and out of the node vanishes (nftables drop in its
  namespace): TCP connections stay "open" and silent, as when a node drops off the network;
- ``loss(node, percent)``: that share of the packets it sends vanish (nftables numgen);
- ``link(node, up)``: its port on the bridge goes down (carrier lost) or comes back;
- ``delay``: needs tc's netem, which this machine's kernel lacks (CONFIG_NET_SCH_NETEM is not
  set); ``netem_available()`` says whether it can be used.

``teardown()`` kills what runs in the namespaces and deletes them (the veths and the bridge go
with them); a fixture calls it also when the test fails or times out, and ``sweep_stale()`` removes
what a killed earlier run left behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

PREFIX = "fdnet"
SUBNET = "10.77.0"


def _run(*argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, input=input, timeout=20)


def unavailable() -> str | None:
    """Why namespaces cannot be used here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"no {tool} binary (apt-get install iproute2 nftables; .ci/run installs them)"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    try:
        veth = _run(
            "ip", "-n", probe, "link", "add", "name", "va", "type", "veth", "peer", "name", "vb", check=False
        )
        if veth.returncode != 0:
            return f"cannot make a veth pair: {veth.stderr.strip()}"
        nft = _run("ip", "netns", "exec", probe, "nft", "add", "table", "inet", "t", check=False)
        if nft.returncode != 0:
            return f"nftables does not work here: {nft.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def netem_available() -> bool:
    probe = f"{PREFIX}-probe-{os.getpid()}"
    _run("ip", "netns", "add", probe, check=False)
    try:
        _run("ip", "-n", probe, "link", "set", "lo", "up", check=False)
        return (
            _run(
                "ip",
                "netns",
                "exec",
                probe,
                "tc",
                "qdisc",
                "add",
                "dev",
                "lo",
                "root",
                "netem",
                "delay",
                "1ms",
                check=False,
            ).returncode
            == 0
        )
    finally:
        _run("ip", "netns", "del", probe, check=False)


def sweep_stale() -> None:
    """Deletes namespaces of earlier runs whose process is gone (named PREFIX-PID-...)."""
    listing = _run("ip", "netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        stale = len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit()
        if stale and not os.path.exists(f"/proc/{parts[1]}"):
            _kill_inside(name)
            _run("ip", "netns", "del", name, check=False)


def _kill_inside(ns: str) -> None:
    pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


class Net:
    """``nodes`` named nodes, node i at 10.77.0.(i+1). ``build=False``: a handle on a network
    another process built (see :meth:`env` and :meth:`from_env`), to inject faults from a rank."""

    def __init__(self, nodes: list[str], tag: str | None = None, build: bool = True) -> None:
        self.tag = tag or f"{PREFIX}-{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.nodes = list(nodes)
        self.made: list[str] = []
        if build:
            try:
                self._build()
            except BaseException:
                self.teardown()
                raise

    def env(self) -> dict[str, str]:
        return {"FDNET_TAG": self.tag, "FDNET_NODES": ",".join(self.nodes)}

    @classmethod
    def from_env(cls) -> Net:
        return cls(os.environ["FDNET_NODES"].split(","), tag=os.environ["FDNET_TAG"], build=False)

    def ns(self, node: str) -> str:
        return f"{self.tag}-{node}"

    def ip(self, node: str) -> str:
        return f"{SUBNET}.{self.nodes.index(node) + 1}"

    def _add_ns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._add_ns(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, node in enumerate(self.nodes):
            ns = self.ns(node)
            self._add_ns(ns)
            _run(
                "ip",
                "-n",
                self.switch,
                "link",
                "add",
                f"p{i}",
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
            )
            _run("ip", "-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.ip(node)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")

    def command(self, node: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``node``'s namespace."""
        return ["ip", "netns", "exec", self.ns(node), *argv]

    # -- faults --------------------------------------------------------------------------------

    def partition(self, node: str) -> None:
        rules = (
            "table inet fdfault {\n"
            " chain in { type filter hook input priority 0; iif lo accept; drop; }\n"
            " chain out { type filter hook output priority 0; oif lo accept; drop; }\n"
            "}\n"
        )
        self.heal(node)
        _run("ip", "netns", "exec", self.ns(node), "nft", "-f", "-", input=rules)

    def partitioned(self, node: str) -> bool:
        """Whether ``partition(node)``'s rules are in place."""
        got = subprocess.run(
            ["ip", "netns", "exec", self.ns(node), "nft", "list", "table", "inet", "fdfault"],
            check=False,
            capture_output=True,
            text=True,
        )
        return got.returncode == 0 and "drop" in got.stdout

    def loss(self, node: str, percent: int) -> None:
        """``percent`` of the packets the node sends vanish (as netem loss on its interface)."""
        rules = (
            "table inet fdfault {\n"
            " chain out { type filter hook output priority 0; oif lo accept; "
            f"numgen random mod 100 < {percent} drop; }}\n"
            "}\n"
        )
        self.heal(node)
        _run("ip", "netns", "exec", self.ns(node), "nft", "-f", "-", input=rules)

    def heal(self, node: str) -> None:
        _run("ip", "netns", "exec", self.ns(node), "nft", "delete", "table", "inet", "fdfault", check=False)

    def link(self, node: str, up: bool) -> None:
        _run("ip", "-n", self.switch, "link", "set", f"p{self.nodes.index(node)}", "up" if up else "down")

    def teardown(self) -> None:
        for name in reversed(self.made):
            _kill_inside(name)
            _run("ip", "netns", "del", name, check=False)
        self.made.clear()
