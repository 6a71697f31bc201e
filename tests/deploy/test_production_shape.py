"""The production shape as a whole: both overlays rendered, and the wiring between components checked across
objects (what object-by-object checks miss): the labels the registrar/actuator select are the labels the pools
carry, Service and NetworkPolicy ports are container ports, probes point at container ports, every secret key a
container names is one the Secret has, the writable paths of read-only-root containers are declared volumes,
GPU pods hold no operator token or fleet DB credentials, Pod Security levels per pod template, and the
lifecycle numbers agree (drain < grace, progress deadline > staging + load). The autoscaler container itself
runs in tests/deploy/test_autoscaler_container.py."""
from __future__ import annotations

import re
from urllib.parse import urlsplit

import pytest

from autoscale.actuators import PoolSpec
from autoscale.actuators.k8s_names import deployment_name, pool_label
from autoscale.actuators.kubernetes import POOL_LABEL, deployment_manifest
from router_service.__main__ import STOP_BOUND_S
from router_service.settings import RouterSettings
from tests.deploy.pod_security import violations
from tests.deploy.test_manifests import OVERLAYS, render

# what each long-running container reads from its environment to start and to act (settings fields it needs)
NEEDS = {"router": {"FLEET_DB_URL", "FLEET_ADMIN_TOKEN", "FLEET_REPORT_SECRET", "FLEET_DATA_DIR"},
         "autoscaler": {"FLEET_DB_URL", "FLEET_ADMIN_TOKEN", "FLEET_DATA_DIR"},
         "loader": {"FLEET_DB_URL", "KAFKA_BOOTSTRAP_SERVERS", "FLEET_DATA_DIR"},
         "admin-ui": {"FLEET_DB_URL", "FLEET_DATA_DIR"},
         "stage-weights": {"FLEET_DB_URL", "FLEET_MODEL", "FLEET_VERSION", "FLEET_DATA_DIR"},
         "triton": {"FLEET_MODEL", "FLEET_VERSION", "FLEET_TENSOR_PARALLEL", "FLEET_REPLICA_ID", "FLEET_ROUTER_URLS"},
         "state": {"FLEET_REPLICA_ID", "FLEET_ROUTER_URLS", "FLEET_REPORT_TOKEN_FILE"}}
WRITES_DATA_DIR = {"router", "autoscaler", "loader", "stage-weights"}
EXTERNAL_ENV_SECRETS = {"llm-usage-lake"}  # whole-Secret envFrom: the usage lake's URI and object-store credentials
SECRET_KEYS = {"db-url", "replica-db-url", "admin-token", "viewer-token", "report-secret"}  # base kustomization
GPU_POD_FORBIDDEN_KEYS = {"admin-token", "viewer-token", "db-url", "report-secret"}


@pytest.fixture(scope="module", params=OVERLAYS)
def shape(request) -> tuple[str, list[dict]]:
    return request.param, render(request.param)


def _kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def _selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        if expr["operator"] == "In" and labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def _templates(objects: list[dict]) -> list[tuple[dict, dict]]:
    return [(d, d["spec"]["template"]) for d in _kind(objects, "Deployment")]


def _containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def _env(objects: list[dict], container: dict) -> dict[str, str]:
    """Name -> value (or `secret:<key>` / `field:<path>`), config maps included."""
    out: dict[str, str] = {}
    maps = {m["metadata"]["name"]: m.get("data", {}) for m in _kind(objects, "ConfigMap")}
    for ref in container.get("envFrom", []):
        if "secretRef" in ref:  # created by the operator (base/kustomization.yaml names it), keys not known here
            assert ref["secretRef"]["name"] in EXTERNAL_ENV_SECRETS, f"{container['name']}: envFrom {ref}"
            continue
        name = ref["configMapRef"]["name"]
        assert name in maps, f"{container['name']}: ConfigMap {name} does not exist"
        out.update(maps[name])
    for e in container.get("env", []):
        src = e.get("valueFrom", {})
        out[e["name"]] = e.get("value") if "value" in e else \
            f"secret:{src['secretKeyRef']['key']}" if "secretKeyRef" in src else f"field:{src['fieldRef']['fieldPath']}"
    return out


