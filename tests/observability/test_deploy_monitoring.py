"""The rendered deploy/ overlays carry the monitoring: a PodMonitor and scrape annotations for every
component that serves metrics, NetworkPolicies that let the `monitoring` namespace reach exactly those
metrics ports (and no other port), the PrometheusRule, and the Grafana dashboards as sidecar ConfigMaps."""
from __future__ import annotations

import json

import pytest

from tests.deploy.test_manifests import OVERLAYS, render

MONITORING_NS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
# component (pod label app.kubernetes.io/name) -> its metrics port, as the code serves it
METRICS_PORTS = {"llm-router": 8030, "llm-replica": 8002, "llm-usage-loader": 9108}
DASHBOARDS = {"overview", "slo", "replicas", "router", "usage", "cost"}


@pytest.fixture(scope="module", params=OVERLAYS)
def objects(request) -> list[dict]:
    return render(request.param)


def _kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def _component_pods(objects: list[dict]) -> dict[str, list[dict]]:
    pods: dict[str, list[dict]] = {}
    for d in _kind(objects, "Deployment"):
        tpl = d["spec"]["template"]
        pods.setdefault(tpl["metadata"]["labels"]["app.kubernetes.io/name"], []).append(tpl)
    return pods


def _port_numbers(tpl: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in tpl["spec"]["containers"] for p in c.get("ports", [])
            if "name" in p}


def test_every_metrics_port_has_a_monitor_and_scrape_annotations(objects):
    pods = _component_pods(objects)
    monitors = {m["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]: m for m in _kind(objects, "PodMonitor")}
    assert set(monitors) == set(METRICS_PORTS), "one PodMonitor per component that serves metrics"
    for name, port in METRICS_PORTS.items():
        assert pods.get(name), f"no Deployment for {name}"
        endpoint = monitors[name]["spec"]["podMetricsEndpoints"]
        assert [e["path"] for e in endpoint] == ["/metrics"]
        assert monitors[name]["spec"]["jobLabel"] == "app.kubernetes.io/name"  # job="llm-..." in the alert rules
        for tpl in pods[name]:
            assert _port_numbers(tpl)[endpoint[0]["port"]] == port, f"{name}: the monitor's port is not {port}"
            ann = tpl["metadata"]["annotations"]
            assert (ann["prometheus.io/scrape"], ann["prometheus.io/port"], ann["prometheus.io/path"]) == (
                "true", str(port), "/metrics")
    loader = pods["llm-usage-loader"][0]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in loader["env"]}
    assert env["FLEET_USAGE_METRICS_PORT"] == "9108"


def test_monitoring_namespace_reaches_every_metrics_port_and_nothing_else(objects):
    reached: dict[str, set[int]] = {}
    for policy in _kind(objects, "NetworkPolicy"):
        spec = policy["spec"]
        for rule in spec.get("ingress", []):
            sources = rule.get("from", [])
            if MONITORING_NS not in sources:
                assert not any("namespaceSelector" in s for s in sources), f"{policy['metadata']['name']}: " \
                    "another namespace is admitted"
                continue
            assert sources == [MONITORING_NS], "a monitoring rule admits the monitoring namespace only"
            assert rule.get("ports"), f"{policy['metadata']['name']}: monitoring admitted to every port"
            target = spec["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
            reached.setdefault(target, set()).update(p["port"] for p in rule["ports"])
    assert reached == {name: {port} for name, port in METRICS_PORTS.items()}


def test_rules_and_dashboards_are_rendered(objects):
    rules = _kind(objects, "PrometheusRule")
    assert len(rules) == 1 and {g["name"] for g in rules[0]["spec"]["groups"]} == {
        "llm-fleet.slo.recording", "llm-fleet.recording", "llm-fleet.alerts"}
    boards = {}
    for cm in _kind(objects, "ConfigMap"):
        if cm["metadata"].get("labels", {}).get("grafana_dashboard") == "1":
            (data,) = cm["data"].values()
            boards[cm["metadata"]["name"].removeprefix("llm-fleet-dashboard-")] = json.loads(data)
    assert set(boards) == DASHBOARDS
    for name, board in boards.items():
        assert board["uid"] == f"llm-fleet-{name}" and board["panels"], name
        assert all(t["expr"] for p in board["panels"] for t in p["targets"])
