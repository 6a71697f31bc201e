"""checkov on both rendered overlays: every finding is in deploy/checkov-allowlist.yaml (with its reason), and
every allow-list entry still fires. checkov is not a project dependency (its pins downgrade boto3, packaging,
networkx): scripts/install.sh puts it in its own virtualenv, .fleet/vendor/checkov (a checkov on PATH is used
otherwise); the test is skipped only where neither exists."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml

from common.settings import REPO_ROOT
from tests.deploy.test_manifests import OVERLAYS, render

VENDORED = REPO_ROOT / ".fleet" / "vendor" / "checkov" / "bin" / "checkov"
CHECKOV = str(VENDORED) if VENDORED.exists() else shutil.which("checkov")


@pytest.mark.skipif(CHECKOV is None, reason="checkov is not installed (see this module's docstring)")
def test_checkov_findings_are_all_allow_listed(tmp_path) -> None:
    for overlay in OVERLAYS:
        (tmp_path / f"{overlay}.yaml").write_text(yaml.safe_dump_all(render(overlay)))
    out = subprocess.run([CHECKOV, "-d", str(tmp_path), "--framework", "kubernetes", "--quiet", "--compact",
                          "-o", "json"], capture_output=True, text=True, timeout=300)
    report = json.loads(out.stdout)
    failed = {(f["check_id"], f["resource"].rsplit(".", 1)[-1])
              for r in (report if isinstance(report, list) else [report]) for f in r["results"]["failed_checks"]}
    allowed = {(entry["check"], resource)
               for entry in yaml.safe_load((REPO_ROOT / "deploy" / "checkov-allowlist.yaml").read_text())
               for resource in entry["resources"]}
    assert failed - allowed == set(), "new checkov findings: fix them or allow-list them with a reason"
    assert allowed - failed == set(), "allow-list entries that no longer fire: remove them"
