"""Prometheus metrics of every tier, registry injected (a training script's own: worker.metrics).

>>> from urllib.request import urlopen
>>> from ps.core.config import ServerConfig
>>> from ps.tiers.relay import Relay
>>> async def scrape(parent):
...     zone = Relay(ServerConfig(role="zone", parent=parent, name="eu-a"))
...     registry = CollectorRegistry()          # a server: process_registry()
...     metrics = TierMetrics(zone, registry)   # on the tier's event loop
...     await zone.start(); metrics.start()     # relays: watch the upstream link
...     while not zone.synced(): await asyncio.sleep(0.05)      # the parent's first answer
...     httpd = serve_metrics(registry, 0)      # GET /metrics (a server: 9100, host="0.0.0.0")
...     url = f"http://127.0.0.1:{httpd.server_port}/metrics"
...     page = (await asyncio.to_thread(urlopen, url)).read().decode()   # scrapes wait for the loop
...     await metrics.stop(); await zone.stop(); httpd.shutdown()
...     return [line for line in page.splitlines() if line.startswith(("hps_ready", "hps_upstream_reach"))]
>>> asyncio.run(scrape(address))
['hps_ready{tier="zone",zone="eu-a"} 1.0', 'hps_upstream_reachable{tier="zone",zone="eu-a"} 1.0']

A server also hands ``metrics.rpc`` to its servicer (``handler(tier, metrics.rpc)``), which
times every Push, Pull and Register.

Names follow the Prometheus conventions: counters end in ``_total``, units are base units in
the name (``_seconds``, ``_bytes``). Labels are bounded: ``tier`` (global|regional|zone),
``region`` and ``zone`` where the process knows them (a regional master is its region, a zone
replica its zone; the scrape config adds a zone's region), ``job`` (the training job) and
``edge`` (``children``: this tier's side of the links below it; ``parent``: the link above).
Never a key or a worker id.

Values derived from state (versions, lag, members, the byte counters the tier keeps) are read
when Prometheus scrapes, by a collector that takes one snapshot on the tier's event loop (the
HTTP server answers in its own thread, and the tier's dicts are only consistent on the loop).
Only RPC latencies are instrumented: histograms the service observes (``RpcMetrics``).
"""

from __future__ import annotations

import asyncio
import platform
import shutil
import time
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import (
    GaugeMetricFamily,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from ps.tiers.families import families

__all__ = ["TierMetrics", "RpcMetrics", "LinkWatch", "NO_RPC_METRICS", "build_info",
           "process_labels", "process_registry", "serve_metrics"]

# RPC latencies span a decoded push (ms) to a BSP barrier or a pull's long-poll (seconds).
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_RPCS = {
    "push": "Push RPCs served, from the first frame received to the ack (includes the BSP barrier wait, "
            "and for a worker streaming from backward hooks, overlap=True, the rest of its backward)",
    "pull": "Pull RPCs served, from the request to the last frame sent (includes the long-poll wait)",
    "register": "Register RPCs served (a relay's first register of a job goes to its parent)",
}
_UNKNOWN_JOB = "_unknown"  # a call naming a job this tier does not hold: one bounded label value


def process_labels(tier) -> dict[str, str]:
    """The labels that identify this process's series: its role, and its region or zone."""
    labels = {"tier": tier.role}
    name = tier.config.display_name
    if tier.role == "regional":
        labels["region"] = name
    elif tier.role == "zone":
        labels["zone"] = name
    return labels


def _dist(name: str) -> str:
    try:
        return dist_version(name)
    except PackageNotFoundError:
        return "none"


def build_info() -> dict[str, str]:
    """What this process runs (hps_build_info's labels): read from the installed packages'
    metadata, so no torch import in a tier that does not need it."""
    from ps import __version__
    return {"version": __version__, "python": platform.python_version(), "grpc": _dist("grpcio"),
            "torch": _dist("torch")}


class _BuildInfo:
    """hps_build_info: constant 1 with the versions as labels (the Prometheus idiom, so a
    `* on (instance) group_left (version)` join can put the version on any alert)."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = {**labels, **build_info()}

    def describe(self):
        return []

    def collect(self):
        g = GaugeMetricFamily("hps_build_info", "Versions this tier runs (hps, Python, grpcio, torch); "
                              "always 1", labels=list(self.labels))
        g.add_metric(list(self.labels.values()), 1)
        return [g]


def process_registry() -> CollectorRegistry:
    """A fresh registry with the standard process, platform and GC collectors."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1"):
    """Serve GET /metrics for ``registry`` on HOST:PORT (0: any free port) in a daemon thread.

    Returns the HTTP server: ``.server_port`` is the bound port, ``.shutdown()`` stops it."""
    httpd, _thread = start_http_server(port, addr=host.strip("[]"), registry=registry)
    return httpd


# -- RPC latencies (instrumented) ----------------------------------------------------------------
class _Timing:
    __slots__ = ("job",)

    def __init__(self) -> None:
        self.job = ""


class RpcMetrics:
    """Latency histograms of the Push, Pull and Register RPCs, labelled by job.

        with rpc.timed("push") as t:
            meta, chunks = decode_push(frames)
            t.job = meta.job
            ...
    """

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str], known_job=None) -> None:
        self._base = dict(labels)
        self._known = known_job or (lambda job: True)
        names = [*self._base, "job"]
        self._hist = {m: Histogram(f"hps_{m}_duration_seconds", doc, names, registry=registry,
                                   buckets=_BUCKETS) for m, doc in _RPCS.items()}
        # By method and status code only: both sets are small and fixed (no job, no caller).
        self._errors = Counter("hps_rpc_errors_total", "RPCs this tier refused or failed, by method "
                               "and gRPC status code", [*self._base, "method", "code"], registry=registry)

    def error(self, method: str, code: str) -> None:
        self._errors.labels(**self._base, method=method, code=code).inc()

    @contextmanager
    def timed(self, rpc: str):
        t, t0 = _Timing(), time.perf_counter()
        try:
            yield t
        finally:
            # Only jobs the tier holds become label values: a client naming random jobs
            # must not grow the series set.
            job = t.job if t.job and self._known(t.job) else _UNKNOWN_JOB
            self._hist[rpc].labels(**self._base, job=job).observe(time.perf_counter() - t0)


