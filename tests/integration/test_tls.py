"""Mutual TLS between real tiers on loopback (issue 14): nobody without a certificate of the
cluster's CA gets a single call through, a worker certificate cannot act as a relay, and a
relay and a worker keep training while their certificates are rotated under them."""

from __future__ import annotations

import logging
import time

import grpc
import numpy as np
import pytest

from ps.core.config import JobConfig, OptimizerConfig
from ps.core.errors import HpsError
from ps.net.messages import ROLE
from ps.net.rpc import CHANNEL_OPTIONS, Caller
from ps.net.tls import TlsFiles, client_options
from ps.net.wire import METHODS, SERVICE, pb
from ps.tools.certs import init_certs, issue
from tests.helpers import bsp_rounds
from worker import ParameterClient

TOPOLOGY = {"root": {"name": "root"}, "regions": [{"name": "eu", "zones": [{"name": "eu-a"}]}]}
HEALTH = "/grpc.health.v1.Health/Check"


@pytest.fixture
def certs(tmp_path):
    return init_certs(tmp_path / "certs", TOPOLOGY, workers=["w0", "w1"])


def _secure(tree, certs, name, role, parent=""):
    f = certs[name]
    return tree.add(name, role, parent=parent, tls_cert=f.cert, tls_key=f.key, tls_ca=f.ca)


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _channels(address, certs, foreign):
    """Plaintext; TLS that verifies the tier but shows no certificate; TLS with a certificate
    of another CA (that trusts the cluster's CA, so only the client side is wrong)."""
    ca = _read(certs["root"].ca)
    opts = CHANNEL_OPTIONS + client_options()
    return {
        "plaintext": grpc.insecure_channel(address, options=CHANNEL_OPTIONS),
        "no certificate": grpc.secure_channel(address, grpc.ssl_channel_credentials(ca), options=opts),
        "another CA": grpc.secure_channel(address, grpc.ssl_channel_credentials(
            ca, _read(foreign.key), _read(foreign.cert)), options=opts),
    }


def test_no_call_without_a_certificate_of_the_cluster_ca(tree, certs, tmp_path):
    root = _secure(tree, certs, "root", "global")
    zone = _secure(tree, certs, "eu-a", "zone", parent="root")
    foreign = issue(tmp_path / "other-ca", "worker", "w0")  # same name and role, another CA
    paths = [(name, f"/{SERVICE}/{name}", kind) for name, (kind, _, _) in METHODS.items()]
    paths.append(("Health.Check", HEALTH, "unary_unary"))
    tried = 0
    for address in (root, zone):
        for how, ch in _channels(address, certs, foreign).items():
            for name, path, kind in paths:
                call = getattr(ch, kind)(path)
                body = iter([b"\x00"]) if kind.startswith("stream") else b""
                with pytest.raises(grpc.RpcError) as err:
                    out = call(body, timeout=5)
                    if kind.endswith("_stream"):
                        list(out)
                # refused in the handshake: no handler ran (it would answer INVALID_ARGUMENT & co.)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (address, how, name, err.value)
                tried += 1
            ch.close()
    assert tried == 2 * 3 * (len(METHODS) + 1)
    # the tiers saw nothing: no job, no member but the zone itself (its heartbeats to the root,
    # with its own certificate, may have come by now)
    for name, own in (("root", {"eu-a"}), ("eu-a", set())):
        jobs, children = tree.lt.call(lambda n=name: (dict(tree.tier(n).jobs), set(tree.tier(n).children)))
        assert (jobs, children - own) == ({}, set()), (name, jobs, children)
    # ... while a certificate of the cluster's CA gets through, to both
    for address in (root, zone):
        with Caller(address, tls=certs["w0"]) as rpc:
            assert list(rpc.call("ListJobs", pb.ListJobsRequest(), timeout=10).jobs) == []


