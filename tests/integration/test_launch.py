"""`hps launch` supervises its tiers: a tier that dies is named in the log, restarted on its
port with backoff (the root restores its jobs from its checkpoint), given up on after too many
restarts while the rest keeps serving, and `hps status --launch-dir` shows all of it; the exit
code says how the launch ended."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from ps.core.config import JobConfig
from ps.core.view import KeySpec, Layout
from ps.net.tls import TlsFiles
from ps.tools.localsecrets import read_client_env
from ps.tools.status import read_state
from worker import ParameterClient

HPS = [sys.executable, "-m", "ps.tools.cli"]
TOPO = {"host": "127.0.0.1", "settings": {"heartbeat_s": 0.1, "member_timeout_s": 1.0},
        "root": {"name": "root", "zones": [{"name": "z"}]}}


class Launch:
    """One `hps launch` subprocess; stopped (and every tier it recorded) by PID."""

    def __init__(self, tmp: Path, *flags: str, topo: dict = TOPO) -> None:
        self.dir = tmp / "logs"
        path = tmp / "topo.yaml"
        path.write_text(yaml.safe_dump(topo))
        self.out = open(tmp / "launch.out", "w+")
        self.proc = subprocess.Popen(HPS + ["launch", str(path), "--logdir", str(self.dir),
                                            "--restart-backoff-s", "0.2", *flags],
                                     stdout=self.out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def state(self) -> dict:
        try:
            return read_state(self.dir)
        except (OSError, ValueError):
            return {}

    def wait(self, pred, what: str, tries: int = 300) -> dict:
        for _ in range(tries):  # bounded: 300 x 0.1 s plus the reads
            st = self.state()
            if st and pred(st):
                return st
            assert self.proc.poll() is None or what == "exit", self.text()
            time.sleep(0.1)
        raise AssertionError(f"launch never reached: {what}\n{json.dumps(st, indent=1)}\n{self.text()}")

    def text(self) -> str:
        self.out.seek(0)
        return self.out.read()

    def client(self, address: str, job: str, worker_id: str, **kw) -> ParameterClient:
        """A worker of this secure-by-default cluster: the client certificate and the admin
        token its launch left under LOGDIR (client.env), so it may create its job."""
        env = read_client_env(self.dir)
        tls = TlsFiles(env["HPS_TLS_CERT"], env["HPS_TLS_KEY"], env["HPS_TLS_CA"])
        token = Path(env["HPS_ADMIN_TOKEN_FILE"]).read_text().strip()
        return ParameterClient(address, job=job, worker_id=worker_id, tls=tls, token=token, **kw)

    def status(self) -> subprocess.CompletedProcess:
        return subprocess.run(HPS + ["status", "--launch-dir", str(self.dir)], capture_output=True,
                              text=True, timeout=60)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
        return self.proc.wait(timeout=60)

    def close(self) -> None:
        if self.proc.poll() is None:
            # SIGTERM first: the launcher stops the tiers it started, recorded in its state file
            # or not yet (a test that gave up before the state was written leaked them all).
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        for t in self.state().get("tiers", {}).values():  # a killed launch leaves its tiers
            try:
                os.kill(t["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.out.close()  # after every assertion: the fixture closes


@pytest.fixture
def launches():
    started: list[Launch] = []
    yield started.append
    for lc in started:
        lc.close()


def _up(st: dict, restarts: dict | None = None) -> bool:
    return all(t["state"] == "up" and t["restarts"] == (restarts or {}).get(n, 0)
               for n, t in st["tiers"].items())


def test_a_dead_tier_is_restarted_then_given_up_on_and_the_rest_keeps_serving(tmp_path, launches):
    lc = Launch(tmp_path, "--max-restarts", "1")
    launches(lc)
    st = lc.wait(_up, "every tier up")
    zone_pid = st["tiers"]["z"]["pid"]
    os.kill(zone_pid, signal.SIGKILL)
    st = lc.wait(lambda s: _up(s, {"z": 1}), "the zone restarted once")
    z = st["tiers"]["z"]
    assert z["pid"] != zone_pid and z["last_exit"] == "killed by signal 9 (SIGKILL)"
    assert (f"tier z (zone, pid {zone_pid}) killed by signal 9 (SIGKILL); restarting it on "
            f"{z['address']}") in lc.text()
    r = lc.status()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "launch pid" in r.stdout and "running" in r.stdout
    assert "1 restart(s); last exit killed by signal 9" in r.stdout
    assert "global root @" in r.stdout  # and then the tree itself

    os.kill(z["pid"], signal.SIGKILL)  # a second death within the window: given up on
    st = lc.wait(lambda s: s["tiers"]["z"]["state"] == "failed", "the zone given up on")
    assert st["tiers"]["root"]["state"] == "up" and lc.proc.poll() is None  # the rest serves on
    assert "giving up on it" in lc.text()
    r = lc.status()
    assert r.returncode == 1 and "FAILED" in r.stdout and "global root @" in r.stdout, r.stdout
    assert lc.stop() == 4
    assert read_state(lc.dir)["stopped"] is True
    assert "gave up on z" in lc.text()


def test_a_restarted_root_restores_its_jobs_and_a_clean_stop_exits_0(tmp_path, launches):
    lc = Launch(tmp_path)
    launches(lc)
    st = lc.wait(_up, "every tier up")
    root = st["tiers"]["root"]
    layout = Layout([KeySpec("w", (3,))])
    c = lc.client(root["address"], job="kept", worker_id="w0", retry_s=30)
    try:
        assert c.create_job(JobConfig(name="kept"), layout, np.arange(3, dtype=np.float32))
        ckpt = lc.dir / "checkpoints" / "kept"  # launch gave the root a checkpoint dir
        for _ in range(100):
            if list(ckpt.glob("ckpt-*.npz")):
                break
            time.sleep(0.1)
        os.kill(root["pid"], signal.SIGKILL)
        lc.wait(lambda s: _up(s, {"root": 1}), "the root restarted")
        c.register()  # rides through the restart; the job is still there
        c.pull(min_version=0)
        assert c.view.values.tolist() == [0.0, 1.0, 2.0]
    finally:
        c.close()
    assert lc.stop() == 0


def test_a_closed_terminal_sighup_stops_launch_and_every_tier(tmp_path, launches):
    """The tiers run in sessions of their own (no terminal's signals reach them): a launcher
    that died of SIGHUP's default action left every one of them running, unsupervised."""
    stale = tmp_path / "logs" / "client.env"  # a secure launch's, left in the same directory
    stale.parent.mkdir()
    stale.write_text("HPS_TLS_CA=/nowhere/ca.pem\n")
    lc = Launch(tmp_path, "--insecure")
    launches(lc)
    pids = [t["pid"] for t in lc.wait(_up, "every tier up")["tiers"].values()]
    # It pointed `hps status --launch-dir` and clients at TLS this cluster does not speak.
    lc.wait(lambda st: "cluster up" in lc.text(), "the launcher's last line")
    assert not stale.exists(), lc.text()
    assert lc.stop(signal.SIGHUP) == 0, lc.text()
    for pid in pids:  # stopped and reaped by the launcher: none is left
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_tiers_own_flags_win_over_the_settings_and_the_launchers_hps_variables_stay_its_own(
        tmp_path, launches, monkeypatch):
    """settings: {flush_ms: 5} with a zone's own flush_ms: 200 ran the zone at 5 ms (the settings
    came last, and argparse keeps the last). And a shell holding a client's HPS_TLS_* (`hps
    launch` tells users to source them) made every tier of an --insecure launch refuse to start."""
    monkeypatch.setenv("HPS_TLS_CERT", str(tmp_path / "client.pem"))
    topo = {**TOPO, "settings": {**TOPO["settings"], "flush_ms": 5},
            "root": {"name": "root", "zones": [{"name": "z", "flush_ms": 200}]}}
    lc = Launch(tmp_path, "--insecure", topo=topo)
    launches(lc)
    st = lc.wait(_up, "every tier up")
    args = Path(f"/proc/{st['tiers']['z']['pid']}/cmdline").read_bytes().decode().split("\0")
    flush = [args[i + 1] for i, a in enumerate(args) if a == "--flush-ms"]
    assert flush[-1] == "200", args
    assert lc.stop() == 0


def test_a_tier_that_cannot_start_exits_3(tmp_path, launches):
    with socket.socket() as busy:  # the root's port is taken
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        topo = {**TOPO, "root": {"name": "root", "port": busy.getsockname()[1]}}
        lc = Launch(tmp_path, topo=topo)
        launches(lc)
        assert lc.proc.wait(timeout=120) == 3
    assert "a tier could not be started" in lc.text()


def test_a_tier_not_ready_within_the_ready_timeout_exits_3_and_leaves_nothing_running(tmp_path, launches):
    """``--ready-timeout-s``: how long a tier may take to say it serves (a root restoring a
    large checkpoint may need more than the default). Past it the launch stops what it
    started and exits 3, naming the tier."""
    lc = Launch(tmp_path, "--insecure", "--ready-timeout-s", "0.01")
    launches(lc)
    assert lc.proc.wait(timeout=120) == 3, lc.text()
    assert "tier root did not report ready within" in lc.text(), lc.text()
    left = []
    for p in Path("/proc").iterdir():  # a tier of this launch names its directory on its command line
        try:
            if p.name.isdigit() and str(lc.dir).encode() in (p / "cmdline").read_bytes():
                left.append(p.name)
        except OSError:  # (gone meanwhile)
            pass
    assert not left, left


def _json_lines(path: Path) -> list[dict]:
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    parsed = [json.loads(ln) for ln in lines]  # every line: one JSON object
    assert parsed and all(isinstance(p, dict) and {"ts", "level", "logger", "message"} <= p.keys() for p in parsed)
    return parsed


def test_json_logs_carry_tier_job_version_and_event_fields(tmp_path, launches):
    lc = Launch(tmp_path, "--log-format", "json")
    launches(lc)
    st = lc.wait(_up, "every tier up")
    layout = Layout([KeySpec("w", (3,))])
    c = lc.client(st["tiers"]["z"]["address"], job="logged", worker_id="w0", retry_s=30)
    try:
        c.create_job(JobConfig(name="logged"), layout, np.zeros(3, np.float32))
        c.register()
        c.push(np.ones(3, np.float32))
        os.kill(st["tiers"]["root"]["pid"], signal.SIGKILL)  # the zone loses and regains its parent
        lc.wait(lambda s: _up(s, {"root": 1}), "the root restarted")
        for _ in range(100):
            if '"parent.regained"' in (lc.dir / "z.log").read_text():
                break
            time.sleep(0.1)
    finally:
        c.close()
    assert lc.stop() == 0
    root, zone = _json_lines(lc.dir / "root.log"), _json_lines(lc.dir / "z.log")
    events = {(p.get("event"), p["tier"]) for p in root + zone}
    for e in [("tier.started", "global"), ("tier.started", "zone"), ("job.created", "global"),
              ("member.joined", "global"), ("member.joined", "zone"), ("checkpoint.written", "global"),
              ("job.restored", "global"), ("parent.lost", "zone"), ("parent.regained", "zone"),
              ("tier.stopping", "zone"), ("tier.stopped", "global")]:
        assert e in events, (e, sorted(events, key=str))
    joined = next(p for p in zone if p.get("event") == "member.joined" and p.get("member") == "w0")
    assert joined["zone"] == "z" and joined["name"] == "z" and joined["job"] == "logged" and "version" in joined
    restored = next(p for p in root if p.get("event") == "job.restored")
    assert restored["job"] == "logged" and restored["version"] == 1
    launch = [json.loads(ln) for ln in lc.text().splitlines() if ln.startswith("{")]
    died = next(p for p in launch if p.get("event") == "launch.tier_died")
    assert died["tier_name"] == "root" and died["process"] == "launch" and "SIGKILL" in died["message"]


def test_a_sharded_root_trains_a_job_that_names_no_sharding_and_a_killed_shard_comes_back(
        tmp_path, launches, monkeypatch):
    """`shards:` in a topology: one root process per shard, each on its own checkpoint
    directory, and region eu with zone eu-a below it as one relay tree per shard; the zone's
    address and weights `hps launch` prints are all a worker needs (the job is placed by
    HPS_SHARD_WEIGHTS); a shard killed with -9 is restarted, restores its blocks, and its
    relays rejoin it."""
    import torch

    from ps.core.config import OptimizerConfig
    from tests.helpers import mlp_batches, mlp_loss, small_mlp
    from worker import HpsOptimizer

    topo = {**TOPO, "root": {"name": "root", "shards": [{"weight": 2}, {"weight": 1}]},
            "regions": [{"name": "eu", "zones": [{"name": "eu-a"}]}]}
    lc = Launch(tmp_path, topo=topo)
    launches(lc)
    st = lc.wait(_up, "both shards and their relays up")
    assert set(st["tiers"]) == {"root-0", "root-1", "eu-0", "eu-1", "eu-a-0", "eu-a-1"}
    assert [st["tiers"][f"eu-a-{i}"]["parent"] for i in range(2)] == [st["tiers"][f"eu-{i}"]["address"]
                                                                     for i in range(2)]
    assert [st["tiers"][f"eu-{i}"]["parent"] for i in range(2)] == [st["tiers"][f"root-{i}"]["address"]
                                                                   for i in range(2)]
    roots = f"{st['tiers']['root-0']['address']};{st['tiers']['root-1']['address']}"
    address = f"{st['tiers']['eu-a-0']['address']};{st['tiers']['eu-a-1']['address']}"
    for _ in range(100):  # printed once every tier serves
        if "HPS_ADDRESS=" in lc.text():
            break
        time.sleep(0.1)
    assert f"root root is 2 shards; its workers: HPS_ADDRESS='{roots}' HPS_SHARD_WEIGHTS=2,1" in lc.text()
    assert (f"zone eu-a is 2 relays, one per shard; its workers: HPS_ADDRESS='{address}' "
            "HPS_SHARD_WEIGHTS=2,1") in lc.text(), lc.text()
    # `hps status --launch-dir` walks every shard's tree, not shard 0's alone.
    r = lc.status()
    assert r.returncode == 0 and all(f"{role} {name}-{i} @" in r.stdout for i in range(2)
                                     for role, name in (("global", "root"), ("regional", "eu"), ("zone", "eu-a"))), \
        r.stdout
    monkeypatch.setenv("HPS_SHARD_WEIGHTS", "2,1")
    env = read_client_env(lc.dir)
    tls = TlsFiles(env["HPS_TLS_CERT"], env["HPS_TLS_KEY"], env["HPS_TLS_CA"])
    token = Path(env["HPS_ADMIN_TOKEN_FILE"]).read_text().strip()
    model, ref = small_mlp(), small_mlp()
    ref.load_state_dict(model.state_dict())
    x, y = mlp_batches(8, 8)
    sgd = OptimizerConfig(kind="sgd", lr=0.1)
    with HpsOptimizer(model, address, JobConfig(name="lj", optimizer=sgd), worker_id="w0", tls=tls,
                      token=token, timeout_s=10) as opt:
        assert opt.client.config.sharding.weights == (2.0, 1.0)
        for s in range(8):
            if s == 4:  # shard 1 dies between steps; launch restarts it from its own directory
                pid = st["tiers"]["root-1"]["pid"]
                os.kill(pid, signal.SIGKILL)
                lc.wait(lambda s: _up(s, {"root-1": 1}), "shard 1 restarted")
            opt.zero_grad()
            mlp_loss(model, x[s], y[s]).backward()
            assert opt.step().applied
        assert opt.version == 8
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for s in range(8):  # nothing acknowledged was lost: the same as 8 local steps
        ref_opt.zero_grad()
        mlp_loss(ref, x[s], y[s]).backward()
        ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert list((lc.dir / "checkpoints" / "shard-1" / "lj").glob("ckpt-*.npz"))
    assert lc.stop() == 0


def test_a_sharded_root_with_declared_links_is_refused(tmp_path, launches):
    topo = {**TOPO, "root": {"name": "root", "shards": 2}, "links": [{"name": "wan", "to": "root", "latency_ms": 5}]}
    lc = Launch(tmp_path, topo=topo)
    launches(lc)
    assert lc.proc.wait(timeout=60) == 2
    assert "declared links and zones with alternates in front of root shards are not built" in lc.text()


def test_shards_and_standbys_whose_fixed_ports_collide_are_refused_before_anything_starts(tmp_path, launches):
    """Shard I and its standby take their entry's port + I: a standby entry one port above the
    root's would share shard 1's. Refused before any process starts (so no port is ever bound)."""
    topo = {**TOPO, "root": {"name": "root", "port": 47000, "shards": 2, "standby": {"port": 47001}}}
    lc = Launch(tmp_path, topo=topo)
    launches(lc)
    assert lc.proc.wait(timeout=60) == 2
    assert "'root-1' and 'root-standby-0' would both take port 47001" in lc.text()
    assert not list(lc.dir.glob("root-*.log"))  # no tier was started


@pytest.mark.parametrize("text, said", [
    ("root: foo", "the root must be a mapping"),
    ("root: {name: r}\nregions: [eu]", "a region must be a mapping"),
    ("root: {name: r, port: abc}", "port 'abc': an integer is needed"),
    ("root: {name: r}\nregions: [{zones: [{name: z}]}]", "a region needs a name"),
    ("root: {name: r, zones: [{name: z}]}\nregions: [{name: eu, zones: [{name: z}]}]", "'z' names two tiers"),
    ("root: {name: r, zones: [{name: client}]}", "'client' names the CA's"),
    ("root: {name: r}\nsettings: [1]", "settings must be a mapping"),
    ("root: {name: r, zones: [{name: z, alternates: [eu]}]}", "alternates name regional masters"),
])
def test_a_malformed_topology_is_refused_with_a_sentence_before_anything_starts(tmp_path, text, said):
    """These crashed part-way through with a traceback (KeyError, TypeError, AttributeError,
    ValueError from the certificates): exit 1, not the 2 of a bad topology."""
    from ps.core.errors import BadInput
    from ps.tools.launch import load_topology
    path = tmp_path / "topo.yaml"
    path.write_text(text + "\n")
    with pytest.raises(BadInput, match=re.escape(said)):
        load_topology(str(path))
    path.write_text("root: {name: r}\nsettings:\n")  # empty: it loads as None, and is no settings
    assert load_topology(str(path))["root"] == {"name": "r"}
