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
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    SummaryMetricFamily,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from ps.tiers.wal import FSYNC_BUCKETS

__all__ = ["TierMetrics", "RpcMetrics", "LinkWatch", "NO_RPC_METRICS", "build_info",
           "process_labels", "process_registry", "serve_metrics"]

# RPC latencies span a decoded push (ms) to a BSP barrier or a pull's long-poll (seconds).
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_RPCS = {
    "push": "Push RPCs served, from the first frame received to the ack (includes the BSP barrier wait)",
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
        if self.link is not None:
            self.link.poll()
            up = self.link.up
            snap["link"] = dict(reachable=bool(up.reachable), errors=up.failures,
                                reconnects=self.link.reconnects)
        if self.tier.role == "global":
            snap["durability"] = _durability(self.tier)
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
        snap = self._snapshot()
        snap["version_age"] = self._version_ages(snap["status"])
        return _families(snap, self.labels)


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


def _families(snap: dict, labels: dict[str, str]) -> list:
    """Every scrape-time family from one snapshot (pure: unit-testable without a server)."""
    s = snap["status"]
    base_names, base = list(labels), list(labels.values())
    jl = [*base_names, "job"]
    is_relay = snap["link"] is not None
    ages = snap.get("version_age") or {}

    def gauge(name, doc, names=jl):
        return GaugeMetricFamily(name, doc, labels=names)

    def counter(name, doc, names=jl):
        return CounterMetricFamily(name, doc, labels=names)

    info = InfoMetricFamily("hps_tier", "This tier: its name and its parent's address",
                            labels=base_names)
    info.add_metric(base, {"name": s.name, "parent": s.parent or ""})
    jobs = gauge("hps_jobs", "Training jobs this tier holds", base_names)
    jobs.add_metric(base, len(s.jobs))
    children = gauge("hps_children", "Relay children that announced themselves by heartbeat "
                                     "within the member timeout", base_names)
    children.add_metric(base, len(s.children))
    ready = gauge("hps_ready", "1 once this tier has synced with its parent (the health "
                               "service's readiness answer), else 0", base_names)
    ready.add_metric(base, 1 if s.ready else 0)
    out = [info, jobs, children, ready]

    version = gauge("hps_version", "Published-view version this tier holds")
    lag_v = gauge("hps_replica_lag_versions", "Versions this replica trails its parent by, as far "
                                              "as it knows (0 at the root)")
    lag_s = gauge("hps_replica_lag_seconds", "Seconds since this replica last confirmed it held its "
                                             "parent's latest version, while behind or cut off (0 in sync)")
    members = gauge("hps_members", "Live members of the job at this tier (workers or child relays)")
    workers = gauge("hps_workers", "Live workers attached to this tier in the job (members that are "
                                   "workers, not relays)")
    lost = gauge("hps_members_lost", "Members dropped after the member timeout that have not come "
                                     "back (died or cut off; finished members leave and are not "
                                     "counted), by role: worker | relay", [*jl, "role"])
    age = gauge("hps_version_age_seconds", "Seconds since this tier's version of the job last "
                                           "changed (as seen at scrapes): at the root, time "
                                           "without a new version")
    open_round = gauge("hps_round_pushes", "Pushes collected in the open BSP round or window")
    pushes = counter("hps_pushes_total", "Pushes accepted from children (aggregated pushes from relays)")
    push_bytes = counter("hps_push_bytes_total", "Tensor payload bytes of pushes: received from "
                                                 "children (edge=children), sent to the parent "
                                                 "(edge=parent)", [*jl, "edge"])
    pull_bytes = counter("hps_pull_bytes_total", "Tensor payload bytes of pulls: served to children "
                                                 "(edge=children), received from the parent "
                                                 "(edge=parent)", [*jl, "edge"])
    # Before compression: what the same tensors decode to (float32). Only the children edge:
    # a tier's parent edge is its parent's children edge, where the same pushes and pulls are
    # counted. A push carries the job's whole gradient and a delta or snapshot its whole
    # vector, so this is the count times the job's size (a relay's rare 0-contributor push,
    # which only carries a clock floor, counts as one too).
    push_raw = counter("hps_push_decoded_bytes_total", "Bytes the pushes received from children "
                                                       "decode to (float32, before compression)",
                       [*jl, "edge"])
    pull_raw = counter("hps_pull_decoded_bytes_total", "Bytes the deltas and snapshots served to "
                                                       "children decode to (float32, before "
                                                       "compression)", [*jl, "edge"])
    hits = counter("hps_delta_log_hits_total", "Versions served to children as deltas from the delta log")
    fallbacks = counter("hps_snapshot_fallbacks_total", "Pulls answered with a full snapshot (the caller "
                                                        "had no view, fell behind the delta log, or "
                                                        "held another root epoch)")
    rounds = counter("hps_rounds_total", "BSP rounds (or ssp/async windows) closed at this tier")
    aborted = counter("hps_aborted_rounds_total", "Rounds aborted before they were applied (a tier "
                                                  "or the root restarted)")
    restarted = counter("hps_restarted_rounds_total", "Open rounds restarted because a member left, "
                                                      "timed out or was replaced with its push in them "
                                                      "(their other pushers resend)")
    refused = counter("hps_refused_rounds_total", "Closed rounds refused whole (a non-finite sum, a "
                                                  "failed durable write, a refusal from the parent)")
    dups = counter("hps_duplicate_pushes_total", "Retried pushes answered with the recorded "
                                                 "acknowledgement (applied once)")
    resolved = counter("hps_resolved_pushes_total", "Retries that could not be placed and whose outcome "
                                                    "was asked up the tree before answering")
    departures = counter("hps_member_departures_total", "Members that left the job at this tier, by "
                         "reason: left (said goodbye), expired (silent past the member timeout: a "
                         "dead or cut-off child, its round shrinks), replaced (restarted as a new "
                         "incarnation)", [*jl, "reason"])
    wait = SummaryMetricFamily("hps_barrier_wait_seconds", "Time accepted pushes waited for their "
                                                           "round (BSP barrier) or window to be "
                                                           "applied", labels=jl)
    bound = gauge("hps_job_staleness_bound", "The ssp job's staleness bound s, in worker clocks "
                                             "(steps); ssp jobs only")
    # What the workers below report with their pushes (loss, step time): summaries, so a mean
    # over any window is rate(_sum) / rate(_count); at the root they cover the whole job.
    w_loss = SummaryMetricFamily("hps_worker_loss", "Training losses the workers below this tier "
                                 "reported with their pushes", labels=jl)
    w_step = SummaryMetricFamily("hps_worker_step_seconds", "Wall time of the workers' steps "
                                 "(compute, push and pull) as they reported them", labels=jl)
    out += [version, lag_v, lag_s, members, workers, lost, age, open_round, pushes, push_bytes, pull_bytes, push_raw,
            pull_raw, hits, fallbacks, rounds, aborted, restarted, refused, dups, resolved, departures,
            wait, bound, w_loss, w_step]
    staleness = stale_max = None
    if s.role == "global":
        # A summary, not a histogram: the root keeps only the count, sum and maximum.
        staleness = SummaryMetricFamily("hps_update_staleness_versions", "Versions between the view "
                                        "an update was computed on and the one it was applied to",
                                        labels=jl)
        stale_max = gauge("hps_update_staleness_max_versions", "The largest staleness observed "
                                                               "since the root started")
        doubled = counter("hps_double_applied_pushes_total", "Worker pushes the root applied in a second "
                          "version (exactly-once broken: must stay 0; logged CRITICAL)")
        not_durable = counter("hps_durable_write_failures_total", "Versions refused because their "
                              "write-ahead-log record could not be made durable (disk full, I/O error)")
        ckpt_failed = counter("hps_checkpoint_failures_total", "Checkpoints that failed to write (the log "
                              "still covers them)")
        # In worker clocks (steps), the unit of an ssp bound: how far the newest clock in an
        # update ran ahead of the clock floor of the view it was applied to.
        clocks = SummaryMetricFamily("hps_update_staleness_clocks", "Worker clocks between the newest "
                                     "clock in an update and the clock floor of the view it was "
                                     "applied to (an ssp(s) job keeps it <= s)", labels=jl)
        clocks_max = gauge("hps_update_staleness_max_clocks", "The largest clock staleness observed "
                                                              "since the root started")
        over = counter("hps_updates_over_bound_total", "Updates of ssp jobs whose clock staleness "
                       "exceeded the job's bound s (invariant 3 broken: must stay 0)")
        out += [staleness, stale_max, doubled, not_durable, ckpt_failed, clocks, clocks_max, over]

    for j in s.jobs:
        lv, st = [*base, j.name], j.stats
        version.add_metric(lv, j.version)
        lag_v.add_metric(lv, j.lag_versions)
        lag_s.add_metric(lv, j.lag_s)
        members.add_metric(lv, len(j.members))
        workers.add_metric(lv, sum(1 for m in j.members if m.role == "worker"))
        for role in ("worker", "relay"):
            lost.add_metric([*lv, role], sum(1 for m in j.lost if (m.role == "worker") == (role == "worker")))
            # (a relay child's role is its tier's, regional or zone: one bounded "relay" here)
        if j.name in ages:
            age.add_metric(lv, ages[j.name])
        open_round.add_metric(lv, j.round_pushed)
        pushes.add_metric(lv, st.pushes)
        push_bytes.add_metric([*lv, "children"], st.bytes_pushed_in)
        pull_bytes.add_metric([*lv, "children"], st.bytes_pulled_out)
        size = 4 * j.parameters
        push_raw.add_metric([*lv, "children"], st.pushes * size)
        pull_raw.add_metric([*lv, "children"], (st.deltas_served + st.snapshots_served) * size)
        if j.mode == "ssp":
            bound.add_metric(lv, j.staleness)
        if is_relay:
            push_bytes.add_metric([*lv, "parent"], st.bytes_pushed_up)
            pull_bytes.add_metric([*lv, "parent"], st.bytes_pulled_in)
        hits.add_metric(lv, st.deltas_served)
        fallbacks.add_metric(lv, st.snapshots_served)
        rounds.add_metric(lv, st.rounds)
        aborted.add_metric(lv, st.aborted_rounds)
        restarted.add_metric(lv, st.restarted_rounds)
        refused.add_metric(lv, st.refused_rounds)
        dups.add_metric(lv, st.duplicates)
        resolved.add_metric(lv, st.resolved)
        for reason in ("left", "expired", "replaced"):
            departures.add_metric([*lv, reason], getattr(st, f"members_{reason}"))
        wait.add_metric(lv, count_value=st.pushes, sum_value=st.round_wait_ms_sum / 1000.0)
        w_loss.add_metric(lv, count_value=st.loss_count, sum_value=st.loss_sum)
        w_step.add_metric(lv, count_value=st.loss_count, sum_value=st.step_seconds_sum)
        if staleness is not None:
            staleness.add_metric(lv, count_value=st.staleness_count, sum_value=st.staleness_sum)
            stale_max.add_metric(lv, st.staleness_max)
            doubled.add_metric(lv, st.double_applied)
            not_durable.add_metric(lv, st.durable_failures)
            ckpt_failed.add_metric(lv, st.checkpoint_failures)
            clocks.add_metric(lv, count_value=st.clock_staleness_count, sum_value=st.clock_staleness_sum)
            clocks_max.add_metric(lv, st.clock_staleness_max)
            over.add_metric(lv, st.over_bound)

    if is_relay:
        link = snap["link"]
        reach = gauge("hps_upstream_reachable", "1 if the last call to the parent succeeded, else 0",
                      base_names)
        reach.add_metric(base, 1 if link["reachable"] else 0)
        errors = counter("hps_upstream_errors_total", "Calls to the parent that failed as unavailable "
                                                      "or timed out", base_names)
        errors.add_metric(base, link["errors"])
        again = counter("hps_upstream_reconnects_total", "Times the link to the parent answered again "
                                                         "after failing", base_names)
        again.add_metric(base, link["reconnects"])
        out += [reach, errors, again]
    if snap.get("durability") is not None:
        out += _durability_families(snap["durability"], base_names, base)
    return out


def _durability_families(d: dict, base_names: list[str], base: list[str]) -> list:
    """The root's durability: when each job's last checkpoint was written and how long it took,
    the write-ahead log's fsync latency, and the checkpoint volume's space."""
    jl = [*base_names, "job"]
    when = GaugeMetricFamily("hps_checkpoint_last_success_timestamp_seconds", "Unix time the job's "
                             "last checkpoint was written (absent until the first one)", labels=jl)
    took = GaugeMetricFamily("hps_checkpoint_last_duration_seconds", "How long the job's last "
                             "checkpoint took to write (off the event loop)", labels=jl)
    fsync = HistogramMetricFamily("hps_wal_fsync_seconds", "Write-ahead-log fsyncs (every "
                                  "acknowledged version waits for one)", labels=jl)
    appended = CounterMetricFamily("hps_wal_bytes_written_total", "Bytes appended to the job's "
                                   "write-ahead log", labels=jl)
    for name, j in sorted(d["jobs"].items()):
        lv = [*base, name]
        if j["checkpoint"] is not None:
            t, secs, _version = j["checkpoint"]
            when.add_metric(lv, t)
            took.add_metric(lv, secs)
        w = j["wal"]
        if w is not None:
            cumulative, total = [], 0
            for le, n in zip(FSYNC_BUCKETS, w.fsync_buckets):
                total += n
                cumulative.append((repr(le), total))
            cumulative.append(("+Inf", w.appends))
            fsync.add_metric(lv, cumulative, sum_value=w.total_fsync_s)
            appended.add_metric(lv, w.bytes_written)
    out = [when, took, fsync, appended]
    if d["volume"] is not None:
        used = GaugeMetricFamily("hps_checkpoint_volume_used_bytes", "Bytes used on the volume "
                                 "that holds the checkpoints and write-ahead logs", labels=base_names)
        free = GaugeMetricFamily("hps_checkpoint_volume_free_bytes", "Bytes this process may still "
                                 "write on that volume", labels=base_names)
        used.add_metric(base, d["volume"].used)
        free.add_metric(base, d["volume"].free)
        out += [used, free]
    return out


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
