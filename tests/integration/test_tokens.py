"""Tokens against real tiers on loopback: job A's token cannot act in job B, a job token cannot
create or end jobs, refusals change nothing and are counted, no token leaks into logs, metrics,
`hps status` or error sentences, and the root still knows every job's token after kill -9."""

from __future__ import annotations

import io
import logging
import signal
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from ps.core.codecs import get_codec
from ps.core.config import JobConfig, OptimizerConfig, ServerConfig
from ps.core.errors import HpsError, PermissionDenied, Unauthenticated
from ps.core.tensors import split
from ps.core.types import PushMeta
from ps.core.view import KeySpec, Layout
from ps.net.rpc import Caller
from ps.net.wire import encode_create_job, encode_push, pb
from ps.server.lifecycle import create_server
from ps.tools import jobctl
from ps.tools.launch import Cluster
from ps.tools.status import fetch_status, print_tree
from tests.helpers import FAST
from worker import ParameterClient

LAYOUT = Layout([KeySpec("w", (4, 3))])
ADMIN = "admin-token-for-tests-0123456789abcdef"


def _job(name: str) -> JobConfig:
    return JobConfig(name=name, optimizer=OptimizerConfig(kind="sgd", lr=0.1))


def _refused(fn) -> HpsError:
    with pytest.raises((Unauthenticated, PermissionDenied)) as info:
        fn()
    return info.value


def _push_frames(job: str) -> list[bytes]:
    chunks = split(LAYOUT, np.ones(LAYOUT.numel, np.float32), get_codec("fp32"))
    return encode_push(PushMeta(job, "intruder", 1, 0, incarnation=7), chunks)