def _code(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_a_worker_certificate_cannot_act_as_a_relay(tree, certs):
    _secure(tree, certs, "root", "global")
    region = _secure(tree, certs, "eu", "regional", parent="root")
    w = ParameterClient(region, "lm", worker_id="w0", tls=certs["w0"])
    w.create_job(JobConfig(name="lm"), *_model())
    w.register()  # as a worker, a worker's certificate is fine
    rpc = Caller(region, tls=certs["w1"])
    register = pb.RegisterRequest(job="lm", member="eu-a", role=ROLE["zone"], incarnation=7)
    heartbeat = pb.HeartbeatRequest(member="eu-a", jobs=["lm"], role=ROLE["zone"])
    assert _code(lambda: rpc.stubs["Register"](register, timeout=10)) == grpc.StatusCode.PERMISSION_DENIED
    assert _code(lambda: rpc.stubs["Heartbeat"](heartbeat, timeout=10)) == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(HpsError, match="certificate is a worker"):
        rpc.call("Register", register, timeout=10)
    # A worker's heartbeat that names an address does not make its name a relay's here: that
    # locked the real w0 out (every call of its refused as a relay's without a relay certificate).
    rpc.call("Heartbeat", pb.HeartbeatRequest(member="w0", role=ROLE["worker"], address="10.0.0.9:1"), timeout=10)
    assert "w0" not in tree.lt.call(lambda: dict(tree.tier("eu").children))
    w.register()
    with pytest.raises(HpsError, match="member id"):
        rpc.call("Heartbeat", pb.HeartbeatRequest(member="w\x1b[2J", role=ROLE["worker"]), timeout=10)
    # the regional master's own certificate cannot register as zone eu-a either (wrong name and role)
    with Caller(region, tls=certs["eu"]) as other:
        assert _code(lambda: other.stubs["Register"](register, timeout=10)) == grpc.StatusCode.PERMISSION_DENIED
    assert "eu-a" not in tree.lt.call(lambda: dict(tree.tier("eu").children))
    # the real zone, with its certificate, joins
    _secure(tree, certs, "eu-a", "zone", parent="eu")
    deadline = time.monotonic() + 30
    while "eu-a" not in tree.lt.call(lambda: dict(tree.tier("eu").children)):
        assert time.monotonic() < deadline, "zone eu-a never heartbeated to its region"
        time.sleep(0.1)
    # and once known as a relay, a worker's certificate cannot leave or push in its name
    leave = pb.LeaveRequest(job="lm", member="eu-a")
    assert _code(lambda: rpc.stubs["Leave"](leave, timeout=10)) == grpc.StatusCode.PERMISSION_DENIED
    rpc.close()
    w.close()


def _model():
    from ps.core.view import KeySpec, Layout

    return Layout([KeySpec("w", (64,))]), np.zeros(64, np.float32)


def test_a_relay_and_a_worker_keep_training_across_a_certificate_rotation(tree, certs, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="hps")
    _secure(tree, certs, "root", "global")
    zone = _secure(tree, certs, "eu-a", "zone", parent="root")
    job = JobConfig(name="rot", optimizer=OptimizerConfig(lr=0.1))
    w = ParameterClient(zone, "rot", worker_id="w0", tls=certs["w0"])
    w.create_job(job, *_model())
    w.register()
    w.pull(min_version=w.start_version)
    bsp_rounds([w], 3, lambda i, s: np.ones(64, np.float32))
    before = tree.view("root", "rot")[1]
    # new keys and certificates from the same CA, written over the files the tiers and the worker use
    rotated = init_certs(tmp_path / "certs", TOPOLOGY, workers=["w0", "w1"])
    assert rotated["w0"] == certs["w0"] and _read(certs["w0"].key) != b""
    deadline = time.monotonic() + 60
    steps = 0
    while not ("new channel to" in caplog.text and "new handshakes use them" in caplog.text):
        assert time.monotonic() < deadline, caplog.text[-3000:]
        bsp_rounds([w], 1, lambda i, s: np.ones(64, np.float32))
        steps += 1
        time.sleep(0.2)
    bsp_rounds([w], 3, lambda i, s: np.ones(64, np.float32))  # over the new channels and sessions
    assert tree.view("root", "rot")[1] == before + steps + 3
    assert tree.view("eu-a", "rot")[1] == tree.view("root", "rot")[1]
    # the relay's own link to the root was rebuilt with its new certificate too
    assert tree.lt.call(lambda: tree.tier("eu-a").up._rpc._ch.retired) != []
    w.close()


@pytest.mark.parametrize("topology,workers", [
    ({"regions": [{"name": "eu", "zones": ["eu"]}]}, ["w0"]),   # a region and its zone share a name
    ({}, ["ca"]),                                              # a worker named like the CA's files
    ({}, ["../w0"]),                                           # a name out of the directory
])
def test_certs_init_refuses_names_that_would_overwrite_files_and_writes_nothing(tmp_path, topology, workers):
    """The zone's certificate overwrote its region's, a worker 'ca' the CA's key (every later
    certificate signed by a leaf), and '../w0' was written outside the directory."""
    from ps.core.errors import BadInput
    from ps.tools.certs import init_certs

    with pytest.raises((ValueError, BadInput), match="would name|member id"):
        init_certs(tmp_path / "certs", topology, workers=workers)
    assert not (tmp_path / "certs").exists() and not (tmp_path / "w0.crt").exists()


def test_tls_files_go_together(tmp_path):
    with pytest.raises(ValueError, match="go together"):
        TlsFiles.of(cert="a.crt")


def test_hps_status_says_a_tier_runs_insecure_and_reads_a_secure_one_with_its_certificate(tree, certs, monkeypatch):
    import io

    from ps.tools.status import print_tree

    plain = tree.add("plain", "global")
    out = io.StringIO()
    assert print_tree(plain, out) == 0
    assert "INSECURE (plaintext, no client certificates)" in out.getvalue()
    secure = _secure(tree, certs, "root", "global")
    for k in ("cert", "key", "ca"):
        monkeypatch.setenv(f"HPS_TLS_{k.upper()}", getattr(certs["w0"], k))
    out = io.StringIO()
    assert print_tree(secure, out) == 0, out.getvalue()
    assert "global root @" in out.getvalue() and "INSECURE" not in out.getvalue()
    assert ", ready" in out.getvalue()  # the health check went over TLS too


def test_hps_serve_needs_certificates_or_insecure(reap, certs):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPS_TLS_", "HPS_INSECURE"))}
    r = subprocess.run([sys.executable, "-m", "ps.tools.cli", "serve", "--role", "global"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "--insecure" in r.stderr and "--tls-cert" in r.stderr
    p = subprocess.Popen([sys.executable, "-m", "ps.tools.cli", "serve", "--role", "global", "--insecure"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    reap(p)
    assert p.stdout.readline().startswith("hps: serving global")
    p.terminate()  # (before its signal handlers are in place it dies of the signal: either is fine here)
    p.wait(timeout=20)
    assert "WARNING hps.server: INSECURE" in p.stderr.read()


# -- the plaintext health-only port (--health-port): what kubelet's gRPC probe, which cannot do TLS, asks
def _health_check(channel, service=""):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_the_health_port_answers_probes_in_plaintext_and_serves_no_hps_method(tree, certs):
    from ps.server.lifecycle import health_port

    _secure(tree, certs, "root", "global")
    f = certs["eu-a"]
    zone = tree.add("eu-a", "zone", parent="root", tls_cert=f.cert, tls_key=f.key, tls_ca=f.ca, health_port=0)
    port = health_port(tree.tier("eu-a"))
    assert port and str(port) != zone.rsplit(":", 1)[1]
    probe = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    deadline = time.monotonic() + 20
    while _health_check(probe) != "SERVING":  # readiness: once the zone synced with its parent (over mTLS)
        assert time.monotonic() < deadline, "the zone never turned ready on its health port"
        time.sleep(0.1)
    assert _health_check(probe, "hps.liveness") == "SERVING"
    with pytest.raises(grpc.RpcError) as err:
        _health_check(probe, "no.such.Service")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    # every hps method: not there at all (no handler ran, nothing reached the tier)
    for name, (kind, _, _) in METHODS.items():
        call = getattr(probe, kind)(f"/{SERVICE}/{name}")
        body = iter([b"\x00"]) if kind.startswith("stream") else b""
        with pytest.raises(grpc.RpcError) as err:
            out = call(body, timeout=5)
            if kind.endswith("_stream"):
                list(out)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, (name, err.value)
    assert tree.lt.call(lambda: dict(tree.tier("eu-a").jobs)) == {}
    # ... while the main port still takes mutual TLS only, even for the health service
    plain = grpc.insecure_channel(zone, options=CHANNEL_OPTIONS)
    with pytest.raises(grpc.RpcError) as err:
        _health_check(plain)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    plain.close()
    # a tier without --health-port opens no second port
    assert health_port(tree.tier("root")) is None
    tree.stop("eu-a")  # stopped with the tier: nothing answers there any more
    with pytest.raises(grpc.RpcError) as err:
        _health_check(probe)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    probe.close()


def test_hps_serve_opens_the_health_port_from_its_flag_or_environment(reap, certs, capsys):
    import os
    import re
    import signal
    import subprocess
    import sys

    from ps.tools.cli import build_parser

    with pytest.raises(SystemExit):  # documented in `hps serve --help`
        build_parser().parse_args(["serve", "--help"])
    assert "--health-port" in capsys.readouterr().out
    f = certs["root"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPS_")}
    env |= {"HPS_HEALTH_PORT": "0", "HPS_TLS_CERT": f.cert, "HPS_TLS_KEY": f.key, "HPS_TLS_CA": f.ca}
    p = subprocess.Popen([sys.executable, "-m", "ps.tools.cli", "serve", "--role", "global",
                          "--listen", "127.0.0.1:0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    reap(p)
    line = p.stdout.readline()
    m = re.match(r"hps: serving global \S+ on 127\.0\.0\.1:(\d+) health (\d+)$", line.strip())
    assert m, line
    probe = grpc.insecure_channel(f"127.0.0.1:{m.group(2)}", options=CHANNEL_OPTIONS)
    assert _health_check(probe) == "SERVING" and _health_check(probe, "hps.liveness") == "SERVING"
    probe.close()
    os.kill(p.pid, signal.SIGTERM)
    assert p.wait(timeout=20) == 0
