"""deploy/k8s/overlays/global-sharded runs the global root as N root shards: base/root's
StatefulSet patched to N replicas whose pod script starts ordinal i as `hps serve --shard i/N`,
with no standby flags, a budget that allows no voluntary disruption, and a network policy that
admits the workers (which reach every shard directly) instead of relays.

Checked from the sources as plain YAML (no kubectl needed: the script, run by /bin/sh with a
stand-in `hps`, the patches, the runbook's HPS_ADDRESS), then rendered with `kubectl kustomize`
(schemas, the rendered script, the network policies with test_deploy.py's model), and the
rendered pods' command run with the real `hps` on loopback: N shards under mutual TLS that a
worker listing their addresses in shard order trains a sharded job on.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.deploy.test_deploy import (
    DEPLOY,
    GRPC_PORT,
    HEALTH_PORT,
    K8S,
    K8S_VERSIONS,
    _load,
    _selects,
    allowed,
    check_container,
    check_no_plain_secrets,
    env_of,
    hps_container,
    render,
    render_dir,
    workloads,
)
from tests.deploy.test_root_pair import _free_port, pod_env

OVERLAY = K8S / "overlays" / "global-sharded"
NAMESPACE = "hps-global"
ADMIN = "shard-admin-token"


def shard_address(i: int) -> str:
    """Shard i's stable name (StatefulSet hps-root, headless Service hps-root)."""
    return f"hps-root-{i}.hps-root.{NAMESPACE}.svc.cluster.local:{GRPC_PORT}"


def hps_address(n: int) -> str:
    """What the workers of a job sharded over n roots set: every shard, in shard order, ';' between."""
    return ";".join(shard_address(i) for i in range(n))


def _patch(name: str) -> dict:
    (doc,) = _load(OVERLAY / name)
    return doc


def _shards_in_sources() -> int:
    patch = _patch("statefulset.yaml")
    return int(env_of(hps_container(patch))["ROOT_SHARDS"]["value"])


def _sh_available() -> None:
    if shutil.which("sh") is None:
        pytest.skip("no /bin/sh")


def _fake_hps(bin_dir: Path) -> Path:
    """A stand-in `hps` that prints its PID and its arguments."""
    fake = bin_dir / "hps"
    fake.write_text('#!/bin/sh\necho "$$ $*"\n')
    fake.chmod(0o755)
    return bin_dir


