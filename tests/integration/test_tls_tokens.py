"""Both halves of issue 14 at once, as a real deployment runs them: tiers with mutual TLS and an
admin token. A relay proves itself by its certificate (it acts for its workers' jobs upward
without their tokens being its credential), a worker by its certificate and its job's token;
the wrong token is refused at the zone whatever certificate carries it."""

from __future__ import annotations

import numpy as np
import pytest

from ps.core.config import JobConfig, OptimizerConfig, ServerConfig
from ps.core.errors import PermissionDenied, Unauthenticated
from ps.core.view import KeySpec, Layout
from ps.server import create_server
from ps.tools import jobctl
from ps.tools.certs import init_certs
from ps.tools.status import fetch_status
from tests.helpers import FAST, wait_for
from worker import ParameterClient

TOPOLOGY = {"root": {"name": "root"}, "regions": [{"name": "eu", "zones": [{"name": "eu-a"}]}]}
LAYOUT = Layout([KeySpec("w", (4, 3))])
ADMIN = "admin-token-for-tls-tests-0123456789abcdef"


def _job(name: str) -> JobConfig:
    return JobConfig(name=name, optimizer=OptimizerConfig(kind="sgd", lr=0.1))


def _secure_root_and_zone(tree, tmp_path, workers: list[str]):
    """A root and a zone with mutual TLS and the admin token: (certificates, root, zone)."""
    certs = init_certs(tmp_path / "certs", TOPOLOGY, workers=workers)
    admin_file = tmp_path / "admin-token"
    admin_file.write_text(ADMIN + "\n")

    def secure(name, role, parent=""):
        f = certs[name]
        return tree.add(name, role, parent=parent, tls_cert=f.cert, tls_key=f.key, tls_ca=f.ca,
                        admin_token_file=str(admin_file))

    return certs, secure("root", "global"), secure("eu-a", "zone", parent="root")


def test_certificates_and_tokens_together(tree, tmp_path, monkeypatch):
    certs, root, zone = _secure_root_and_zone(tree, tmp_path, ["w0", "w1", "admin"])
    a = certs["admin"]  # `hps job` reads its certificate from HPS_TLS_* like every tool
    monkeypatch.setenv("HPS_TLS_CERT", a.cert)
    monkeypatch.setenv("HPS_TLS_KEY", a.key)
    monkeypatch.setenv("HPS_TLS_CA", a.ca)
    _, token_a = jobctl.create(root, _job("a"), ADMIN)
    _, token_b = jobctl.create(zone, _job("b"), ADMIN)  # through the zone, which relays it up
    assert token_a and token_b and token_a != token_b

    clients = []
    try:
        w0 = ParameterClient(zone, "a", "w0", timeout_s=10, retry_s=5, tls=certs["w0"], token=token_a)
        clients.append(w0)
        assert w0.create_job("a", LAYOUT, np.zeros(LAYOUT.numel, np.float32))
        w0.register()
        w0.pull(min_version=0)
        v, _ = w0.push(np.ones(LAYOUT.numel, np.float32))
        w0.pull(min_version=v)
        assert v == 1 and np.allclose(w0.view.values, -0.1)  # sgd, lr 0.1, one worker
        wb = ParameterClient(zone, "b", "w1", timeout_s=10, retry_s=5, tls=certs["w1"], token=token_b)
        clients.append(wb)
        assert wb.create_job("b", LAYOUT, np.zeros(LAYOUT.numel, np.float32))  # b's first worker

        # The right certificate with another job's token, or with none: refused at the zone.
        for token, refused in ((token_a, (PermissionDenied, Unauthenticated)), (None, Unauthenticated)):
            w1 = ParameterClient(zone, "b", "w0", timeout_s=5, retry_s=1, tls=certs["w0"], token=token)
            clients.append(w1)
            with pytest.raises(refused) as info:
                w1.register()
            assert token_a not in str(info.value) and token_b not in str(info.value)

        # Job b is untouched: no version, and the zone admitted no worker (the zone itself may
        # have joined b at the root to learn b's token hash before refusing: see ps/server/auth.py).
        st = fetch_status(root, token=ADMIN)
        assert {j.name: j.version for j in st.jobs}["b"] == 0
        at_zone = {j.name: j for j in fetch_status(zone, token=ADMIN).jobs}
        assert "b" not in at_zone or not at_zone["b"].members
        assert [j.name for j in fetch_status(zone, token=token_a).jobs] == ["a"]
        assert st.tokens_required and not st.insecure
        # ...and left b at the root again: attached with no worker, it held every round of b
        # there (a bsp round waits for each member) -- a stranger's refused call stalled b.
        wr = ParameterClient(root, "b", "w1", timeout_s=10, round_timeout_s=8, retry_s=5, tls=certs["w1"],
                             token=token_b)
        clients.append(wr)
        wr.register()
        wr.pull(min_version=0)
        assert wr.push(np.ones(LAYOUT.numel, np.float32))[0] == 1
    finally:
        for c in clients:
            c.close()


