"""Prometheus metrics of a tier, computed from its state at scrape time.

    registry = CollectorRegistry()
    registry.register(TierCollector(tier))
    port = start_metrics(tier, 0)          # /metrics over HTTP

Nothing is mirrored into gauges on the hot path: the collector reads ``tier.status()`` when
Prometheus scrapes. Labels are bounded (tier role, tier name, job); never a key or worker id.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["TierCollector", "start_metrics"]

_COUNTERS = {
    "pushes": ("hps_pushes_total", "Pushes accepted from children"),
    "bytes_pushed_in": ("hps_push_received_bytes_total", "Payload bytes received in pushes from children"),
    "bytes_pushed_up": ("hps_push_sent_bytes_total", "Payload bytes sent in pushes to the parent"),
    "bytes_pulled_out": ("hps_pull_served_bytes_total", "Payload bytes served to children in pulls"),
    "bytes_pulled_in": ("hps_pull_received_bytes_total", "Payload bytes received from the parent in pulls"),
    "snapshots_served": ("hps_snapshots_served_total", "Pulls answered with a snapshot"),
    "deltas_served": ("hps_deltas_served_total", "Delta versions served from the delta log"),
    "rounds": ("hps_rounds_total", "BSP rounds closed at this tier"),
    "aborted_rounds": ("hps_aborted_rounds_total", "BSP rounds aborted (a tier or the root restarted)"),
}


class TierCollector:
    def __init__(self, tier) -> None:
        self.tier = tier

    def collect(self):
        s = self.tier.status()
        labels = ["tier", "name", "job"]
        gauges = {
            "version": GaugeMetricFamily("hps_version", "Published-view version this tier holds", labels=labels),
            "members": GaugeMetricFamily("hps_members", "Live children registered in the job", labels=labels),
            "lag_v": GaugeMetricFamily("hps_replica_lag_versions", "Versions behind the parent", labels=labels),
            "lag_s": GaugeMetricFamily("hps_replica_lag_seconds", "Seconds since last caught up with the parent",
                                       labels=labels),
        }
        counters = {k: CounterMetricFamily(n[: -len("_total")], h, labels=labels) for k, (n, h) in _COUNTERS.items()}
        for j in s["jobs"]:
            lv = [s["role"], s["name"], j["name"]]
            gauges["version"].add_metric(lv, j["version"])
            gauges["members"].add_metric(lv, len(j["members"]))
            gauges["lag_v"].add_metric(lv, max(0, j["parent_version"] - j["version"]))
            gauges["lag_s"].add_metric(lv, j["lag_s"])
            for k, fam in counters.items():
                fam.add_metric(lv, j[k])
        up = GaugeMetricFamily("hps_uptime_seconds", "Seconds since this tier started", labels=["tier", "name"])
        up.add_metric([s["role"], s["name"]], s["uptime_s"])
        yield up
        yield from gauges.values()
        yield from counters.values()


def start_metrics(tier, port: int, addr: str = "127.0.0.1") -> int:
    """Serve /metrics for ``tier``; returns the bound port."""
    registry = CollectorRegistry()
    registry.register(TierCollector(tier))
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server.server_port