def test_job_tokens_stay_in_their_job_and_never_leak(tree, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    admin_file = tmp_path / "admin"
    admin_file.write_text(ADMIN + "\n")
    registry = CollectorRegistry()
    server = tree.lt.run(create_server(ServerConfig(role="global", name="root", admin_token_file=str(admin_file),
                                                    **FAST), registry))
    tree.servers["root"] = server
    root = tree.addr("root")
    zone = tree.add("eu-a", "zone", parent="root", admin_token_file=str(admin_file))

    created_a, token_a = jobctl.create(root, _job("a"), ADMIN)
    created_b, token_b = jobctl.create(zone, _job("b"), ADMIN)   # relayed: the root mints, the zone hands it on
    assert created_a and created_b and token_a and token_b and token_a != token_b
    assert jobctl.create(root, _job("a"), ADMIN) == (False, "")   # printed once, never again

    workers = {}
    for job, token in (("a", token_a), ("b", token_b)):
        w = ParameterClient(zone, job, f"w-{job}", timeout_s=10, retry_s=5, token=token)
        assert w.create_job(job, LAYOUT, np.zeros(LAYOUT.numel, np.float32))
        w.register()
        w.pull(min_version=0)
        v, _ = w.push(np.ones(LAYOUT.numel, np.float32))
        w.pull(min_version=v)
        workers[job] = w
    before = fetch_status(root, token=ADMIN)
    errors: list[HpsError] = []

    # Job A's token, at the zone and at the root, in job B: register, push, pull, status, end.
    for address in (zone, root):
        intruder = ParameterClient(address, "b", "intruder", timeout_s=5, retry_s=1, token=token_a)
        errors.append(_refused(intruder.register))
        intruder.close()
        with Caller(address, token=token_a) as rpc:
            errors.append(_refused(lambda rpc=rpc: rpc.call("Push", iter(_push_frames("b")), 5)))
            errors.append(_refused(lambda rpc=rpc: rpc.stream("Pull", pb.PullRequest(job="b", member="w-b"), 5)))
            errors.append(_refused(lambda rpc=rpc: rpc.call("Leave", pb.LeaveRequest(job="b", member="w-b"), 5)))
            errors.append(_refused(lambda rpc=rpc: rpc.call("EndJob", pb.EndJobRequest(job="b"), 5)))
            errors.append(_refused(lambda rpc=rpc: rpc.call("ListJobs", pb.ListJobsRequest(), 5)))
            errors.append(_refused(lambda rpc=rpc: rpc.call(
                "CreateJob", iter(encode_create_job(_job("c"), None, [])), 5)))
            assert [j.name for j in fetch_status(address, token=token_a).jobs] == ["a"]  # its own job only
        for token in (None, "not-a-token"):  # no credential, or one nobody issued
            with Caller(address, token=token) as rpc:
                errors.append(_refused(lambda rpc=rpc: rpc.call("ListJobs", pb.ListJobsRequest(), 5)))
                errors.append(_refused(lambda rpc=rpc: rpc.stream("Pull", pb.PullRequest(job="a", member="w-a"), 5)))
                errors.append(_refused(lambda rpc=rpc: rpc.call("Status", pb.StatusRequest(), 5)))
    kinds = {type(e).__name__ for e in errors}
    assert kinds == {"Unauthenticated", "PermissionDenied"}, kinds
    assert all("token" in str(e) for e in errors)  # each sentence says what to supply

    # Nothing changed: job B trains on, and its members and versions are as they were.
    after = fetch_status(root, token=ADMIN)
    assert [(j.name, j.version, len(j.members)) for j in after.jobs] == \
        [(j.name, j.version, len(j.members)) for j in before.jobs]
    v, _ = workers["b"].push(np.ones(LAYOUT.numel, np.float32))
    assert v == before.jobs[[j.name for j in before.jobs].index("b")].version + 1
    errors.append(_refused(lambda: jobctl.end(root, "b", token_b)))  # its own job's token cannot end it

    # A worker holding the admin token creates its job and is handed the job's token.
    boss = ParameterClient(zone, "c", "w-c", timeout_s=10, retry_s=5, token=ADMIN)
    assert boss.create_job(_job("c"), LAYOUT, np.zeros(LAYOUT.numel, np.float32))
    token_c = boss._rpc.token
    assert token_c not in (ADMIN, token_a, token_b)
    boss.register()
    with Caller(root, token=token_c) as rpc:
        assert [j.name for j in fetch_status(root, token=token_c).jobs] == ["c"]
        errors.append(_refused(lambda: rpc.call("EndJob", pb.EndJobRequest(job="c"), 5)))
    boss.close()
    assert jobctl.end(root, "c", ADMIN) >= 0

    metrics = generate_latest(registry).decode()
    assert 'code="PERMISSION_DENIED"' in metrics and 'code="UNAUTHENTICATED"' in metrics
    out = io.StringIO()
    print_tree(root, out, token=ADMIN)
    assert "OPEN" not in out.getvalue() and "job b" in out.getvalue()
    for w in workers.values():
        w.close()
    secrets = (ADMIN, token_a, token_b, token_c)
    for where, text in (("logs", caplog.text), ("metrics", generate_latest(registry).decode()),
                        ("status", out.getvalue()), ("errors", " ".join(map(str, errors)))):
        assert not [s for s in secrets if s in text], f"a token appears in the {where}"


def test_a_job_the_root_holds_no_token_for_is_the_admins_alone_at_its_relays_too(tree, tmp_path):
    """A job restored from before the admin token was set (or resharded from shards whose tokens
    differed) has no token hash: the root lets only the admin act on it. Its registration
    reply told relays b"" for it, which they read as "tokens are off": once the admin's worker
    had brought the job to a zone, anyone could join, push and pull it there (review)."""
    admin_file = tmp_path / "admin"
    admin_file.write_text(ADMIN + "\n")
    tree.add("root", "global", admin_token_file=str(admin_file))
    zone = tree.add("eu-a", "zone", parent="root", admin_token_file=str(admin_file))
    maker = ParameterClient(tree.addr("root"), "old", "w-maker", timeout_s=10, retry_s=5, token=ADMIN)
    assert maker.create_job(_job("old"), LAYOUT, np.zeros(LAYOUT.numel, np.float32))
    token = maker._rpc.token  # the job's, minted for its creator
    maker.close()
    tree.lt.call(lambda: tree.tier("root").tokens.set_hash("old", b""))  # as restored without one
    other = jobctl.create(tree.addr("root"), _job("other"), ADMIN)[1]
    boss = ParameterClient(zone, "old", "w-admin", timeout_s=10, retry_s=5, token=ADMIN)
    boss.register()
    boss.pull(min_version=0)
    errors = []
    for tok in (None, token, other):  # nothing, the job's old token, another job's
        stranger = ParameterClient(zone, "old", "w-stranger", timeout_s=5, retry_s=1, token=tok)
        errors.append(_refused(stranger.register))
        stranger.close()
        with Caller(zone, token=tok) as rpc:
            errors.append(_refused(lambda rpc=rpc: rpc.stream("Pull", pb.PullRequest(job="old", member="w-admin"), 5)))
    assert all("only the admin token acts on it" in str(e) for e in errors), [str(e) for e in errors]
    assert tree.lt.call(lambda: len(tree.tier("eu-a").jobs["old"].members)) == 1
    # The admin gives the job a token (`hps job create` mints one for a job that has none):
    # the zone, which held "admin only" for it, takes it too -- it refused it for good (review).
    _, minted = jobctl.create(tree.addr("root"), _job("old"), ADMIN)
    assert minted and minted != token
    tree.lt.call(lambda: tree.tier("eu-a")._token_asked.clear())  # (the refusals above asked within 5 s)
    joined = ParameterClient(zone, "old", "w-new", timeout_s=10, retry_s=5, token=minted)
    try:
        joined.register()
        joined.pull(min_version=0)
        still = ParameterClient(zone, "old", "w-old", timeout_s=5, retry_s=1, token=token)
        assert "is not the token of job" in str(_refused(still.register))  # the old one stays refused
        still.close()
    finally:
        joined.close()
        boss.close()


def test_a_heartbeat_without_credentials_lists_no_address_for_hps_status_to_visit(tree, tmp_path):
    """A heartbeat naming no job needs no token. Over plaintext anyone could list an address of
    theirs as a relay child of the root, and `hps status`, walking the tree, sent the admin token
    there (security review). An unchecked caller's address is not recorded; a checked one's is."""
    admin_file = tmp_path / "admin"
    admin_file.write_text(ADMIN + "\n")
    tree.add("root", "global", admin_token_file=str(admin_file))
    root = tree.addr("root")
    beat = pb.HeartbeatRequest(member="eu", role=pb.ROLE_ZONE, address="203.0.113.9:7000")
    with Caller(root) as rpc:
        rpc.call("Heartbeat", beat, 5)
    assert not [c.address for c in fetch_status(root, token=ADMIN).children]
    with Caller(root, token=ADMIN) as rpc:
        rpc.call("Heartbeat", beat, 5)
    assert [c.address for c in fetch_status(root, token=ADMIN).children] == ["203.0.113.9:7000"]


def test_a_workers_registered_address_is_not_visited_by_hps_status_and_no_child_is_a_global_root(tree, tmp_path):
    """A job token's holder registered as a worker with an address of theirs; `hps status`,
    walking every member's address, called it with the admin token. Only relays' addresses are
    walked now, and a member claiming the global role is refused."""
    from ps.tools.status import walk
    admin_file = tmp_path / "admin"
    admin_file.write_text(ADMIN + "\n")
    tree.add("root", "global", admin_token_file=str(admin_file))
    root = tree.addr("root")
    w = ParameterClient(root, job="walk", worker_id="w0", token=ADMIN)
    try:
        w.create_job(_job("walk"), LAYOUT, np.zeros(LAYOUT.numel, np.float32))
        reg = pb.RegisterRequest(job="walk", member="collector", role=pb.ROLE_WORKER, address="203.0.113.9:7000",
                                 incarnation=9)
        with Caller(root, token=w.minted) as rpc:
            rpc.call("Register", reg, 5)
            with pytest.raises(HpsError, match="not enum value"):
                rpc.call("Register", pb.RegisterRequest(job="walk", member="g", role=pb.ROLE_GLOBAL,
                                                        address="203.0.113.9:7001", incarnation=9), 5)
        visited = [address for _, address, _, _ in walk(root, token=ADMIN)]
    finally:
        w.close()
    assert visited == [root]


def test_a_job_token_holder_posing_as_a_relay_is_not_visited_by_hps_status_and_a_real_relay_is(tree, tmp_path):
    """Over plaintext the root cannot tell a zone from a job token's holder who says it is one:
    registered and heartbeating as a "zone" at an address of theirs, with the job's token, they
    were visited by `hps status` with the admin token (security review). Only the addresses a
    relay certificate or the admin token vouches for are visited; a real zone, whose heartbeats
    present the admin token its tier holds, still is."""
    from ps.tools.status import walk
    admin_file = tmp_path / "admin"
    admin_file.write_text(ADMIN + "\n")
    tree.add("root", "global", admin_token_file=str(admin_file))
    root = tree.addr("root")
    zone = tree.add("eu-a", "zone", parent="root", admin_token_file=str(admin_file))
    w = ParameterClient(root, job="walk", worker_id="w0", token=ADMIN)
    z = None
    try:
        w.create_job(_job("walk"), LAYOUT, np.zeros(LAYOUT.numel, np.float32))
        z = ParameterClient(zone, job="walk", worker_id="wz", token=w.minted)
        z.register()  # the zone registers with the root for the job, and heartbeats
        with Caller(root, token=w.minted) as rpc:
            rpc.call("Register", pb.RegisterRequest(job="walk", member="collector", role=pb.ROLE_ZONE,
                                                    address="203.0.113.9:7000", incarnation=9), 5)
            rpc.call("Heartbeat", pb.HeartbeatRequest(member="collector", role=pb.ROLE_ZONE, jobs=["walk"],
                                                      address="203.0.113.9:7001"), 5)
        for _ in range(100):  # the zone's first heartbeat (every heartbeat_s)
            if any(c.member == "eu-a" for c in fetch_status(root, token=ADMIN).children):
                break
            time.sleep(0.1)
        visited = [address for _, address, _, _ in walk(root, token=ADMIN)]
        members = {m.member: m.address for j in fetch_status(root, token=ADMIN).jobs for m in j.members}
    finally:
        w.close()
        if z is not None:
            z.close()
    assert visited == [root, zone], visited
    assert members["collector"] == "", members   # its registration counts; its address is not listed


def test_a_heartbeat_without_a_token_keeps_no_member_of_an_admin_only_job_alive(tree, tmp_path):
    """The root cannot check a job token for a job it holds no token hash for; a token-less
    heartbeat naming it and one of its members kept that member alive (a dead one held its BSP
    round until the round timeout) and said whether it was a member."""
    admin_file = tmp_path / "admin"
    admin_file.write_text(ADMIN + "\n")
    tree.add("root", "global", admin_token_file=str(admin_file))
    root = tree.addr("root")
    maker = ParameterClient(root, "old", "w-maker", timeout_s=10, retry_s=5, token=ADMIN)
    maker.create_job(_job("old"), LAYOUT, np.zeros(LAYOUT.numel, np.float32))
    maker.close()
    tree.lt.call(lambda: tree.tier("root").tokens.set_hash("old", b""))  # as restored without one
    boss = ParameterClient(root, "old", "w-admin", timeout_s=10, retry_s=5, token=ADMIN)
    try:
        boss.register()
        seen = lambda: tree.lt.call(lambda: tree.tier("root").jobs["old"].members.find("w-dead").last_seen)  # noqa: E731
        reg = pb.RegisterRequest(job="old", member="w-dead", role=pb.ROLE_WORKER, incarnation=5)
        with Caller(root, token=ADMIN) as rpc:
            rpc.call("Register", reg, 5)
        before = seen()
        with Caller(root) as rpc:
            rpc.call("Heartbeat", pb.HeartbeatRequest(member="w-dead", jobs=["old"], role=pb.ROLE_WORKER), 5)
        assert seen() == before
    finally:
        boss.close()


def test_a_tier_without_an_admin_token_is_open_and_says_so(tree, caplog):
    root = tree.add("root", "global")
    assert "NO ADMIN TOKEN" in caplog.text
    assert jobctl.create(root, _job("open"), None) == (True, "")   # no token minted, none needed
    out = io.StringIO()
    print_tree(root, out)
    assert "OPEN: no admin token" in out.getvalue()


def test_job_tokens_survive_a_root_kill_9(tmp_path):
    admin_file = tmp_path / "admin"
    admin_file.write_text(ADMIN)
    topo = {"host": "127.0.0.1", "settings": {"heartbeat_s": 0.2, "member_timeout_s": 3.0},
            "root": {"name": "root", "port": 0, "checkpoint_dir": str(tmp_path / "ckpt")}}
    with Cluster.start(topo, tmp_path / "logs", extra_root_args=["--admin-token-file", str(admin_file)]) as cluster:
        addr = cluster.address("root")
        _, token_a = jobctl.create(addr, _job("a"), ADMIN)
        _, token_b = jobctl.create(addr, _job("b"), ADMIN)
        w = ParameterClient(addr, "a", "w0", timeout_s=10, token=token_a)
        w.create_job("a", LAYOUT, np.zeros(LAYOUT.numel, np.float32))
        w.register()
        w.pull(min_version=0)
        v, _ = w.push(np.ones(LAYOUT.numel, np.float32))
        w.close()
        assert (tmp_path / "ckpt" / "job-tokens.json").stat().st_mode & 0o777 == 0o600
        cluster.restart("root", signal.SIGKILL)
        again = ParameterClient(addr, "a", "w0", timeout_s=10, retry_s=30, token=token_a)
        again.register()                                   # the job's token is still its token
        again.pull(min_version=v)
        again.close()
        intruder = ParameterClient(addr, "a", "w1", timeout_s=10, retry_s=1, token=token_b)
        _refused(intruder.register)                        # and another job's is still refused
        intruder.close()
        assert {r["config"].name for r in jobctl.list_jobs(addr, ADMIN)} == {"a", "b"}
        logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
        assert not [s for s in (ADMIN, token_a, token_b) if s in logs]


def test_checking_a_heartbeat_hashes_each_token_once_whatever_it_names(monkeypatch):
    """A heartbeat names up to 1000 jobs and presents as many tokens as gRPC's metadata holds:
    each job's check hashed every token, twice, so one job token's holder could send ~10^5
    SHA-256s per call to the root's event loop and starve every other call (review). The
    tokens are hashed once per call now; the outcome is unchanged."""
    import ps.server.auth as auth

    guard = auth.Guard(ADMIN)
    token = guard.mint("j")
    guard.mint("other")
    hashed = []
    real = auth.digest
    monkeypatch.setattr(auth, "digest", lambda t: hashed.append(t) or real(t))
    junk = tuple(f"junk-{i}" for i in range(200))
    assert guard.check_known(junk + (token,), ["j"] * 1000 + ["unknown"]) == ["j"]
    assert len(hashed) == len(junk) + 1, len(hashed)
    with pytest.raises(Unauthenticated):
        guard.check_known(junk, ["j"] * 1000)
    with pytest.raises(PermissionDenied):  # another job's token: said so
        guard.check_known((guard.mint("third"),), ["j"])
    assert guard.check_known((ADMIN,), ["j", "other"]) == ["j", "other"]
    assert guard.check_known((), ["unknown"]) == []