def test_a_zone_moves_back_to_its_restarted_regional_master_with_tokens(tree, tmp_path):
    """A regional master that restarted knows no job's token until a child registers through
    it, so the zone on its alternate asks it a tokenless health question (is it a ready
    relay?) before it moves back; every tier with an admin token, the job with its own.
    (Plaintext: with mutual TLS a zone's certificate binds it to its own region's master, so
    an alternate in another region refuses it.)"""
    admin_file = tmp_path / "admin-token"
    admin_file.write_text(ADMIN + "\n")
    guard = dict(admin_token_file=str(admin_file))
    root = tree.add("root", "global", **guard)
    eu = tree.add("eu", "regional", parent="root", **guard)
    us = tree.add("us", "regional", parent="root", **guard)
    cfg = ServerConfig(role="zone", name="eu-a", parent=f"{eu},{us}", **{**FAST, **guard})
    tree.servers["eu-a"] = tree.lt.run(create_server(cfg))
    zone = tree.tier("eu-a")
    _, token = jobctl.create(root, _job("a"), ADMIN)
    w = ParameterClient(tree.addr("eu-a"), "a", "w0", timeout_s=10, retry_s=10, token=token)
    try:
        assert w.create_job("a", LAYOUT, np.zeros(LAYOUT.numel, np.float32))
        w.register()
        w.pull(min_version=0)

        def step() -> int:
            v, _ = w.push(np.ones(LAYOUT.numel, np.float32))
            w.pull(min_version=v)
            return v

        assert step() == 1
        port = tree.servers["eu"][1]
        tree.stop("eu")
        wait_for(lambda: tree.lt.call(lambda: zone.up.index) == 1, "the zone on its alternate", 15)
        assert step() == 2
        tree.add("eu", "regional", parent="root", listen=f"127.0.0.1:{port}", **guard)
        wait_for(lambda: tree.lt.call(lambda: zone.up.index) == 0, "the zone back at its regional master", 15,
                 pause_s=0.1)
        versions = [step() for _ in range(3)]  # through eu again, with the job's token checked there
        assert versions == [3, 4, 5], versions
        st = fetch_status(eu, token=ADMIN)
        assert [j.name for j in st.jobs] == ["a"] and [m.member for m in st.jobs[0].members] == ["eu-a"]
        assert np.allclose(w.view.values, -0.5)  # sgd, lr 0.1, five steps of ones, one worker
    finally:
        w.close()


def test_a_caller_refused_at_a_zone_leaves_no_copy_of_the_job_there(tree, tmp_path, monkeypatch):
    """Under mutual TLS the root admits a zone for any job on its relay certificate, so a zone
    asked to register a job it never held joins the root for it first, to learn its token hash,
    then checks the caller. Refused callers (a cluster certificate with another job's token, or
    a valid token with no incarnation) left the zone following that job -- a snapshot, then
    every delta, across the WAN, held whole in its memory -- for as long as it ran (review)."""
    from ps.core.errors import BadInput
    from ps.net.rpc import Caller
    from ps.net.wire import pb

    certs, root, zone = _secure_root_and_zone(tree, tmp_path, ["w0", "admin"])
    for var, path in (("CERT", certs["admin"].cert), ("KEY", certs["admin"].key), ("CA", certs["admin"].ca)):
        monkeypatch.setenv(f"HPS_TLS_{var}", path)  # fetch_status's certificate
    maker = ParameterClient(root, "a", "admin", timeout_s=10, retry_s=5, tls=certs["admin"], token=ADMIN)
    maker.create_job(_job("a"), LAYOUT, np.zeros(LAYOUT.numel, np.float32))
    maker2 = ParameterClient(root, "c", "admin", timeout_s=10, retry_s=5, tls=certs["admin"], token=ADMIN)
    maker2.create_job(_job("c"), LAYOUT, np.zeros(LAYOUT.numel, np.float32))
    token_a, token_c = maker.minted, maker2.minted
    maker.close()
    maker2.close()
    held = lambda: tree.lt.call(lambda: sorted(tree.tier("eu-a").jobs))  # noqa: E731
    stranger = ParameterClient(zone, "c", "w0", timeout_s=5, retry_s=1, tls=certs["w0"], token=token_a)
    with pytest.raises((PermissionDenied, Unauthenticated)):
        stranger.register()
    stranger.close()
    assert held() == [], held()
    with Caller(zone, certs["w0"], token_c) as rpc, pytest.raises(BadInput, match="incarnation"):
        rpc.call("Register", pb.RegisterRequest(job="c", member="w0", role=pb.ROLE_WORKER), 5)
    assert held() == [], held()
    wait_for(lambda: not [m for j in fetch_status(root, token=ADMIN).jobs if j.name == "c" for m in j.members],
             "the zone to leave the root's rounds of c")
    w = ParameterClient(zone, "c", "w0", timeout_s=10, retry_s=5, tls=certs["w0"], token=token_c)
    try:
        w.register()  # the job's own token still joins it there
        assert held() == ["c"]
    finally:
        w.close()
