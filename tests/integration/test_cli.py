"""The README's contract, run as a user would: `hps demo`, `hps launch` + `hps status`, flags
and their HPS_* environment fallbacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ps.tools.launch import Cluster, default_topology

HPS = [sys.executable, "-m", "ps.tools.cli"]


def test_launch_then_status_shows_the_whole_tree(tmp_path):
    topo = default_topology()
    topo["settings"] = {"heartbeat_s": 0.1, "member_timeout_s": 1.0}
    with Cluster.start(topo, tmp_path / "logs") as cluster:
        assert len(cluster.tiers) == 7
        text = ""
        for _ in range(50):  # relays announce themselves with their first heartbeat
            r = subprocess.run(HPS + ["status", cluster.address("root")], capture_output=True,
                               text=True, timeout=30)
            text = r.stdout
            if all(f" {n} @" in text for n in ("eu", "us", "eu-a", "eu-b", "us-a", "us-b")):
                break
        assert r.returncode == 0, r.stderr
        for name in ("root", "eu", "us", "eu-a", "eu-b", "us-a", "us-b"):
            assert f" {name} @" in text, text
    for t in cluster.tiers.values():
        assert t.proc.poll() is not None  # every tier stopped


def test_serve_flags_fall_back_to_environment_and_errors_are_sentences():
    env = {**os.environ, "HPS_ROLE": "zone"}
    r = subprocess.run(HPS + ["serve"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "needs --parent" in r.stderr
    env["HPS_MEMBER_TIMEOUT_S"] = "0.1"
    env["HPS_PARENT"] = "127.0.0.1:1"
    r = subprocess.run(HPS + ["serve"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "shorter than the member timeout (0.1s)" in r.stderr


def test_job_create_list_end_through_a_relay(tree):
    import pytest
    import torch

    from ps.core.errors import UnknownJob
    from worker import HpsOptimizer

    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")

    def hps_job(*args):
        return subprocess.run(HPS + ["job", *args, "--address", zone], capture_output=True, text=True, timeout=60)

    r = hps_job("create", "lm", "--mode", "ssp", "--staleness", "2", "--optimizer", "adam", "--lr", "0.01")
    assert r.returncode == 0 and "declared" in r.stdout, r.stderr
    r = hps_job("list")
    assert "lm" in r.stdout and "declared" in r.stdout and "ssp(2)" in r.stdout, r.stdout
    r = hps_job("create", "lm", "--mode", "bsp")
    assert r.returncode == 2 and "another configuration" in r.stderr and "mode ssp(2)" in r.stderr

    model = torch.nn.Linear(3, 1)
    opt = HpsOptimizer(model, zone, "lm", worker_id="w0")  # adopts the declared configuration
    assert opt.mode == "ssp" and opt.staleness == 2
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    opt.sync()
    r = hps_job("list")
    assert "running" in r.stdout and "4" in r.stdout  # 4 parameters

    r = hps_job("end", "lm")
    assert r.returncode == 0 and "ended at version" in r.stdout, r.stderr
    with pytest.raises(UnknownJob, match="has ended"):
        for _ in range(50):  # the zone learns from its parent within a pull or two
            opt.zero_grad()
            model(torch.ones(2, 3)).sum().backward()
            opt.step()
            opt.sync(timeout_s=5)
    r = hps_job("create", "lm")
    assert r.returncode == 2 and "has ended" in r.stderr
    assert "ended" in hps_job("list").stdout
    with pytest.raises(UnknownJob, match="not declared"):
        HpsOptimizer(torch.nn.Linear(2, 2), zone, "nope", worker_id="w1")
    opt.close()


def test_demo_trains_on_the_default_topology_with_mutual_tls_and_tokens_and_leaks_no_secret(tmp_path):
    """One demo run (each costs ~30 s of start-up here): what it reports, and what it keeps secret."""
    out = tmp_path / "demo"
    r = subprocess.run(HPS + ["demo", "--steps", "4", "--out", str(out)], capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "replicas agree with the root bit for bit: yes" in r.stdout
    assert "step    4/4" in r.stdout
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert [w["steps"] for w in summary["workers"]] == [4, 4, 4, 4]
    assert {t["role"] for t in summary["tiers"]} == {"global", "regional", "zone"}
    root = next(t for t in summary["tiers"] if t["role"] == "global")
    assert root["version"] == 4 and root["push_in_bytes"] > 0
    assert "mutual TLS and tokens" in r.stdout and "INSECURE" not in r.stdout
    secrets_dir = out / "logs" / "secrets"
    admin = (secrets_dir / "admin-token").read_text().strip()
    job = (secrets_dir / "demo.token").read_text().strip()
    keys = [p.read_text().strip().splitlines()[1] for p in (secrets_dir / "certs").glob("*.key")]
    assert len(admin) >= 32 and len(job) >= 32 and len(keys) >= 8
    for p in [(secrets_dir / "admin-token"), (secrets_dir / "demo.token"), *(secrets_dir / "certs").glob("*.key")]:
        assert p.stat().st_mode & 0o077 == 0, p  # nobody but the owner reads a secret
    # Everything the run printed or logged, the tiers' logs and the summary: no token, no key.
    texts = {"stdout": r.stdout, "stderr": r.stderr}
    for p in out.rglob("*"):
        if p.is_file() and secrets_dir not in p.parents and p.suffix != ".png":
            texts[str(p)] = p.read_text(errors="replace")
    assert len(texts) > 8
    for where, text in texts.items():
        for secret in (admin, job, *keys):
            assert secret not in text, where


def test_job_create_takes_any_torch_optimizer_with_options_and_groups(tree):
    from ps.core.config import OptimizerConfig, ParamGroup

    root = tree.add("root", "global")

    def hps_job(*args):
        return subprocess.run(HPS + ["job", "create", *args, "--address", root], capture_output=True, text=True,
                              timeout=60)

    r = hps_job("t", "--optimizer", "AdamW", "--lr", "3e-4", "--opt", "betas=0.9,0.95", "--opt", "amsgrad=true",
                "--group", "*.bias,*norm*:weight_decay=0,lr=1e-4", "--clip-grad-norm", "1.5", "--warmup-steps", "10")
    assert r.returncode == 0 and "declared" in r.stdout, r.stderr
    want = OptimizerConfig(kind="adamw", lr=3e-4, warmup_steps=10, clip_grad_norm=1.5,
                           options=(("amsgrad", True), ("betas", (0.9, 0.95))),
                           groups=(ParamGroup(("*.bias", "*norm*"), (("lr", 1e-4), ("weight_decay", 0))),))
    assert tree.lt.call(lambda: tree.tier("root").declared["t"].optimizer) == want
    r = hps_job("u", "--optimizer", "rmsprop", "--opt", "momentom=0.9")
    assert r.returncode == 2 and "RMSprop takes no option 'momentom'" in r.stderr, r.stderr
    r = hps_job("u", "--optimizer", "lbfgs")
    assert r.returncode == 2 and "closure" in r.stderr, r.stderr
    r = hps_job("u", "--group", "*.bias")
    assert r.returncode == 2 and "PATTERN[,PATTERN]:KEY=VALUE" in r.stderr, r.stderr
    r = hps_job("o", "--mode", "outer", "--inner-steps", "4", "--asynchronous", "--overlap", "--damping",
                "--nesterov-delay", "3", "--dynamic-steps", "--sync-wait-s", "30")
    assert r.returncode == 0 and "declared" in r.stdout, (r.stdout, r.stderr)
    outer = tree.lt.call(lambda: tree.tier("root").declared["o"])
    assert outer.damping and outer.outer.asynchronous and outer.outer.overlap and outer.outer.inner_steps == 4
    assert outer.outer.nesterov_delay == 3 and outer.outer.dynamic_steps and outer.outer.sync_wait_s == 30
    r = hps_job("o3", "--mode", "outer", "--sync-wait-s", "-1")
    assert r.returncode == 2 and "sync_wait_s must be a number of seconds" in r.stderr, r.stderr
    r = hps_job("o2", "--mode", "outer", "--dynamic-steps")
    assert r.returncode == 2 and "dynamic_steps applies to asynchronous" in r.stderr, r.stderr
    r = hps_job("v", "--mode", "bsp", "--damping")
    assert r.returncode == 2 and "damping applies to ssp, async and asynchronous outer jobs" in r.stderr, r.stderr