def test_pool_pods_carry_the_labels_the_registrar_selects_and_the_actuator_reuses_their_deployment(shape) -> None:
    _, objects = shape
    pools = [d for d in _kind(objects, "Deployment") if d["spec"]["template"]["metadata"]["labels"].get(
        "app.kubernetes.io/name") == "llm-replica"]
    assert pools
    for dep in pools:
        notes = dep["spec"]["template"]["metadata"]["annotations"]
        model, version = notes["fleet.ai/model"], notes["fleet.ai/version"]
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert labels[POOL_LABEL] == pool_label(model, version), dep["metadata"]["name"]
        assert dep["metadata"]["name"] == deployment_name(model, version)  # the name the actuator scales
        triton = next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "triton")
        env = _env(objects, triton)
        assert (env["FLEET_MODEL"], env["FLEET_VERSION"]) == (model, version)
        spec = PoolSpec(model, version, "region-a", int(env["FLEET_TENSOR_PARALLEL"]))
        # what the actuator would apply for this pool, from the overlay's own Deployment: same object, same
        # (immutable) selector, and the registrar's selector picks the overlay's pods
        mine = deployment_manifest(spec, "llm", template=dep)
        assert mine["metadata"]["name"] == dep["metadata"]["name"]
        assert mine["spec"]["selector"] == dep["spec"]["selector"]
        assert _selects(mine["spec"]["selector"], labels)
        assert mine["spec"]["template"]["spec"]["containers"][0]["image"] == triton["image"]  # the overlay's image
        pdbs = [p for p in _kind(objects, "PodDisruptionBudget") if _selects(p["spec"]["selector"], labels)]
        assert len(pdbs) == 1 and pdbs[0]["spec"].get("maxUnavailable", 0) >= 1, dep["metadata"]["name"]


def test_services_network_policies_and_probes_point_at_container_ports(shape) -> None:
    _, objects = shape
    templates = _templates(objects)
    for svc in _kind(objects, "Service"):
        backends = [t for _, t in templates if _selects({"matchLabels": svc["spec"]["selector"]}, t["metadata"]["labels"])]
        assert backends, f"Service {svc['metadata']['name']} selects no pod"
        for port in svc["spec"]["ports"]:
            for t in backends:
                names = {p.get("name") for c in t["spec"]["containers"] for p in c.get("ports", [])}
                assert port["targetPort"] in names, (svc["metadata"]["name"], port)
    for pol in _kind(objects, "NetworkPolicy"):
        targets = [t for _, t in templates if _selects(pol["spec"]["podSelector"], t["metadata"]["labels"])]
        assert targets, f"NetworkPolicy {pol['metadata']['name']} selects no pod"
        numbers = {p["containerPort"] for t in targets for c in t["spec"]["containers"] for p in c.get("ports", [])}
        for rule in pol["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                assert port["port"] in numbers, (pol["metadata"]["name"], port)
            for peer in rule.get("from", []):
                if peer.get("podSelector") and "namespaceSelector" not in peer:  # pods of this namespace
                    assert any(_selects(peer["podSelector"], t["metadata"]["labels"]) for _, t in templates), \
                        (pol["metadata"]["name"], peer)
    for _, t in templates:
        for c in t["spec"]["containers"]:
            ports = {p.get("name") for p in c.get("ports", [])} | {p["containerPort"] for p in c.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in c and "httpGet" in c[probe]:
                    assert c[probe]["httpGet"]["port"] in ports, (c["name"], probe)


def test_state_reports_reach_every_router_through_a_headless_service_the_replicas_may_call(shape) -> None:
    _, objects = shape
    config = _kind(objects, "ConfigMap")[0]["data"]
    for url in config["FLEET_ROUTER_URLS"].split(","):
        parts = urlsplit(url)
        svc = next(s for s in _kind(objects, "Service") if s["metadata"]["name"] == parts.hostname)
        assert svc["spec"].get("clusterIP") == "None", "a ClusterIP hands each report to one router only"
        assert any(p["port"] == parts.port for p in svc["spec"]["ports"])
        assert svc["spec"]["selector"] == {"app.kubernetes.io/name": "llm-router"}
    # the autoscaler reads every router too (autoscale/signals.py merges their /admin/fleet): a headless name
    autoscaler = next(d for d in _kind(objects, "Deployment") if d["metadata"]["name"] == "llm-autoscaler")
    command = autoscaler["spec"]["template"]["spec"]["containers"][0]["command"]
    signals_url = urlsplit(command[command.index("--router-url") + 1])
    svc = next(s for s in _kind(objects, "Service") if s["metadata"]["name"] == signals_url.hostname)
    assert svc["spec"].get("clusterIP") == "None", "a ClusterIP gives the autoscaler one router's view"
    assert any(p["port"] == signals_url.port for p in svc["spec"]["ports"])
    router_policy = next(p for p in _kind(objects, "NetworkPolicy") if p["metadata"]["name"] == "llm-router-ingress")
    replica_labels = {"app.kubernetes.io/name": "llm-replica"}
    assert any(any(_selects(peer.get("podSelector", {}), replica_labels) for peer in rule.get("from", []))
               and {"protocol": "TCP", "port": 8032} in rule["ports"] for rule in router_policy["spec"]["ingress"])


def test_env_secrets_and_writable_paths_are_declared_and_gpu_pods_hold_no_fleet_credentials(shape) -> None:
    overlay, objects = shape
    secrets = {s["metadata"]["name"]: set(s.get("data", {})) for s in _kind(objects, "Secret")}
    for dep, t in _templates(objects):
        replica = t["metadata"]["labels"].get("app.kubernetes.io/name") == "llm-replica"
        pod_volumes = {v["name"] for v in t["spec"].get("volumes", [])}
        for c in _containers(t["spec"]):
            env = _env(objects, c)
            where = f"{overlay} {dep['metadata']['name']}/{c['name']}"
            assert NEEDS[c["name"]] <= set(env), f"{where}: unset {sorted(NEEDS[c['name']] - set(env))}"
            keys = {v.split(":", 1)[1] for v in env.values() if v.startswith("secret:")}
            for ref in (e["valueFrom"]["secretKeyRef"] for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})):
                assert ref["name"] == "llm-fleet-secrets", where
                if overlay == "cpu-dev":  # committed dev Secret: the key must be in it
                    assert ref["key"] in secrets["llm-fleet-secrets"], where
                assert ref["key"] in SECRET_KEYS, where
            if replica:
                assert not keys & GPU_POD_FORBIDDEN_KEYS, f"{where}: holds {sorted(keys & GPU_POD_FORBIDDEN_KEYS)}"
            for ref in re.findall(r"\$\((\w+)\)", " ".join(c.get("command", []) + c.get("args", []))):
                assert ref in env, f"{where}: command uses $({ref}) that is not set"
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
            assert {m["name"] for m in mounts.values()} <= pod_volumes, where
            if c.get("securityContext", {}).get("readOnlyRootFilesystem"):
                assert "/tmp" in mounts, f"{where}: read-only root without a /tmp volume"
                if c["name"] in WRITES_DATA_DIR:
                    data = mounts.get(env["FLEET_DATA_DIR"])
                    assert data is not None and not data.get("readOnly"), f"{where}: FLEET_DATA_DIR not writable"


