"""Operating a running tree: /metrics moves as training runs, promtool accepts what it serves,
the dashboard and alert rules only name series that exist, `hps status` shows the same
numbers, the health service answers SERVING only once a tier has synced with its parent, and
`hps serve` stops cleanly on SIGTERM."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from ps.core.config import JobConfig, OptimizerConfig, ServerConfig
from ps.core.view import KeySpec, Layout
from ps.server import create_server
from ps.server.health import LIVENESS, Health
from ps.tiers.metrics import RpcMetrics, serve_metrics
from ps.tools.status import print_tree
from tests.helpers import FAST, LoopThread, Tree, bsp_rounds
from worker import ParameterClient
from worker.metrics import TrainingMetrics

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = Layout([KeySpec("w", (32, 16)), KeySpec("b", (16,))])
SIZE = 4 * LAYOUT.numel  # float32 bytes of one whole vector
STEPS = 3
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def tool(name: str) -> str | None:
    """A test tool from the venv (`make tools`) or PATH."""
    venv = Path(sys.executable).parent / name
    return str(venv) if venv.exists() else shutil.which(name)


# -- a tree whose every tier serves /metrics -------------------------------------------------------
class Scraped:
    """Tiers of a ``Tree`` with their own registry and /metrics server each."""

    def __init__(self, tree: Tree) -> None:
        self.tree = tree
        self.http: dict[str, object] = {}

    def add(self, name: str, role: str, parent: str = "", **kw) -> str:
        registry = CollectorRegistry()
        cfg = ServerConfig(role=role, name=name, parent=self.tree.addr(parent) if parent else "",
                           **{**FAST, **kw})
        self.tree.servers[name] = self.tree.lt.run(create_server(cfg, registry))
        self.http[name] = serve_metrics(registry, 0)
        return self.tree.addr(name)

    def text(self, name: str) -> str:
        url = f"http://127.0.0.1:{self.http[name].server_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()

    def value(self, name: str, metric: str, **labels) -> float:
        return sample(self.text(name), metric, **labels)

    def has(self, name: str, metric: str, **labels) -> bool:
        """Whether tier ``name`` exports a sample of ``metric`` with these labels yet."""
        return any(s.name == metric and all(s.labels.get(k) == v for k, v in labels.items())
                   for fam in text_string_to_metric_families(self.text(name)) for s in fam.samples)

    def close(self) -> None:
        for httpd in self.http.values():
            httpd.shutdown()
            httpd.server_close()
        self.tree.close()


def sample(text: str, metric: str, **labels) -> float:
    """The value of the one sample named ``metric`` whose labels include ``labels``."""
    found = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples
             if s.name == metric and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{metric}{labels}: {len(found)} samples"
    return found[0]


def _grad(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(LAYOUT.numel).astype(np.float32)


def train(clients, steps: int) -> None:
    """BSP rounds; training telemetry rides along: loss 1 + step, 50 ms per step."""
    bsp_rounds(clients, steps, lambda i, s: _grad(100 * i + s), report=lambda s: (1.0 + s, 1, 0.05))


def wait_for(fn, what: str, tries: int = 100, pause_s: float = 0.05):
    """Poll ``fn`` until it returns something truthy: at most ``tries`` times."""
    for _ in range(tries):
        got = fn()
        if got:
            return got
        time.sleep(pause_s)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """root <- eu <- eu-a, two workers on eu-a; scrapes before and after STEPS BSP rounds. The
    root keeps checkpoints, so its durability series are there too."""
    lt = LoopThread()
    ops = Scraped(Tree(lt))
    clients = []
    try:
        ops.add("root", "global", checkpoint_dir=str(tmp_path_factory.mktemp("root")), checkpoint_every=2)
        ops.add("eu", "regional", parent="root")
        zone = ops.add("eu-a", "zone", parent="eu")
        cfg = JobConfig(name="lm", delta_codec="fp32+zstd", optimizer=OptimizerConfig(lr=0.1))
        clients = [ParameterClient(zone, "lm", f"w{i}") for i in range(2)]
        clients[0].create_job(cfg, LAYOUT, _grad(7))
        for c in clients:
            c.register()
            c.pull(min_version=0)
        # A second job, declared only: the root exports its ssp bound.
        ssp = ParameterClient(zone, "ssp", "w9")
        ssp.create_job(JobConfig(name="ssp", mode="ssp", staleness=2), LAYOUT, _grad(8))
        ssp.close()
        before = {n: ops.text(n) for n in ops.http}
        train(clients, STEPS)
        after = {n: ops.text(n) for n in ops.http}
        yield ops, before, after
    finally:
        for c in clients:
            c.close()
        ops.close()
        lt.close()


def test_metrics_move_as_training_runs(trained):
    ops, before, after = trained
    for name in ("root", "eu", "eu-a"):
        assert sample(before[name], "hps_version", job="lm") == 0
        assert sample(after[name], "hps_version", job="lm") == STEPS
        assert sample(after[name], "hps_ready") == 1
    # Replicas caught up with the root: no lag, and the parent answered.
    for name in ("eu", "eu-a"):
        assert sample(after[name], "hps_replica_lag_versions", job="lm") == 0
        assert sample(after[name], "hps_replica_lag_seconds", job="lm") == 0
        assert sample(after[name], "hps_upstream_reachable") == 1
    assert sample(after["root"], "hps_replica_lag_versions", job="lm") == 0

    zone = after["eu-a"]
    assert sample(zone, "hps_members", job="lm") == 2
    assert sample(after["root"], "hps_members", job="lm") == 1  # the regional master
    assert sample(zone, "hps_pushes_total", job="lm") == 2 * STEPS
    assert sample(zone, "hps_push_duration_seconds_count", job="lm") == 2 * STEPS
    assert sample(after["root"], "hps_pushes_total", job="lm") == STEPS  # one aggregate a round
    assert sample(after["root"], "hps_rounds_total", job="lm") == STEPS
    # fp32 pushes: the wire bytes are the decoded bytes; zstd deltas are counted as sent.
    pushed = sample(zone, "hps_push_bytes_total", job="lm", edge="children")
    assert pushed == sample(zone, "hps_push_decoded_bytes_total", job="lm", edge="children") \
        == 2 * STEPS * SIZE
    assert sample(before["eu-a"], "hps_push_bytes_total", job="lm", edge="children") == 0
    assert sample(zone, "hps_push_bytes_total", job="lm", edge="parent") == STEPS * SIZE
    served = sample(zone, "hps_pull_bytes_total", job="lm", edge="children")
    assert served > sample(before["eu-a"], "hps_pull_bytes_total", job="lm", edge="children") > 0
    hits = sample(zone, "hps_delta_log_hits_total", job="lm")
    snaps = sample(zone, "hps_snapshot_fallbacks_total", job="lm")
    assert hits >= 2 * STEPS and snaps >= 2  # each worker's first pull is a snapshot
    assert sample(zone, "hps_pull_decoded_bytes_total", job="lm", edge="children") == \
        (hits + snaps) * SIZE
    assert sample(zone, "hps_barrier_wait_seconds_count", job="lm") == 2 * STEPS
    assert sample(after["root"], "hps_job_staleness_bound", job="ssp") == 2
    # The workers' reported loss and step time reach every tier up to the root (relays forward
    # what their children reported with their own pushes).
    for name in ("eu-a", "eu", "root"):
        assert sample(after[name], "hps_worker_loss_count", job="lm") == 2 * STEPS
        assert sample(after[name], "hps_worker_loss_sum", job="lm") == 2 * sum(1.0 + s for s in range(STEPS))
        assert sample(after[name], "hps_worker_step_seconds_sum", job="lm") == pytest.approx(2 * STEPS * 0.05)
    # Every update the root applied was computed on the version before it (bsp).
    assert sample(after["root"], "hps_update_staleness_versions_count", job="lm") == STEPS
    assert sample(after["root"], "hps_update_staleness_versions_sum", job="lm") == 0


def test_promtool_accepts_the_exposition(trained):
    promtool = tool("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (`make tools` extracts it from Debian's "
                    "prometheus package)")
    _, _, after = trained
    for name, text in after.items():
        r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0 and not r.stdout.strip(), f"{name}: {r.stdout}{r.stderr}"


def _names_used(expr: str) -> set[str]:
    """hps_* series an expression reads (not $variables, nor parts of recorded a:b:c names)."""
    return set(re.findall(r"(?<![\w:$])(hps_[a-z0-9_]+)(?![\w:])", expr))


def test_rules_and_dashboard_only_use_series_the_tiers_export(trained):
    import yaml

    _, _, after = trained
    registry = CollectorRegistry()
    TrainingMetrics("lm", registry).report(loss=2.0, steps=3, seconds=0.3)
    # hps_rpc_errors_total{method,code} has a series from a tier's first refused call on.
    RpcMetrics(registry, {"tier": "zone"}).error("push", "UNAVAILABLE")
    from prometheus_client import generate_latest

    exported = {s.name for text in [*after.values(), generate_latest(registry).decode()]
                for fam in text_string_to_metric_families(text) for s in fam.samples}
    # The hot-standby pair's series exist only on a root that has a standby (this cluster's has
    # none): rendered from the same pure families a primary of a pair scrapes to.
    from ps.core.types import TierStatus
    from ps.tiers.families import families
    pair = families({"status": TierStatus("global", "root", 1, "", True, True, 1.0), "link": None,
                     "standby": {"state": "primary", "term": 1, "in_sync": True}}, {"tier": "global"})
    exported |= {s.name for fam in pair for s in fam.samples}
    # An outer job's series exist only at the tier running its inner loop (this cluster runs
    # none): rendered the same way, from a regional master's status of one.
    from ps.core.types import JobStats, JobStatus
    outer = JobStatus(name="o", mode="outer", version=1, view_epoch=1, checksum=0, parent_version=1, lag_s=0.0,
                      round=1, round_pushed=0, clock_min=0, inner_loop=True, stats=JobStats())
    regional = {"status": TierStatus("regional", "eu", 1, "root", True, True, 1.0, jobs=(outer,)),
                "link": {"reachable": True, "errors": 0, "reconnects": 0}}
    exported |= {s.name for fam in families(regional, {"tier": "regional"}) for s in fam.samples}
    rules = yaml.safe_load((ROOT / "deploy/prometheus/rules/hps.rules.yml").read_text())
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    used = {n for g in rules["groups"] for r in g["rules"] for n in _names_used(r["expr"])}
    dashboard = json.loads((ROOT / "deploy/grafana/hps-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used |= {n for e in exprs for n in _names_used(e)}
    assert used, "no hps_* series found in the rules or the dashboard"
    assert used - exported - recorded == set()


def test_status_shows_the_numbers_the_metrics_show(trained):
    ops, _, after = trained
    out = io.StringIO()
    assert print_tree(ops.tree.addr("root"), out) == 0
    text = out.getvalue()
    for name in ("root", "eu", "eu-a"):
        assert f" {name} @ " in text, text
    assert text.count(f"job lm: version {STEPS} ") == 3, text
    assert text.count(", ready") == 3, text  # what the readiness probes see (hps_ready)
    zone_block = text[text.index(" eu-a @ "):]
    assert "lag 0 versions" in zone_block and "members 2 (2 workers)" in zone_block, zone_block


def test_lag_and_reconnects_when_the_parent_goes_away(tree):
    ops = Scraped(tree)
    try:
        ops.add("root", "global")
        eu = ops.add("eu", "regional", parent="root")
        zone = ops.add("eu-a", "zone", parent="eu")
        c = ParameterClient(zone, "lm", "w0")
        c.create_job(JobConfig(name="lm", optimizer=OptimizerConfig(lr=0.1)), LAYOUT, _grad(1))
        c.register()
        c.pull(min_version=0)
        train([c], 1)
        assert ops.value("eu-a", "hps_upstream_reconnects_total") == 0
        # The regional master goes away: the zone cannot tell whether it is current, so its
        # lag in seconds counts from when it last was.
        tree.stop("eu")
        wait_for(lambda: ops.value("eu-a", "hps_upstream_reachable") == 0, "parent unreachable")
        lag = wait_for(lambda: ops.value("eu-a", "hps_replica_lag_seconds", job="lm"), "lag > 0")
        assert lag > 0
        assert ops.value("eu-a", "hps_upstream_errors_total") >= 1
        # The master comes back on the same address: one reconnect, and in sync again.
        ops.http.pop("eu").shutdown()
        ops.add("eu", "regional", parent="root", listen=eu)
        wait_for(lambda: ops.value("eu-a", "hps_upstream_reconnects_total") == 1, "a reconnect",
                 tries=200)
        # The zone registers the job with the new master (a push before that would be refused).
        wait_for(lambda: ops.has("eu", "hps_members", job="lm"), "the zone to re-register",
                 tries=200)
        train([c], 1)
        wait_for(lambda: ops.value("eu-a", "hps_replica_lag_seconds", job="lm") == 0, "lag 0")
        assert ops.value("eu-a", "hps_version", job="lm") == 2
        c.close()
    finally:
        for httpd in ops.http.values():
            httpd.shutdown()
            httpd.server_close()


# -- health ------------------------------------------------------------------------------------
def _check(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_health_is_serving_only_once_the_tier_synced_with_its_parent(tree):
    parent = f"127.0.0.1:{_free_port()}"  # nothing listens there yet
    tree.servers["z"] = tree.lt.run(create_server(ServerConfig(role="zone", name="z", parent=parent,
                                                               **FAST)))
    zone = tree.addr("z")
    time.sleep(3 * FAST["heartbeat_s"])  # a few heartbeats fail
    assert _check(zone) == _NOT_SERVING
    assert _check(zone, "hps.v1.ParameterServer") == _NOT_SERVING
    assert _check(zone, LIVENESS) == _SERVING  # alive, just not ready
    with pytest.raises(grpc.RpcError) as err:
        _check(zone, "no.such.Service")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND

    tree.servers["root"] = tree.lt.run(create_server(ServerConfig(role="global", listen=parent,
                                                                  **FAST)))
    assert _check(parent) == _SERVING  # the root has no parent to wait for
    wait_for(lambda: _check(zone) == _SERVING, "the zone to sync with its parent")

    # On SIGTERM the server drains first: probes see NOT_SERVING while it winds down.
    health = Health(tree.tier("z"))
    assert health.status("") == _SERVING
    health.drain()
    assert health.status("") == health.status(LIVENESS) == _NOT_SERVING


# -- the process -------------------------------------------------------------------------------
def test_hps_serve_serves_metrics_and_health_and_stops_on_sigterm(reap):
    env = {**os.environ, "HPS_METRICS_PORT": "0", "HPS_PARENT": f"127.0.0.1:{_free_port()}",
           "HPS_HEARTBEAT_S": "0.1", "HPS_MEMBER_TIMEOUT_S": "1", "HPS_INSECURE": "1"}
    p = subprocess.Popen([sys.executable, "-m", "ps.tools.cli", "serve", "--role", "zone", "--name", "z1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    reap(p)
    line = p.stdout.readline()
    m = re.match(r"hps: serving zone z1 on (\S+) metrics (\d+)", line)
    assert m, line + p.stderr.read()
    address, metrics_port = m.group(1), int(m.group(2))
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert sample(text, "hps_ready", tier="zone", zone="z1") == 0  # its parent is not there
    assert sample(text, "hps_upstream_reachable", tier="zone", zone="z1") == 0
    assert "process_cpu_seconds_total" in text  # the process collector of a served registry
    assert _check(address) == _NOT_SERVING and _check(address, LIVENESS) == _SERVING
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=20) == 0, p.stderr.read()


def test_a_second_tier_on_a_port_in_use_fails_to_start_instead_of_sharing_it(tree):
    """gRPC sets SO_REUSEPORT by default: a second process started on a port in use bound it
    silently and took a share of its connections. Refused now, with the port in the sentence;
    the first tier serves on."""
    root = tree.add("root", "global", health_port=0)
    with pytest.raises(OSError, match=re.escape(root)):
        tree.lt.run(create_server(ServerConfig(role="global", name="again", listen=root, **FAST)))
    probe = grpc.insecure_channel(root)
    reply = health_pb2_grpc.HealthStub(probe).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    probe.close()


def test_a_tier_listening_on_every_interface_is_known_to_its_parent_by_a_reachable_address(tree):
    """Every pod listens on 0.0.0.0:7000 and said so to its parent: `hps status` then walked to
    0.0.0.0:7000 for every child -- the root itself -- and never showed a region, nor one DOWN.
    The parent now takes the host the call came from."""
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root", listen="0.0.0.0:0")
    port = zone.rsplit(":", 1)[1]
    c = ParameterClient(zone, "anywhere", "w0")
    try:
        c.create_job(JobConfig(name="anywhere"), Layout([KeySpec("w", (3,))]), np.zeros(3, np.float32))
        c.register()
        wait_for(lambda: tree.lt.call(lambda: [a for _, a, _ in tree.tier("root").children.values()]) ==
                 [f"127.0.0.1:{port}"], "the zone known to the root at 127.0.0.1")
        members = tree.lt.call(lambda: [m.address for m in tree.tier("root").jobs["anywhere"].members])
        assert members == [f"127.0.0.1:{port}"]
    finally:
        c.close()
