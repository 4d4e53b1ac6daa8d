"""deploy/k8s runs the global root as a hot-standby pair (issue 15): a StatefulSet of two whose
pod template picks each pod's flags by its ordinal. Checked three ways: the rendered objects say
so (two replicas, stable names, lease, anti-affinity, budget); the pod's own command, run by
/bin/sh with a stand-in `hps`, gives ordinal 0 `--standby <pod 1>` and ordinal 1 `--standby-of
<pod 0>`; and the same command with the real `hps` on loopback makes a primary and a standby
that takes over, under mutual TLS and the admin token as in the pods.

tests/deploy/test_deploy.py holds the rest of the manifests' checks (the regional masters'
parents, the network policies between the roots, the certificate's names).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.deploy.test_deploy import ROOT_PARENTS, ROOT_PODS, _selects, env_of, hps_container, render, workloads

ADMIN = "pair-admin-token"


def pod_env(objs: list[dict], w: dict, pod: str) -> dict[str, str]:
    """The environment the kubelet gives the hps container of pod ``pod`` of workload ``w``: the
    ConfigMap's keys (envFrom), then ``env`` in order with ``$(VAR)`` expanded from what came
    before (Kubernetes' rule), the Downward API's pod name and namespace, a resource limit."""
    c = hps_container(w)
    out: dict[str, str] = {}
    for ref in c.get("envFrom", []):
        (cm,) = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == ref["configMapRef"]["name"]]
        out.update(cm["data"])
    fields = {"metadata.name": pod, "metadata.namespace": w["metadata"]["namespace"]}

    def expand(m: re.Match) -> str:
        return "$" if m.group(0) == "$$" else out.get(m.group(1), m.group(0))

    for e in c.get("env", []):
        if "value" in e:
            out[e["name"]] = re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", expand, e["value"])
        elif "fieldRef" in e["valueFrom"]:
            out[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = e["valueFrom"]["resourceFieldRef"]
            kind, _, name = ref["resource"].partition(".")
            out[e["name"]] = str(c["resources"][kind][name])
    return out


@pytest.fixture(scope="module")
def global_objs() -> list[dict]:
    return render("global")


def _root(objs: list[dict]) -> dict:
    return workloads(objs)["hps-root"]


def test_the_root_is_a_statefulset_of_two_each_with_its_own_volume_and_stable_name(global_objs):
    root = _root(global_objs)
    spec, labels = root["spec"], root["spec"]["template"]["metadata"]["labels"]
    assert root["kind"] == "StatefulSet" and spec["replicas"] == 2
    # OrderedReady would not recreate pod 1 while pod 0 is not ready: each half on its own.
    assert spec["podManagementPolicy"] == "Parallel"
    # Each pod its own volume (ROOT.json, the term, is per root): a claim template, not a volume.
    env = env_of(hps_container(root))
    (claim,) = spec["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in hps_container(root)["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == env["HPS_CHECKPOINT_DIR"]["value"]
    assert claim["metadata"]["name"] not in {v["name"] for v in spec["template"]["spec"]["volumes"]}
    # The governing Service is headless and publishes every pod's name, ready or not.
    (svc,) = [o for o in global_objs if o["kind"] == "Service" and o["metadata"]["name"] == spec["serviceName"]]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"].items() <= labels.items()
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
    names = [f"{root['metadata']['name']}-{i}.{svc['metadata']['name']}.{svc['metadata']['namespace']}"
             f".svc.cluster.local:{port}" for i in range(spec["replicas"])]
    assert names == ROOT_PODS
    # The pair's addresses, as each pod's script reads them, are those names in ordinal order.
    for i in range(spec["replicas"]):
        assert pod_env(global_objs, root, f"hps-root-{i}")["ROOT_PAIR"] == ROOT_PARENTS
    # The lease is set here, not left to the default, and is one `hps serve` accepts.
    from ps.core.config import ServerConfig
    lease = float(env["HPS_LEASE_S"]["value"])
    ServerConfig(role="global", checkpoint_dir="/var/lib/hps", standby=ROOT_PODS[1], lease_s=lease)
    assert 2.0 <= lease <= 30.0, lease
    # Two nodes: a required anti-affinity on the hostname against the root's own pods.
    (term,) = spec["template"]["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert _selects(term["labelSelector"], labels)
    # At most one root down at a time, and never a budget that blocks every drain.
    (pdb,) = [o for o in global_objs if o["kind"] == "PodDisruptionBudget"
              and o["spec"]["selector"]["matchLabels"].items() <= labels.items()]
    allowed_down = pdb["spec"].get("maxUnavailable", spec["replicas"] - pdb["spec"].get("minAvailable", 0))
    assert allowed_down == 1, pdb["spec"]


def _run_script(objs: list[dict], root: dict, ordinal: int, bin_dir: Path) -> tuple[int, bool, list[str], str]:
    """(exit status, whether `hps` ran as the shell's own process, its arguments, stderr)."""
    env = {**pod_env(objs, root, f"hps-root-{ordinal}"), "PATH": f"{bin_dir}:/usr/bin:/bin"}
    c = hps_container(root)
    p = subprocess.Popen(c["command"] + c["args"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=30)
    pid, *argv = out.split() or ["0"]
    return p.returncode, int(pid) == p.pid, argv, err


def test_each_root_pod_starts_with_the_flags_its_ordinal_gives_it(global_objs, tmp_path):
    """The container's own command (rendered), run by /bin/sh with a stand-in `hps` that prints
    its PID and arguments: exactly one ordinal is a standby, of the other pod's stable name."""
    if shutil.which("sh") is None:
        pytest.skip("no /bin/sh")
    root = _root(global_objs)
    assert hps_container(root)["command"][0] == "/bin/sh"
    fake = tmp_path / "hps"
    fake.write_text('#!/bin/sh\necho "$$ $*"\n')
    fake.chmod(0o755)
    started = {}
    for i in range(root["spec"]["replicas"]):
        rc, same_process, argv, err = _run_script(global_objs, root, i, tmp_path)
        assert rc == 0, err
        assert same_process, "hps must replace the shell (exec): PID 1 in the pod, so SIGTERM reaches it"
        started[i] = argv
    assert started == {0: ["serve", "--standby", ROOT_PODS[1]], 1: ["serve", "--standby-of", ROOT_PODS[0]]}
    rc, _, argv, err = _run_script(global_objs, root, 2, tmp_path)  # a third replica: refused, loudly
    assert rc == 2 and not argv and "ordinals 0 and 1" in err


# -- the rendered pair, run -----------------------------------------------------------------------
def _free_port() -> int:
    # The two roots name each other, so each needs its port before either starts: ask the kernel
    # for a free one and let it go (the roots bind them a moment later).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pod:
    """One root pod's container, run here: the rendered command and environment with the
    mounted files' paths, the loopback addresses and a short lease put in; stopped by PID."""

    def __init__(self, objs: list[dict], root: dict, ordinal: int, tmp: Path, pair: list[str],
                 files: dict[str, str], reap) -> None:
        self.ordinal, self.tmp, self.reap, self.address = ordinal, tmp, reap, pair[ordinal]
        self.argv = hps_container(root)["command"] + hps_container(root)["args"]
        env = pod_env(objs, root, f"hps-root-{ordinal}")
        assert env["ROOT_PAIR"] == ROOT_PARENTS  # what is replaced below: the stable names, nothing else
        self.env = {**env, **files, "ROOT_PAIR": ",".join(pair), "HPS_LISTEN": self.address,
                    "HPS_HEALTH_PORT": "0", "HPS_METRICS_PORT": "-1", "OMP_NUM_THREADS": "1",
                    "HPS_CHECKPOINT_DIR": str(tmp / f"volume-{ordinal}"),
                    "HPS_LEASE_S": "2",  # the manifest's 5 s, shortened: a takeover in a test
                    "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
        self.starts = 0
        self.start()

    def start(self) -> None:
        self.starts += 1
        self.log = self.tmp / f"hps-root-{self.ordinal}.{self.starts}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.reap(self.proc)

    def status(self):
        from ps.tools.status import fetch_status
        return fetch_status(self.address, timeout_s=2.0, token=ADMIN)

    def state(self) -> tuple:
        try:
            st = self.status()
        except Exception as exc:  # not listening yet
            return ("down", type(exc).__name__)
        return (st.root_state, st.term, st.parent_reachable)

    def jobs(self) -> list[tuple[int, int]] | None:
        """(version, checksum) of each job it holds; None while it does not answer."""
        try:
            return [(j.version, j.checksum) for j in self.status().jobs]
        except Exception:
            return None

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def _wait(cond, what: str, pods: list[Pod], timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        for p in pods:
            assert p.proc.poll() is None, f"hps-root-{p.ordinal} exited {p.proc.returncode}:\n{p.text()[-3000:]}"
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}: " + "; ".join(f"{p.ordinal}: {p.state()}" for p in pods))


def test_the_rendered_root_pair_runs_a_primary_and_a_standby_that_takes_over(global_objs, tmp_path, reap,
                                                                          monkeypatch):
    """The root pods' command with the real `hps`, on loopback. Pod 0 becomes the primary, pod 1
    its standby in sync; a worker that lists both trains; kill -9 of pod 0: pod 1 takes over with
    term 1 and every acknowledged version; pod 0 restarted as the StatefulSet restarts it (same
    command, same volume) rejoins as the standby and does not make itself primary again."""
    if shutil.which("sh") is None or not (Path(sys.executable).parent / "hps").exists():
        pytest.skip("needs /bin/sh and the venv's hps")
    from ps.core.config import JobConfig
    from ps.core.view import KeySpec, Layout
    from ps.tools.certs import issue
    from worker import ParameterClient

    root = _root(global_objs)
    # Both pods mount one Secret (one certificate, hps://global/root) and the admin token.
    tier = issue(tmp_path / "certs", "global", "root")
    worker = issue(tmp_path / "certs", "worker", "w0")
    (tmp_path / "admin").write_text(ADMIN + "\n")
    files = {"HPS_TLS_CERT": tier.cert, "HPS_TLS_KEY": tier.key, "HPS_TLS_CA": tier.ca,
             "HPS_ADMIN_TOKEN_FILE": str(tmp_path / "admin")}
    for k in ("CERT", "KEY", "CA"):  # this process's Status calls: mutual TLS, as a worker
        monkeypatch.setenv(f"HPS_TLS_{k}", getattr(worker, k.lower()))
    pair = [f"127.0.0.1:{_free_port()}" for _ in range(2)]
    pods = [Pod(global_objs, root, i, tmp_path, pair, files, reap) for i in range(2)]
    p0, p1 = pods

    _wait(lambda: p0.state()[0] == "primary" and p1.state()[:3] == ("standby", 0, True), "primary and standby", pods)
    # hps is the process the StatefulSet signals (exec), started as its ordinal says
    cmdline = Path(f"/proc/{p0.proc.pid}/cmdline").read_bytes().split(b"\0")
    assert b"serve" in cmdline and cmdline[-3:-1] == [b"--standby", pair[1].encode()], cmdline
    # What the runbook runs in a pod (kubectl exec ... hps status 127.0.0.1:7000), with the pod's
    # own environment (its certificate and admin token): a standby names its primary as parent.
    out = subprocess.run([str(Path(sys.executable).parent / "hps"), "status", p1.address], env=p1.env,
                         capture_output=True, text=True, timeout=60)
    assert f"parent {pair[0]} (up)" in out.stdout and "standby (term 0)" in out.stdout, out.stdout + out.stderr

    # The admin's worker creates the job and from then on acts with the job's own token, which
    # the primary minted and sent to its standby: the new primary must accept it after the kill.
    layout = Layout([KeySpec("w", (64,))])
    c = ParameterClient(",".join(pair), "pair", "w0", timeout_s=10, retry_s=60, tls=worker, token=ADMIN)
    c.create_job(JobConfig(name="pair"), layout, np.zeros(layout.numel, np.float32))
    assert c._rpc.token != ADMIN  # the job's token
    c.register()
    c.pull()
    seen: dict[int, int] = {}

    def train(steps: range) -> None:
        for s in steps:
            v, _ = c.push(np.full(layout.numel, 0.01 * (s + 1), np.float32), clock=s)
            c.pull(min_version=v)
            seen[v] = c.view.checksum

    train(range(5))
    _wait(lambda: p1.jobs() == [(max(seen), seen[max(seen)])], "the standby at the last version", pods)

    os.kill(p0.proc.pid, signal.SIGKILL)  # the primary's node is gone
    p0.proc.wait(10)
    train(range(5, 8))  # the worker moves to pod 1 once it took over
    st = p1.status()
    assert (st.root_state, st.term) == ("primary", 1)
    (j,) = st.jobs
    assert len(seen) == 8 and (j.version, j.checksum) == (max(seen), seen[max(seen)])  # nothing acknowledged lost

    p0.start()  # what the StatefulSet does: the same command on the same volume
    _wait(lambda: p0.state()[:3] == ("standby", 1, True), "the old primary to rejoin as the standby", pods)
    train(range(8, 10))
    _wait(lambda: p0.jobs() == [(max(seen), seen[max(seen)])], "the rejoined standby at the last version", pods)
    assert "serving as the primary root" not in p0.text() and "promoted to primary" not in p0.text(), \
        p0.text()[-3000:]
    assert p1.state()[:2] == ("primary", 1)
    c.close()

    for p in pods:  # SIGTERM to the PID the kubelet would signal: a clean stop, not a killed shell
        os.kill(p.proc.pid, signal.SIGTERM)
    for p in pods:
        assert p.proc.wait(30) == 0, p.text()[-3000:]


def test_operating_has_the_root_pairs_runbook():
    text = (Path(__file__).resolve().parents[2] / "deploy" / "OPERATING.md").read_text()
    section = text.split("\n### The root pair in Kubernetes\n", 1)[1].split("\n### ", 1)[0]
    for needed in ("hps-root-0", "hps-root-1", "ROOT.json", "hps status 127.0.0.1:7000", "hps_root_primary",
                   "hps promote 127.0.0.1:7000 --force", "delete pvc", "--force --grace-period=0", "HPS_LEASE_S"):
        assert needed in section, needed
