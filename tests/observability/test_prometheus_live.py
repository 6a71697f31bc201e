"""A real Prometheus (Debian's) scrapes the session platform's router, replicas and usage loader at 1 s while
requests run, evaluates the platform's recording rules, and every PromQL expression of the dashboards and
alert rules is checked against it: each metric name it uses is one the targets export (no typo), and each
dashboard query returns data unless all its metrics count events this short run does not cause (RARE)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from common.processes import free_port, stop_pid, wait_until
from common.settings import REPO_ROOT
from registry.db import session_scope
from registry.schema import Replica
from tests.integration.platform import stream_completion
from tests.observability.test_rules import rule_spec

pytestmark = pytest.mark.integration
DASHBOARDS = REPO_ROOT / "deploy" / "base" / "monitoring" / "dashboards"
# Counters of events a few seconds of healthy traffic does not cause: their families must exist (metadata),
# their series need not.
RARE = {"fleet_router_queue_depth",  # set once a request has waited in an admission queue
        "fleet_router_shed_total", "fleet_router_retries_total", "fleet_router_resumes_total",
        "fleet_usage_team_month_cost", "fleet_usage_team_month_budget"}
NAME = re.compile(r"\b(fleet_[a-z0-9_]+|[a-z_]+:[a-z0-9_:]+|up)\b")
SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def _names(expr: str) -> set[str]:
    """Metric and recorded-series names an expression reads (label matchers and groupings removed)."""
    bare = re.sub(r"\{[^}]*\}", "", expr)
    bare = re.sub(r"\b(by|on|without|ignoring)\s*\([^)]*\)", "", bare)
    return set(NAME.findall(bare))


def _dashboard_exprs() -> list[tuple[str, str]]:
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel["targets"]:
                out.append((f"{board['uid']}/{panel['title']}", target["expr"].replace("$model", ".*")))
    return out


@pytest.fixture(scope="module")
def prometheus(platform, tmp_path_factory):
    """Prometheus scraping the platform; yields its query URL."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed: `apt-get install prometheus` (scripts/install.sh does it)"
    work = tmp_path_factory.mktemp("prometheus")
    spec = rule_spec()
    for group in spec["groups"]:
        group["interval"] = "1s"
    (work / "rules.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    db_url = platform.env.get("FLEET_DB_URL") or f"sqlite:///{platform.data_dir / 'registry.sqlite'}"
    with session_scope(db_url) as s:
        replica_targets = [_metrics_target(r) for r in s.query(Replica).filter(Replica.state == "serving")]
    assert replica_targets, "the platform has no serving replica"
    http = int(platform.env["FLEET_ROUTER_HTTP_PORT"])
    jobs = {"llm-router": [f"127.0.0.1:{http}"], "llm-replica": replica_targets,
            "llm-usage-loader": [f"127.0.0.1:{platform.env['FLEET_USAGE_METRICS_PORT']}"]}
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": ["rules.yaml"],
              "scrape_configs": [{"job_name": j, "static_configs": [{"targets": t}]} for j, t in jobs.items()]}
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (work / "prometheus.log").open("w")
    proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{url}/-/ready", timeout=2).status_code == 200, 30, "prometheus ready", proc,
                   work / "prometheus.log")
        yield url
    finally:
        stop_pid(proc.pid)
        log.close()


def _metrics_target(r: Replica) -> str:
    """host:port of a replica's Triton metrics (its HTTP port + 2: common.services.replica_ports)."""
    if r.metrics_url:
        return urlsplit(r.metrics_url).netloc
    url = urlsplit(r.http_url)
    return f"{url.hostname}:{url.port + 2}"


def _query(url: str, expr: str) -> list:
    resp = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert resp["status"] == "success", f"{expr}: {resp}"
    return resp["data"]["result"]


def _traffic(platform) -> None:
    """A few seconds of interactive and standard streams, and one refused request."""
    headers = {"authorization": f"Bearer {platform.api_key}"}

    def one(i: int) -> None:
        stream_completion(platform.grpc_url, f"Count to {i}.", "smollm2-135m", 12, headers,
                          tier="interactive" if i % 2 else "standard")
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(8)))
    httpx.post(f"{platform.http_url}/v1/completions", headers=headers, timeout=30,
               json={"model": "no-such-model", "prompt": "x", "max_tokens": 2})


def test_every_dashboard_and_rule_expression_finds_its_metrics(platform, prometheus):
    _traffic(platform)
    recorded = {r["record"] for g in rule_spec()["groups"] for r in g["rules"] if "record" in r}
    # the targets up and every recording rule evaluated over the traffic (data, not just a rule that ran)
    wait_until(lambda: len(_query(prometheus, 'up == 1')) >= 3 and all(
        _query(prometheus, name) for name in recorded), 40, "scrapes and recording rules with data")
    exported = set()
    for name in httpx.get(f"{prometheus}/api/v1/metadata", timeout=10).json()["data"]:
        exported.add(name)
    exported |= set(httpx.get(f"{prometheus}/api/v1/label/__name__/values", timeout=10).json()["data"])

    def known(name: str) -> bool:
        return (name in exported or name in recorded or name == "up"
                or any(name.endswith(s) and name[: -len(s)] in exported for s in SUFFIXES))

    rules = [(r.get("alert") or r["record"], r["expr"]) for g in rule_spec()["groups"] for r in g["rules"]]
    problems = []
    for where, expr in [*rules, *_dashboard_exprs()]:
        unknown = sorted(n for n in _names(expr) if not known(n))
        if unknown:
            problems.append(f"{where}: unknown metric {unknown} in {expr}")
    assert not problems, "\n".join(problems)

    empty = []
    for where, expr in _dashboard_exprs():
        if not _query(prometheus, expr) and not _names(expr) <= RARE | {n + "_total" for n in RARE}:
            empty.append(f"{where}: {expr}")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
    # the SLO ratios cover the model the traffic used, for each SLO
    slos = {(r["metric"]["slo"], r["metric"]["model"]) for r in _query(prometheus, "model_slo:fleet_errors:ratio_rate5m")}
    assert {("ttft", "smollm2-135m"), ("stream_rate", "smollm2-135m"), ("availability", "smollm2-135m")} <= slos
