"""ps.tiers.metrics without a server: lag from a state snapshot, bounded labels, training metrics,
reconnect counting, and promtool's lint of what the families render to."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ps.core.types import JobStats, JobStatus, MemberInfo, TierStatus
from ps.tiers.families import families as _families
from ps.tiers.metrics import LinkWatch, RpcMetrics, _BuildInfo
from ps.tiers.wal import WalStats
from worker.metrics import TrainingMetrics


def _job(**kw) -> JobStatus:
    stats = JobStats(pushes=8, bytes_pushed_in=800, bytes_pulled_out=400, bytes_pushed_up=200,
                     bytes_pulled_in=100, deltas_served=6, snapshots_served=2, rounds=4,
                     restarted_rounds=1, duplicates=2, resolved=1, members_left=1,
                     round_wait_ms_sum=1500, loss_sum=6.0, loss_count=3, step_seconds_sum=0.3,
                     staleness_count=3, staleness_sum=6, staleness_max=4, clock_staleness_count=3,
                     clock_staleness_sum=3, clock_staleness_max=2, over_bound=0)
    members = (MemberInfo("w0", "worker", "", 0.1), MemberInfo("w1", "worker", "", 0.2),
               MemberInfo("z9", "zone", "", 0.2))
    lost = (MemberInfo("w7", "worker", "", 4.0), MemberInfo("w8", "worker", "", 9.0),
            MemberInfo("eu-b", "zone", "", 1.0))
    job = dict(name="lm", mode="ssp", staleness=2, version=10, view_epoch=7, checksum=1, parent_version=10,
               lag_s=0.0, round=4, round_pushed=1, clock_min=3, parameters=25, members=members, stats=stats,
               lost=lost)
    return JobStatus(**{**job, **kw})


def _snap(role: str, link: dict | None, durability: dict | None = None, **job) -> dict:
    status = TierStatus(role=role, name="eu-a", server_epoch=9, parent="region:7000" if link else "",
                        parent_reachable=link is None or link["reachable"], ready=True, uptime_s=5.0,
                        jobs=(_job(**job),))
    return dict(status=status, link=link, durability=durability, version_age={"lm": 7.5})


def _durability() -> dict:
    wal = WalStats(appends=5, bytes_written=4096, total_fsync_s=0.02)
    for dt in (0.0001, 0.0002, 0.003, 0.004, 0.7):
        wal.fsynced(dt)
    wal.total_fsync_s = 0.7073
    return dict(jobs={"lm": dict(checkpoint=(1.7e9, 0.25, 10), wal=wal)},
                volume=shutil._ntuple_diskusage(100, 60, 40))


class _Families:
    """A collector over fixed families, to render them as a scrape would."""

    def __init__(self, fams) -> None:
        self.fams = fams

    def collect(self):
        return self.fams


def _render(fams) -> str:
    registry = CollectorRegistry()
    registry.register(_Families(fams))
    return generate_latest(registry).decode()


def _value(text: str, name: str, **labels) -> float:
    (v,) = [s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name and all(s.labels.get(k) == x for k, x in labels.items())]
    return v


_UP = dict(reachable=True, errors=0, reconnects=0)


def test_families_render_state_with_bounded_labels():
    text = _render(_families(_snap("zone", _UP, parent_version=12, lag_s=10.0), {"tier": "zone", "zone": "eu-a"}))
    lz = dict(tier="zone", zone="eu-a", job="lm")
    assert _value(text, "hps_replica_lag_versions", **lz) == 2
    assert _value(text, "hps_replica_lag_seconds", **lz) == 10.0
    assert _value(text, "hps_members", **lz) == 3
    assert _value(text, "hps_workers", **lz) == 2
    assert _value(text, "hps_members_lost", role="worker", **lz) == 2
    assert _value(text, "hps_members_lost", role="relay", **lz) == 1
    assert _value(text, "hps_version_age_seconds", **lz) == 7.5
    assert _value(text, "hps_push_bytes_total", edge="children", **lz) == 800
    assert _value(text, "hps_push_bytes_total", edge="parent", **lz) == 200
    assert _value(text, "hps_push_decoded_bytes_total", edge="children", **lz) == 8 * 25 * 4
    assert _value(text, "hps_pull_decoded_bytes_total", edge="children", **lz) == (6 + 2) * 25 * 4
    assert _value(text, "hps_barrier_wait_seconds_sum", **lz) == 1.5
    assert _value(text, "hps_job_staleness_bound", **lz) == 2
    assert _value(text, "hps_upstream_reachable", tier="zone", zone="eu-a") == 1
    labels = {k for f in text_string_to_metric_families(text) for s in f.samples for k in s.labels}
    # reason: left | expired | replaced (member departures), a fixed set like edge's.
    # reason: left | expired | replaced (member departures), role: worker | relay (lost), fixed
    # sets like edge's.
    assert labels <= {"tier", "region", "zone", "job", "edge", "reason", "role", "name", "parent",
                      "quantile"}
    assert "hps_checkpoint_volume_free_bytes" not in text  # the root's only
    # The root: staleness (in versions and in clocks), durability, no parent edge, no link.
    text = _render(_families(_snap("global", None, _durability()), {"tier": "global"}))
    assert _value(text, "hps_update_staleness_versions_sum", job="lm") == 6
    assert _value(text, "hps_update_staleness_max_versions", job="lm") == 4
    assert _value(text, "hps_update_staleness_clocks_sum", job="lm") == 3
    assert _value(text, "hps_update_staleness_max_clocks", job="lm") == 2
    assert _value(text, "hps_updates_over_bound_total", job="lm") == 0
    assert _value(text, "hps_checkpoint_last_success_timestamp_seconds", job="lm") == 1.7e9
    assert _value(text, "hps_checkpoint_last_duration_seconds", job="lm") == 0.25
    assert _value(text, "hps_wal_fsync_seconds_bucket", job="lm", le="0.0005") == 2
    assert _value(text, "hps_wal_fsync_seconds_bucket", job="lm", le="0.005") == 4
    assert _value(text, "hps_wal_fsync_seconds_bucket", job="lm", le="+Inf") == 5
    assert _value(text, "hps_wal_fsync_seconds_count", job="lm") == 5
    assert _value(text, "hps_checkpoint_volume_free_bytes", tier="global") == 40
    assert _value(text, "hps_checkpoint_volume_used_bytes", tier="global") == 60
    assert "edge=\"parent\"" not in text and "hps_upstream_reachable" not in text


def test_build_info_names_the_versions_as_constant_labels():
    registry = CollectorRegistry()
    registry.register(_BuildInfo({"tier": "global"}))
    text = generate_latest(registry).decode()
    (sample,) = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert sample.name == "hps_build_info" and sample.value == 1
    assert set(sample.labels) == {"tier", "version", "python", "grpc", "torch"}
    assert sample.labels["version"] == __import__("ps").__version__


def test_rpc_errors_are_counted_by_method_and_code():
    registry = CollectorRegistry()
    rpc = RpcMetrics(registry, {"tier": "zone"})
    rpc.error("push", "UNAVAILABLE")
    rpc.error("push", "UNAVAILABLE")
    rpc.error("pull", "NOT_FOUND")
    text = generate_latest(registry).decode()
    assert _value(text, "hps_rpc_errors_total", method="push", code="UNAVAILABLE") == 2
    assert _value(text, "hps_rpc_errors_total", method="pull", code="NOT_FOUND") == 1


def test_rpc_latency_labels_only_jobs_the_tier_holds():
    registry = CollectorRegistry()
    rpc = RpcMetrics(registry, {"tier": "zone"}, known_job=lambda job: job == "lm")
    for job in ("lm", "random-1", "random-2", ""):
        with rpc.timed("push") as t:
            t.job = job
    text = generate_latest(registry).decode()
    assert _value(text, "hps_push_duration_seconds_count", job="lm") == 1
    assert _value(text, "hps_push_duration_seconds_count", job="_unknown") == 3


def test_training_metrics_count_steps_and_step_time():
    registry = CollectorRegistry()
    train = TrainingMetrics("lm", registry)
    train.report(loss=2.5, steps=4, seconds=2.0)
    train.report(loss=2.25, steps=2)
    text = generate_latest(registry).decode()
    assert _value(text, "hps_training_loss", job="lm") == 2.25
    assert _value(text, "hps_training_steps_total", job="lm") == 6
    assert _value(text, "hps_training_step_duration_seconds_count", job="lm") == 4
    assert _value(text, "hps_training_step_duration_seconds_sum", job="lm") == 2.0
    with pytest.raises(ValueError, match="steps must be >= 0"):
        train.report(loss=1.0, steps=-1)
    with pytest.raises(ValueError, match="cover at least one step"):
        train.report(loss=1.0, steps=0, seconds=1.0)


class _Link:
    reachable = False


def test_link_watch_counts_a_reconnect_once_per_outage_and_not_the_first_connect():
    link = _Link()
    watch = LinkWatch(link, poll_s=1.0)
    for reachable in (False, True, True, False, False, True, True, False, True):
        link.reachable = reachable
        watch.poll()
    assert watch.reconnects == 2


def test_promtool_lints_every_family():
    promtool = Path(sys.executable).parent / "promtool"
    promtool = str(promtool) if promtool.exists() else shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (`make tools` extracts it from Debian's "
                    "prometheus package)")
    registry = CollectorRegistry()
    registry.register(_Families(_families(_snap("zone", _UP), {"tier": "zone", "zone": "eu-a"})))
    registry.register(_BuildInfo({"tier": "zone", "zone": "eu-a"}))
    TrainingMetrics("lm", registry).report(loss=1.0, steps=1, seconds=0.1)
    RpcMetrics(registry, {"tier": "zone"}).error("push", "UNAVAILABLE")
    root = CollectorRegistry()  # the root's own families (staleness, durability), one process
    root.register(_Families(_families(_snap("global", None, _durability()), {"tier": "global"})))
    for reg in (registry, root):
        r = subprocess.run([promtool, "check", "metrics"], input=generate_latest(reg).decode(),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


def test_a_root_of_a_standby_pair_exports_its_state_term_and_whether_its_standby_is_in_sync():
    from ps.core.types import TierStatus
    from ps.tiers.families import families

    st = TierStatus(role="global", name="root-a", server_epoch=1, parent="", parent_reachable=True, ready=True,
                    uptime_s=1.0, jobs=())

    def series(standby):
        fams = families(dict(status=st, link=None, durability=None, standby=standby), {"tier": "global"})
        return {s.name: s.value for f in fams for s in f.samples if s.name.startswith("hps_root_")}
    assert series(dict(state="primary", term=2, in_sync=False)) == {
        "hps_root_primary": 1, "hps_root_term": 2, "hps_root_standby_in_sync": 0}
    assert series(dict(state="primary", term=2, in_sync=True))["hps_root_standby_in_sync"] == 1
    assert series(dict(state="standby", term=2, in_sync=False)) == {"hps_root_primary": 0, "hps_root_term": 2}
    assert series(None) == {}  # a root without a standby: no series, no alert


def test_an_outer_jobs_inner_tier_exports_its_wan_side_and_the_steps_it_lost():
    """Only where the region's inner loop runs: a zone below it has no outer side to show."""
    import dataclasses

    outer = dataclasses.replace(_job().stats, outer_version=7, outer_syncs=6, outer_sync_failures=1,
                                outer_sync_seconds_sum=1.5, outer_bytes_up=3000, outer_bytes_down=5000,
                                pseudo_grad_norm=0.25, inner_steps_since_sync=3, inner_steps_lost=2,
                                inner_steps_per_sync=5)
    labels = {"tier": "regional", "region": "eu"}
    text = _render(_families(_snap("regional", _UP, mode="outer", staleness=0, inner_loop=True, stats=outer), labels))
    assert _value(text, "hps_outer_version", job="lm") == 7
    assert _value(text, "hps_outer_syncs_total", job="lm") == 6
    assert _value(text, "hps_outer_sync_failures_total", job="lm") == 1
    assert _value(text, "hps_outer_sync_seconds_sum", job="lm") == 1.5
    assert _value(text, "hps_outer_wan_bytes_total", job="lm", direction="up") == 3000
    assert _value(text, "hps_outer_wan_bytes_total", job="lm", direction="down") == 5000
    assert _value(text, "hps_outer_pseudo_gradient_norm", job="lm") == 0.25
    assert _value(text, "hps_outer_inner_steps_since_sync", job="lm") == 3
    assert _value(text, "hps_outer_inner_steps_lost_total", job="lm") == 2
    assert _value(text, "hps_outer_inner_steps_per_sync", job="lm") == 5
    below = _render(_families(_snap("zone", _UP, mode="outer", staleness=0, stats=outer), {"tier": "zone"}))
    assert "hps_outer_syncs_total{" not in below