class _NoRpcMetrics:
    @contextmanager
    def timed(self, rpc: str):
        yield _Timing()

    def error(self, method: str, code: str) -> None:
        pass


NO_RPC_METRICS = _NoRpcMetrics()


# -- the upstream link ---------------------------------------------------------------------------
class LinkWatch:
    """Counts a relay's upstream reconnects: the link answering again after it had failed.

    ``Upstream`` keeps only whether the last call succeeded (``reachable``), so this polls it a
    few times per heartbeat (every relay call site flips it: heartbeat, pull, push) and at every
    scrape. An outage shorter than one poll that no call saw is not counted; none is counted
    twice. (If Upstream counted reconnects itself, this poller could go.)
    """

    def __init__(self, up, poll_s: float) -> None:
        self.up = up
        self.poll_s = poll_s
        self.reconnects = 0
        self._ever_up = False
        self._was_up = False
        self._task: asyncio.Task | None = None

    def poll(self) -> None:
        now_up = bool(self.up.reachable)
        if now_up and not self._was_up and self._ever_up:
            self.reconnects += 1
        self._ever_up = self._ever_up or now_up
        self._was_up = now_up

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="link-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            self.poll()
            await asyncio.sleep(self.poll_s)


# -- state read at scrape time -------------------------------------------------------------------
class _TierCollector:
    def __init__(self, tier, loop: asyncio.AbstractEventLoop, labels: dict[str, str],
                 link: LinkWatch | None, timeout_s: float = 5.0) -> None:
        self.tier = tier
        self.loop = loop
        self.labels = labels
        self.link = link
        self.timeout_s = timeout_s
        self._seen: dict[str, tuple[int, int, float]] = {}  # job -> (epoch, version, first seen)

    def _read(self) -> dict:
        """One consistent snapshot; runs on the tier's loop."""
        snap = dict(status=self.tier.status(), link=None, durability=None)
        # Here, on the loop, not in collect(): the HTTP server answers each scrape in a thread of
        # its own, and two at once (an HA Prometheus pair) raced on ``_seen`` (a KeyError: a 500).
        snap["version_age"] = self._version_ages(snap["status"])
        if self.link is not None:
            self.link.poll()
            up = self.link.up
            snap["link"] = dict(reachable=bool(up.reachable), errors=up.failures,
                                reconnects=self.link.reconnects)
        if self.tier.role == "global":
            snap["durability"] = _durability(self.tier)
            root = self.tier
            # A hot-standby pair (issue 15): whether a configured standby is in sync with this
            # primary (None: no pair, no series).
            snap["standby"] = None if not root.peer else dict(
                state=root.state, term=root.term, in_sync=bool(root.replication.in_sync()))
        return snap

    def _version_ages(self, status) -> dict[str, float]:
        """Seconds since each job's version last changed here, as seen at scrapes (so to within
        a scrape interval). Kept by the collector rather than the tier: only alerts need it."""
        now = time.monotonic()
        ages = {}
        for j in status.jobs:
            key = (j.view_epoch, j.version)
            seen = self._seen.get(j.name)
            if seen is None or seen[:2] != key:
                seen = self._seen[j.name] = (*key, now)
            ages[j.name] = now - seen[2]
        for name in set(self._seen) - set(ages):
            del self._seen[name]
        return ages

    def _snapshot(self) -> dict:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            return self._read()

        async def read() -> dict:
            return self._read()
        # A loop that does not answer within the timeout fails the scrape: `up` goes to 0,
        # which is the right signal for a wedged tier.
        return asyncio.run_coroutine_threadsafe(read(), self.loop).result(self.timeout_s)

    def describe(self):
        return []  # names are fixed per module; nothing to reserve ahead of the first scrape

    def collect(self):
        return families(self._snapshot(), self.labels)


def _durability(root) -> dict:
    """The root's checkpoints and logs, per job, and its checkpoint volume (on the loop)."""
    jobs = {}
    for name, js in root.jobs.items():
        wal = getattr(js, "wal", None)
        jobs[name] = dict(checkpoint=getattr(js, "last_checkpoint", None),
                          wal=None if wal is None else wal.stats)
    volume = None
    directory = root.config.checkpoint_dir
    if directory:
        try:
            volume = shutil.disk_usage(directory)
        except OSError:
            volume = None  # not created yet, or gone: no series rather than a wrong one
    return dict(jobs=jobs, volume=volume)


class TierMetrics:
    """Everything a tier exports, registered in ``registry``; build it on the tier's loop."""

    def __init__(self, tier, registry: CollectorRegistry, scrape_timeout_s: float = 5.0) -> None:
        self.tier = tier
        self.registry = registry
        self.labels = process_labels(tier)
        up = tier.parent_link()
        self.link = LinkWatch(up, max(0.02, tier.config.heartbeat_s / 4)) if up is not None else None
        self.rpc = RpcMetrics(registry, self.labels, known_job=lambda job: job in tier.jobs)
        registry.register(_BuildInfo(self.labels))
        registry.register(_TierCollector(tier, asyncio.get_running_loop(), self.labels, self.link,
                                         scrape_timeout_s))

    def start(self) -> None:
        if self.link is not None:
            self.link.start()

    async def stop(self) -> None:
        if self.link is not None:
            await self.link.stop()
