"""Every `fleet_*` metric the code exports is documented in docs/observability.md (name, type, labels, meaning)
with the type it really has; the replica's latency metrics are histograms.

The replica's and loader's metric names are read from their source: importing `usage` from a test resolves
to tests/usage (pytest puts tests/ on sys.path), and the engine's metrics exist only inside Triton. The live
Prometheus test (test_prometheus_live.py) sees them all exported."""
from __future__ import annotations

import re

from prometheus_client import REGISTRY

import router_service.metrics  # noqa: F401  (defines the router's metrics in the default registry)
from common.settings import REPO_ROOT

DOC = (REPO_ROOT / "docs" / "observability.md").read_text()
KIND = r"(gauge|counter|histogram)"


def _documented_type(name: str) -> str:
    row = (re.search(rf"^\| `{re.escape(name)}`(?: / `[a-z_]+`)? \| {KIND} \|", DOC, re.M)
           or re.search(rf"^\| `[a-z_]+` / `{re.escape(name)}` \| {KIND} \|", DOC, re.M))
    assert row, f"{name} is not documented in docs/observability.md"
    return row.group(1)


def test_router_metrics_are_documented_with_their_type():
    router = {f.name + ("_total" if f.type == "counter" else ""): f.type for f in REGISTRY.collect()
              if f.name.startswith("fleet_router_")}
    assert len(router) > 25
    for name, kind in router.items():
        assert _documented_type(name) == kind, name


def test_usage_loader_metrics_are_documented_with_their_type():
    source = (REPO_ROOT / "usage" / "loader_metrics.py").read_text()
    counters = re.findall(r'": \("(fleet_usage_loader_[a-z_]+)"', source)
    gauges = re.findall(r'GaugeMetricFamily\("(fleet_usage_[a-z_]+)"', source)
    assert len(counters) == 5 and len(gauges) == 4
    for name in counters:
        assert _documented_type(name + "_total") == "counter", name
    for name in gauges:
        assert _documented_type(name) == "gauge", name


def test_engine_metrics_are_documented_and_latencies_are_histograms():
    source = (REPO_ROOT / "python_backends" / "engine" / "metrics.py").read_text()
    kinds = {n: k for k, n in re.findall(rf'{KIND}\(\s*"(fleet_engine_[a-z_]+)"', source)}
    kinds.update({n: "counter" for n in re.findall(r'BatchedCounter\(counter\("(fleet_engine_[a-z_]+)"', source)})
    assert len(kinds) >= 15, kinds
    for name, kind in kinds.items():
        assert _documented_type(name) == kind, name
    assert {n for n, k in kinds.items() if k == "histogram"} == {
        "fleet_engine_ttft_seconds", "fleet_engine_inter_token_latency_seconds", "fleet_engine_queue_wait_seconds"}
