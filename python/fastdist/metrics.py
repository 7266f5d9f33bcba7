"""Prometheus metrics on each rank: ``fastdist.serve_metrics(port)``, or
``FASTDIST_METRICS_PORT=PORT`` (``PORT + LOCAL_RANK`` on each rank of a host) read by
``fastdist.init_process_group``. Needs ``prometheus_client`` (``pip install fastdist[metrics]``).

Everything is read when scraped, from what fastdist keeps anyway: the op count and the collective
durations from each watched group's history ring (and the rings of generations that recovery
replaced since; ops that left the 64-op ring between two scrapes are counted, but their
durations are not observed), the faults, recoveries, shrinks and replacements from
fastdist.diagnostics.events. Nothing is added to an op's path.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

from .diagnostics import events
from .errors import MetricsPortError
from .groups import pgstate, registry

logger = logging.getLogger(__name__)

PORT_ENV = "FASTDIST_METRICS_PORT"
# Collective durations (seconds): 100 us to 5 min.
BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 300.0)
# Detection and recovery (seconds).
SLOW_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# A scrape connection that sends nothing, or stops halfway, is closed after this long (seconds
# per read or write); Prometheus' own scrape timeout is 10 s.
CONNECTION_SECONDS = 10.0
# Scrapes answered at once; one more connection is closed unanswered (no thread for it).
MAX_CONNECTIONS = 8

_lock = threading.Lock()
_servers: dict[int, Any] = {}


class _Histogram:
    """A cumulative histogram fed from the history rings, one new op at a time."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        i = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[i] += 1
        self.total += value

    def family_buckets(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for b, n in zip((*self.buckets, float("inf")), self.counts):
            running += n
            out.append(("+Inf" if b == float("inf") else repr(b), float(running)))
        return out


class _Collector:
    def __init__(self) -> None:
        self.last: dict[str, int] = {}  # group -> newest seq seen in its history
        self.ops: dict[str, int] = {}  # group -> ops counted so far
        self.durations: dict[tuple[str, str], _Histogram] = {}

    def _observe(self, group: str, history: list[dict[str, Any]]) -> None:
        """Counts and times the ops of ``history`` that ended since the last look."""
        finished = [h for h in history if h["end"] is not None]
        newest = max((int(h["seq"]) for h in finished), default=0)
        before = self.last.get(group, 0)
        if newest < before:  # numbered afresh (a group rebuilt under the same name, unseen)
            before = 0
        for h in finished:
            if int(h["seq"]) > before:
                hist = self.durations.setdefault((group, str(h["op"])), _Histogram(BUCKETS))
                hist.observe(float(h["end"]) - float(h["start"]))
        self.ops[group] = self.ops.get(group, 0) + max(0, newest - before)
        self.last[group] = max(newest, before)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        ops = CounterMetricFamily("fastdist_ops", "Ops on a watched group that ended", labels=["group"])
        duration = HistogramMetricFamily(
            "fastdist_collective_duration_seconds",
            "Issue to end of ops on watched groups",
            labels=["group", "op"],
        )
        generation = GaugeMetricFamily(
            "fastdist_generation", "The group's recovery generation", labels=["group"]
        )
        size = GaugeMetricFamily("fastdist_world_size", "The group's size", labels=["group"])
        with _lock:
            for name, generations in events.take_retired().items():
                for history in generations:  # a generation recovery replaced: read it to its end
                    self._observe(name, history)
                    self.last[name] = 0  # the next generation numbers its ops afresh
            for pg in registry.watched_groups():
                st = pgstate.state_of(pg)
                self._observe(st.name, registry.history(pg))
                generation.add_metric([st.name], float(st.generation))
                size.add_metric([st.name], float(st.size))
            for name, n in sorted(self.ops.items()):
                ops.add_metric([name], float(n))
            for (group, op), hist in sorted(self.durations.items()):
                duration.add_metric([group, op], hist.family_buckets(), hist.total)
        yield ops
        yield duration
        yield generation
        yield size
        faults = CounterMetricFamily(
            "fastdist_events", "Faults, recoveries, shrinks and replacements", labels=["event", "group", "op"]
        )
        with events._lock:
            counts = sorted(events.counts.items())
            observed = {k: list(v) for k, v in events.durations.items()}
            straggler = {g: v.get("straggler") for g, v in events.gauges.items() if v.get("straggler")}
        for (event, group, op), n in counts:
            faults.add_metric([event, group, op], float(n))
        yield faults
        for name, doc in (
            ("detection", "An op's start to its timeout error"),
            ("recovery", "recover() call to return"),
        ):
            hist = _Histogram(SLOW_BUCKETS)
            for v in observed.get(name, []):
                hist.observe(v)
            fam = HistogramMetricFamily(f"fastdist_{name}_seconds", doc)
            fam.add_metric([], hist.family_buckets(), hist.total)
            yield fam
        hint = GaugeMetricFamily(
            "fastdist_straggler",
            "1 for the group's last straggler hint (in the label)",
            labels=["group", "hint"],
        )
        for group, text in sorted(straggler.items()):
            hint.add_metric([group, str(text)], 1.0)
        yield hint


def _server_class(handler: type[Any]) -> Any:
    """An HTTP server that answers each connection in a thread of its own, so that a connection
    that sends nothing (or half a request) holds up only itself, and only for
    ``CONNECTION_SECONDS``; beyond ``MAX_CONNECTIONS`` at once, a new one is closed unanswered."""
    import http.server  # here, not at import: `import fastdist` imports nothing torch does not
    import socketserver

    class Handler(handler):  # type: ignore[misc]
        # socketserver sets this on the connection: an idle or half-sent one ends after it.
        timeout = CONNECTION_SECONDS

    class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
        daemon_threads = True  # a scrape in flight never holds up the rank's exit
        block_on_close = False

        def __init__(self, address: tuple[str, int]) -> None:
            super().__init__(address, Handler)
            self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

        def process_request(self, request: Any, client_address: Any) -> None:
            if not self.slots.acquire(blocking=False):
                self.shutdown_request(request)  # a flood of connections costs no more threads
                return
            super().process_request(request, client_address)

        def process_request_thread(self, request: Any, client_address: Any) -> None:
            try:
                super().process_request_thread(request, client_address)
            finally:
                self.slots.release()

        def handle_error(self, request: Any, client_address: Any) -> None:
            # (socketserver prints a traceback to stderr: a scraper that hung up is no news)
            logger.debug("fastdist metrics: a scrape from %s failed: %r", client_address, sys.exc_info()[1])

    return Server


def serve_metrics(port: int, addr: str = "0.0.0.0") -> int:
    """Serves this process's metrics in Prometheus' text format on ``addr:port`` (a thread per
    scrape, each connection bounded by ``CONNECTION_SECONDS``; idempotent per port). Returns the
    port (``port=0``: one picked). A port that cannot be had (taken by another process) raises
    :class:`fastdist.MetricsPortError` naming it."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in 0..65535, got {port!r}")
    try:
        from prometheus_client import CollectorRegistry, MetricsHandler
    except ImportError:
        raise ImportError(
            "fastdist metrics need prometheus_client: pip install 'fastdist[metrics]'"
        ) from None
    with _lock:
        if port and port in _servers:
            return port
        reg = CollectorRegistry(auto_describe=False)
        reg.register(_Collector())
        try:
            server = _server_class(MetricsHandler.factory(reg))((addr, port))
        except OSError as exc:
            raise MetricsPortError(
                address=addr, port=port, code=exc.errno, reason=exc.strerror or str(exc)
            ) from exc
        threading.Thread(target=server.serve_forever, name="fastdist-metrics", daemon=True).start()
        bound = int(server.server_port)
        _servers[bound] = server
        return bound


def serve_from_environment() -> int | None:
    """``FASTDIST_METRICS_PORT`` (plus LOCAL_RANK, so that the ranks of a host differ), if set.
    A port that cannot be had is a warning, not an error: metrics never stop training."""
    raw = os.environ.get(PORT_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ValueError(f"{PORT_ENV} must be a port number, got {raw!r}")
    port = int(raw) + int(os.environ.get("LOCAL_RANK", "0") or 0)
    try:
        return serve_metrics(port)
    except MetricsPortError as exc:
        logger.warning("rank %s: %s; training goes on without metrics", os.environ.get("RANK", "?"), exc)
        return None