def test_every_pod_template_passes_pod_security_restricted(shape) -> None:
    overlay, objects = shape
    for dep, t in _templates(objects):
        assert violations(t["spec"], "restricted") == [], f"{overlay} {dep['metadata']['name']}"
    pool = next(d for d, _ in _templates(objects) if "llm-pool" in d["metadata"]["name"])
    # the checker itself refuses what it must: the old hostPath node cache
    bad = dict(pool["spec"]["template"]["spec"], volumes=[{"name": "node-cache", "hostPath": {"path": "/mnt/x"}}])
    assert violations(bad, "baseline") == ["hostPath volume node-cache"]


def test_lifecycle_numbers_agree(shape) -> None:
    overlay, objects = shape
    deps = {d["metadata"]["name"]: d for d in _kind(objects, "Deployment")}
    router = deps["llm-router"]["spec"]["template"]["spec"]
    spread = router["topologySpreadConstraints"][0]
    assert (spread["topologyKey"], spread["whenUnsatisfiable"]) == ("kubernetes.io/hostname", "DoNotSchedule")
    pre_stop_s = router["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop_s > 0
    # the router's stop grace is its longest total stream deadline, read as the router reads its settings
    router_env = {k: v for k, v in _env(objects, router["containers"][0]).items() if not v.startswith("secret:")}
    stop_grace_s = RouterSettings(**{k.removeprefix("FLEET_ROUTER_").lower(): v for k, v in router_env.items()
                                     if k.startswith("FLEET_ROUTER_") and k.removeprefix("FLEET_ROUTER_").lower()
                                     in RouterSettings.model_fields}).stream_timeouts().stop_grace_s()
    # the router exits by grace + STOP_BOUND_S whatever runs (its watchdog): the pod must not SIGKILL it sooner
    assert router["terminationGracePeriodSeconds"] >= pre_stop_s + stop_grace_s + STOP_BOUND_S, "streams cut by SIGKILL"
    router_pdb = next(p for p in _kind(objects, "PodDisruptionBudget") if p["metadata"]["name"] == "llm-router")
    assert router_pdb["spec"].get("maxUnavailable", 0) >= 1  # minAvailable 1 of 1 router would block drains
    for name, dep in deps.items():
        if "llm-pool" not in name:
            continue
        pod = dep["spec"]["template"]["spec"]
        for c in pod["containers"]:
            cmd = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
            if "--timeout" in cmd:
                drain_s = float(cmd[cmd.index("--timeout") + 1])
                assert drain_s >= stop_grace_s, f"{name}: the drain ends before the longest stream may"
                assert pod["terminationGracePeriodSeconds"] >= drain_s + 20, name
                assert router["terminationGracePeriodSeconds"] >= drain_s, "routers stop before their streams end"
        triton = next(c for c in pod["containers"] if c["name"] == "triton")
        load_s = triton["startupProbe"]["periodSeconds"] * triton["startupProbe"]["failureThreshold"]
        assert dep["spec"]["progressDeadlineSeconds"] >= load_s + 600, name  # + staging and scheduling
        if overlay == "gpu-prod":
            assert pod["runtimeClassName"] == "nvidia"
            assert pod["nodeSelector"]["nvidia.com/gpu.product"], name
            assert any(r["topologyKey"] == "kubernetes.io/hostname" and "fleet.ai/pool" in r.get("matchLabelKeys", [])
                       for r in pod["topologySpreadConstraints"]), name