def _run(argv: list[str], env: dict[str, str], bin_dir: Path) -> tuple[int, bool, list[str], str]:
    """(exit status, whether `hps` ran as the shell's own process, its arguments, stderr)."""
    p = subprocess.Popen(argv, env={**env, "PATH": f"{bin_dir}:/usr/bin:/bin"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=30)
    pid, *args = out.split() or ["0"]
    return p.returncode, int(pid) == p.pid, args, err


def _check_script(argv: list[str], env_for, n: int, bin_dir: Path) -> None:
    """Ordinal i starts `hps serve --shard i/n` (exec: hps is PID 1); ordinals n and above, a
    ROOT_SHARDS that is no number and a pod name without an ordinal are refused with exit 2."""
    assert argv[0] == "/bin/sh"
    for i in range(n):
        rc, same_process, args, err = _run(argv, env_for(f"hps-root-{i}"), bin_dir)
        assert rc == 0, err
        assert same_process, "hps must replace the shell (exec): PID 1 in the pod, so SIGTERM reaches it"
        assert args == ["serve", "--shard", f"{i}/{n}"], args
        from ps.core.config import ServerConfig  # a flag `hps serve` accepts
        ServerConfig(role="global", checkpoint_dir="/var/lib/hps", shard=args[2])
    for i in (n, n + 1, 10 * n):  # more replicas than ROOT_SHARDS: refused, loudly
        rc, _, args, err = _run(argv, env_for(f"hps-root-{i}"), bin_dir)
        assert rc == 2 and not args, (rc, args, err)
        assert f"shard {i} of {n}" in err and "replicas and ROOT_SHARDS must agree" in err, err
    for env in ({**env_for("hps-root-0"), "ROOT_SHARDS": ""}, {**env_for("hps-root-0"), "ROOT_SHARDS": "three"},
                env_for("hps-root")):
        rc, _, args, err = _run(argv, env, bin_dir)
        assert rc == 2 and not args and err.startswith("hps-root: "), (rc, args, err)
    rc, _, args, err = _run(argv, {**env_for("hps-root-0"), "ROOT_SHARDS": "0"}, bin_dir)
    assert rc == 2 and not args and "shard 0 of 0" in err, err


# -- the sources, as plain YAML (no kubectl) ---------------------------------------------------------
def test_the_overlay_patches_base_root_with_the_components_of_overlays_global():
    kust = _patch("kustomization.yaml")
    pair = yaml.safe_load((K8S / "overlays" / "global" / "kustomization.yaml").read_text())
    assert kust["namespace"] == pair["namespace"] == NAMESPACE
    assert "../../base/root" in kust["resources"] and kust["components"] == pair["components"]
    assert "images" not in kust  # the image from components/image only
    assert {p["path"] for p in kust["patches"]} == {"statefulset.yaml", "networkpolicy.yaml", "pdb.yaml"}
    (ns,) = [o for o in _load(OVERLAY / "namespace.yaml") if o["kind"] == "Namespace"]
    assert ns["metadata"]["name"] == NAMESPACE and ns["metadata"]["labels"]["app.kubernetes.io/part-of"] == "hps"
    # Patches, not a copy: base/root's StatefulSet is the one pod template.
    sts = _patch("statefulset.yaml")
    assert sts["kind"] == "StatefulSet" and sts["metadata"]["name"] == "hps-root"
    assert "volumeClaimTemplates" not in sts["spec"] and "selector" not in sts["spec"]


def test_the_sources_start_ordinal_i_as_shard_i_of_n_and_refuse_the_rest(tmp_path):
    """The patch's script with base/root's command, run by /bin/sh: no kubectl needed."""
    _sh_available()
    sts = _patch("statefulset.yaml")
    c = hps_container(sts)
    n = _shards_in_sources()
    assert sts["spec"]["replicas"] == n == 3  # replicas and the N of --shard agree
    (base,) = _load(K8S / "base" / "root" / "statefulset.yaml")
    argv = hps_container(base)["command"] + c["args"]
    _check_script(argv, lambda pod: {"POD_NAME": pod, "ROOT_SHARDS": str(n)}, n, _fake_hps(tmp_path))
    # No standby flags, and the pair's peer list and lease go.
    script = "\n".join(c["args"])
    assert "--standby" not in script and "ROOT_PAIR" not in script
    deleted = {e["name"] for e in c["env"] if e.get("$patch") == "delete"}
    assert deleted == {"ROOT_PAIR", "HPS_LEASE_S"}


def test_the_sources_admit_workers_and_allow_no_voluntary_disruption():
    pdb = _patch("pdb.yaml")
    assert pdb["kind"] == "PodDisruptionBudget" and pdb["spec"]["maxUnavailable"] == 0
    pol = _patch("networkpolicy.yaml")
    (rule,) = pol["spec"]["ingress"]
    (peer,) = rule["from"]
    assert peer["namespaceSelector"] == {} and _selects(peer["podSelector"], {"hps.io/worker": "true"})
    assert not _selects(peer["podSelector"], {"hps.io/tier": "regional"})
    assert rule["ports"] == [{"protocol": "TCP", "port": "grpc"}]
    (egress,) = _load(K8S / "components" / "hps-worker-root-shards" / "networkpolicy.yaml")
    (to,) = egress["spec"]["egress"]
    assert to["ports"] == [{"protocol": "TCP", "port": GRPC_PORT}]
    assert _selects(to["to"][0]["podSelector"], {"hps.io/tier": "global"})


def test_operating_says_how_to_run_and_reshard_a_sharded_root():
    text = (DEPLOY / "OPERATING.md").read_text()
    section = text.split("\n### A sharded root\n", 1)[1].split("\n### ", 1)[0]
    n = _shards_in_sources()
    for needed in ("kubectl apply -k deploy/k8s/overlays/global-sharded", "ROOT_SHARDS", "replicas",
                   "hps reshard --job", "--from", "--to", "--shard", "hps-worker-root-shards",
                   "HPS_ADDRESS", f'"{hps_address(n)}"', "maxUnavailable: 0", "standby", "relays",
                   "checkpoints-hps-root-"):
        assert needed in section, needed
    # The overlay's own comment gives the same address (quoted: ';' ends a shell command).
    assert f'HPS_ADDRESS="{hps_address(n)}"' in (OVERLAY / "kustomization.yaml").read_text()


# -- rendered (kubectl kustomize) ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def objs() -> list[dict]:
    return render("global-sharded")


def _root(objs: list[dict]) -> dict:
    return workloads(objs)["hps-root"]


def test_every_rendered_object_validates_against_the_kubernetes_schemas(objs):
    import kubernetes_validate as kv
    for o in objs:
        for version in K8S_VERSIONS:
            try:
                kv.validate(o, version, strict=True)
            except (kv.ValidationError, kv.SchemaNotFoundError) as e:
                pytest.fail(f"{o['kind']}/{o['metadata']['name']} against {version}: {e}")
    assert {o["kind"] for o in objs} == {"Namespace", "ConfigMap", "Service", "StatefulSet",
                                         "PodDisruptionBudget", "NetworkPolicy"}


def test_the_root_renders_as_n_shards_each_with_its_own_volume_and_stable_name(objs):
    check_no_plain_secrets(objs, "global-sharded")
    assert {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"} == {NAMESPACE}
    ws = workloads(objs)
    assert set(ws) == {"hps-root"}
    root = ws["hps-root"]
    spec, pod = root["spec"], root["spec"]["template"]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    c = hps_container(root)
    check_container(c, "global-sharded/hps-root")
    n = spec["replicas"]
    env = pod_env(objs, root, "hps-root-0")
    assert root["kind"] == "StatefulSet" and n == int(env["ROOT_SHARDS"]) == 3
    assert spec["podManagementPolicy"] == "Parallel"
    assert env["HPS_ROLE"] == "global" and "HPS_PARENT" not in env
    # No peer: no standby flags, no pair, no lease, no HPS_SHARD (one value for every pod).
    assert not any("--standby" in a for a in c["command"] + c["args"])
    assert not {"ROOT_PAIR", "HPS_LEASE_S", "HPS_STANDBY", "HPS_STANDBY_OF", "HPS_SHARD"} & set(env)
    # Each shard its own volume: a claim template mounted at the checkpoint directory.
    (claim,) = spec["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == env["HPS_CHECKPOINT_DIR"]
    assert claim["metadata"]["name"] not in {v["name"] for v in pod["volumes"]}
    assert pod["automountServiceAccountToken"] is False
    (image,) = yaml.safe_load((K8S / "components" / "image" / "kustomization.yaml").read_text())["images"]
    assert c["image"] == f"{image['newName']}@{image['digest']}"  # by digest, from components/image
    # Stable names from the headless Service, published ready or not: the workers' HPS_ADDRESS.
    (svc,) = [o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == spec["serviceName"]]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"].items() <= labels.items()
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
    names = [f"{root['metadata']['name']}-{i}.{svc['metadata']['name']}.{svc['metadata']['namespace']}"
             f".svc.cluster.local:{port}" for i in range(n)]
    assert ";".join(names) == hps_address(n)
    # One shard per node: a required anti-affinity on the hostname against the shards' own pods.
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname" and _selects(term["labelSelector"], labels)
    # No voluntary disruption: any shard down stops its jobs' training.
    (pdb,) = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 0 and "minAvailable" not in pdb["spec"]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_each_rendered_shard_pod_starts_with_its_ordinal_as_its_shard(objs, tmp_path):
    _sh_available()
    root = _root(objs)
    c = hps_container(root)
    _check_script(c["command"] + c["args"], lambda pod: pod_env(objs, root, pod), root["spec"]["replicas"],
                  _fake_hps(tmp_path))


def test_workers_reach_every_shard_directly_and_nothing_else_does(objs, tmp_path):
    """test_deploy.py's NetworkPolicy model over the sharded root, a regional overlay beside it,
    and a job's namespace with components/hps-worker and components/hps-worker-root-shards."""
    job, bare = tmp_path / "job", tmp_path / "bare"
    for d, comps in ((job, ["hps-worker", "hps-worker-root-shards"]), (bare, ["hps-worker"])):
        d.mkdir()
        (d / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "namespace": "train" if d == job else "bare",
            "components": [os.path.relpath(K8S / "components" / comp, d) for comp in comps]}))
    everything = [*objs, *render("eu"), *render_dir(job), *render_dir(bare)]
    policies = [o for o in everything if o["kind"] == "NetworkPolicy"]
    ns_labels = {o["metadata"]["name"]: dict(o["metadata"].get("labels", {}))
                 for o in everything if o["kind"] == "Namespace"}
    for ns in ("train", "bare", "monitoring", "kube-system", "other"):
        ns_labels.setdefault(ns, {})
    for name, labels in ns_labels.items():
        labels["kubernetes.io/metadata.name"] = name
    pods = {f"{o['metadata']['name']}.{o['metadata']['namespace']}": {
        "ns": o["metadata"]["namespace"], "labels": o["spec"]["template"]["metadata"]["labels"],
        "ports": {p["name"]: p["containerPort"] for p in hps_container(o)["ports"]}}
        for o in everything if o["kind"] in ("Deployment", "StatefulSet")}
    pods |= {
        "worker": {"ns": "train", "labels": {"hps.io/worker": "true"}, "ports": {}},
        "worker-without-the-component": {"ns": "bare", "labels": {"hps.io/worker": "true"}, "ports": {}},
        "other-in-train": {"ns": "train", "labels": {}, "ports": {}},
        "prometheus": {"ns": "monitoring", "labels": {"app.kubernetes.io/name": "prometheus"}, "ports": {}},
        "dns": {"ns": "kube-system", "labels": {"k8s-app": "kube-dns"}, "ports": {"dns": 53}},
    }

    def reach(src: str, dst: str, port: int = GRPC_PORT, proto: str = "TCP") -> bool:
        return allowed(policies, ns_labels, pods[src], pods[dst], port, proto)

    shard, master, zone = "hps-root.hps-global", "hps-regional.hps-eu", "hps-zone-eu-a.hps-eu"
    assert reach("worker", shard)  # every shard: one pod template, one policy
    assert not reach("worker", shard, HEALTH_PORT) and not reach("worker", shard, 9100)
    assert reach("worker", zone)  # the component beside hps-worker keeps the zones
    assert not reach("worker-without-the-component", shard)  # its egress policy holds it to the zones
    assert not reach("other-in-train", shard)
    assert not reach(master, shard) and not reach(zone, shard)  # relays refuse sharded jobs
    assert not reach(shard, shard)  # a shard has no peer (and no standby)
    assert not reach(shard, master) and not reach(shard, "worker")
    assert reach(shard, "dns", 53, "UDP")
    assert reach("prometheus", shard, 9100) and not reach("prometheus", shard, GRPC_PORT)


# -- the rendered shards, run --------------------------------------------------------------------------
def _wait(cond, what: str, procs: list[tuple[subprocess.Popen, Path]], timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        for p, log in procs:
            assert p.poll() is None, f"a shard exited {p.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_rendered_shards_train_and_the_runbooks_reshard_grows_them(objs, tmp_path, reap, monkeypatch):
    """The shard pods' command with the real `hps` on loopback, each with its pod's environment
    (mutual TLS, the admin token, its own volume): a worker whose HPS_ADDRESS lists the shards in
    shard order creates a sharded job and trains, each shard holding its own blocks. Then the
    runbook's "Changing N" on those volumes: SIGTERM (a final checkpoint each), `hps reshard` into
    next/, the old job directory moved to before/, the new one up; N+1 pods with ROOT_SHARDS
    raised serve the job at the version it stopped at, and it trains on."""
    if shutil.which("sh") is None or not (Path(sys.executable).parent / "hps").exists():
        pytest.skip("needs /bin/sh and the venv's hps")
    from ps.core.config import JobConfig, ShardingConfig
    from ps.core.view import KeySpec, Layout
    from ps.tools.certs import issue
    from ps.tools.status import fetch_status
    from worker.sharded import ShardedClient, connect

    root = _root(objs)
    c = hps_container(root)
    n = root["spec"]["replicas"]
    tier = issue(tmp_path / "certs", "global", "root")  # one Secret, every shard's pod mounts it
    worker = issue(tmp_path / "certs", "worker", "w0")
    (tmp_path / "admin").write_text(ADMIN + "\n")
    files = {"HPS_TLS_CERT": tier.cert, "HPS_TLS_KEY": tier.key, "HPS_TLS_CA": tier.ca,
             "HPS_ADMIN_TOKEN_FILE": str(tmp_path / "admin")}
    for k in ("CERT", "KEY", "CA"):  # this process's Status calls: mutual TLS, as a worker
        monkeypatch.setenv(f"HPS_TLS_{k}", getattr(worker, k.lower()))
    volume = [tmp_path / f"v{i}" for i in range(n + 1)]  # /v/I: claim checkpoints-hps-root-I

    def start(shards: int) -> tuple[list[str], list[tuple[subprocess.Popen, Path]]]:
        addresses = [f"127.0.0.1:{_free_port()}" for _ in range(shards)]
        procs = []
        for i in range(shards):
            env = {**pod_env(objs, root, f"hps-root-{i}"), **files, "ROOT_SHARDS": str(shards),
                   "HPS_LISTEN": addresses[i], "HPS_HEALTH_PORT": "0", "HPS_METRICS_PORT": "-1",
                   "OMP_NUM_THREADS": "1", "HPS_CHECKPOINT_DIR": str(volume[i]),
                   "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
            log = tmp_path / f"hps-root-{i}.{shards}.log"
            with open(log, "wb") as out:
                p = subprocess.Popen(c["command"] + c["args"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
            reap(p)
            procs.append((p, log))

        def up() -> bool:
            try:
                return all(fetch_status(a, timeout_s=2.0, token=ADMIN) is not None for a in addresses)
            except Exception:
                return False
        _wait(up, "every shard to answer", procs)
        return addresses, procs

    def stop(procs) -> None:
        for p, _ in procs:  # SIGTERM to the PID the kubelet would signal: a final checkpoint
            os.kill(p.pid, signal.SIGTERM)
        for p, log in procs:
            assert p.wait(30) == 0, log.read_text(errors="replace")[-3000:]

    def check_shards(addresses: list[str], version: int, view_checksum: int) -> None:
        checksum = 0
        for i, a in enumerate(addresses):
            (j,) = fetch_status(a, timeout_s=5.0, token=ADMIN).jobs
            assert j.version == version, (i, j.version)
            assert j.stats.shard == f"{i}/{len(addresses)}" and j.stats.shard_blocks > 0, (i, j.stats)
            checksum ^= j.checksum
        assert view_checksum == checksum  # the joined view is every shard's blocks

    addresses, procs = start(n)
    # HPS_ADDRESS as documented, the stable names replaced by these loopback addresses.
    local = hps_address(n)
    for i, a in enumerate(addresses):
        local = local.replace(shard_address(i), a)
    assert local == ";".join(addresses)
    layout = Layout([KeySpec("emb", (64, 8)), KeySpec("fc.weight", (8, 8)), KeySpec("fc.bias", (8,))])
    job = JobConfig(name="J", sharding=ShardingConfig(weights=(1.0,) * n, block_elems=64))
    client = connect(local, "J", "w0", timeout_s=10, retry_s=30, tls=worker, token=ADMIN)
    assert isinstance(client, ShardedClient)
    client.create_job(job, layout, np.zeros(layout.numel, np.float32))
    client.register()
    client.pull()
    for s in range(4):
        v, _ = client.push(np.full(layout.numel, 0.01 * (s + 1), np.float32), clock=s)
        client.pull(min_version=v)
    assert client.view.version == 4
    check_shards(addresses, 4, client.view.checksum)
    stopped_at = client.view.values.copy()
    client.close()
    stop(procs)

    # "Changing N", step 2, on the volumes: n -> n + 1.
    hps = str(Path(sys.executable).parent / "hps")
    r = subprocess.run([hps, "reshard", "--job", "J", "--from", *map(str, volume[:n]),
                        "--to", *(str(v / "next") for v in volume)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and f"{n} -> {n + 1} shards" in r.stdout, r.stdout + r.stderr
    for v in volume[:n]:
        (v / "before").mkdir()
        shutil.move(v / "J", v / "before" / "J")
    for v in volume:
        shutil.move(v / "next" / "J", v / "J")

    # Step 3: N + 1 pods, ROOT_SHARDS raised with them.
    addresses, procs = start(n + 1)
    client = connect(";".join(addresses), "J", "w0", timeout_s=10, retry_s=30, tls=worker, token=ADMIN)
    client.register()
    assert client.config.sharding.shards == n + 1
    client.pull(min_version=4)
    assert client.view.version == 4 and np.array_equal(client.view.values, stopped_at)
    check_shards(addresses, 4, client.view.checksum)  # before/ restored as no job: one job per shard
    v, _ = client.push(np.full(layout.numel, 0.05, np.float32), clock=4)
    client.pull(min_version=v)
    assert v == 5
    client.close()
    stop(procs)
