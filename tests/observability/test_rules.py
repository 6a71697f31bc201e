"""The platform's Prometheus rules (deploy/base/monitoring/prometheus-rules.yaml) pass `promtool check rules`,
and promtool's unit tests (rules_test.yaml) fire each SLO alert on synthetic series and keep it quiet on healthy
ones. Every alert has its runbook section in docs/runbooks.md. promtool is Debian's (scripts/install.sh)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

from common.settings import REPO_ROOT

RULES = REPO_ROOT / "deploy" / "base" / "monitoring" / "prometheus-rules.yaml"
UNIT_TESTS = Path(__file__).with_name("rules_test.yaml")
LABEL_REF = re.compile(r"\{\{ \$labels\.(\w+) \}\}")


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is not installed: `apt-get install prometheus` (scripts/install.sh does it)"
    return path


def rule_spec() -> dict:
    doc = yaml.safe_load(RULES.read_text())
    assert doc["kind"] == "PrometheusRule"
    return doc["spec"]


def alerts() -> dict[str, dict]:
    return {r["alert"]: r for g in rule_spec()["groups"] for r in g["rules"] if "alert" in r}


def _with_annotations(tests: dict) -> dict:
    """promtool compares annotations exactly: expected alerts that give none get the rule's own, rendered
    for their labels (only `{{ $labels.x }}` templates; ones using $value are spelt out in the file)."""
    rules = alerts()
    for case in tests["tests"]:
        for check in case.get("alert_rule_test", []):
            for exp in check.get("exp_alerts") or []:
                if "exp_annotations" not in exp:
                    exp["exp_annotations"] = {k: LABEL_REF.sub(lambda m: str(exp["exp_labels"][m.group(1)]), v)
                                              for k, v in rules[check["alertname"]]["annotations"].items()}
    return tests


def test_rules_pass_promtool_check_and_unit_tests(tmp_path):
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule_spec(), sort_keys=False))
    check = subprocess.run([promtool(), "check", "rules", str(tmp_path / "rules.yaml")], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    tests = _with_annotations(yaml.safe_load(UNIT_TESTS.read_text()))
    (tmp_path / "rules_test.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    run = subprocess.run([promtool(), "test", "rules", "rules_test.yaml"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


def test_every_slo_alert_is_unit_tested_firing_and_quiet():
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    fired, quiet = set(), set()
    for case in tests:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else quiet).add(check["alertname"])
    slo = {name for name, r in alerts().items() if "slo" in r["labels"]}
    assert len(slo) == 6 and slo <= fired, f"SLO alerts never fired in a unit test: {slo - fired}"
    assert {n.replace("Slow", "Fast") for n in slo} & quiet, "no SLO alert is shown quiet on healthy series"
    assert {"FleetKVCachePressure", "FleetQueueWaitHigh", "FleetReplicaDown", "FleetUsagePipelineLag",
            "FleetUsageDeadLetters", "FleetTeamOverBudget"} <= fired


def test_every_alert_has_a_runbook_section():
    runbooks = (REPO_ROOT / "docs" / "runbooks.md").read_text()
    headings = {re.sub(r"[^a-z0-9]", "", h.lower()) for h in re.findall(r"^## (.+)$", runbooks, re.M)}
    for name, rule in alerts().items():
        assert name.lower() in headings, f"docs/runbooks.md has no section '## {name}'"
        assert rule["annotations"]["runbook_url"] == f"docs/runbooks.md#{name.lower()}"
        assert rule["labels"]["severity"] in ("page", "ticket", "warning")
