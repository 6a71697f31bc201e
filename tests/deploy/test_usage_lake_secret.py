"""The Secret `llm-usage-lake` in the rendered overlays: every container that reads usage, prices or GPU-hours
(the lake: usage/lake.py, usage/price_tables.py) gets it whole, nothing else does (replicas hold no lake
credentials), the dev overlay's Secret carries only keys the lake's settings read, and production commits none."""
from __future__ import annotations

import pytest

from tests.deploy.test_manifests import OVERLAYS, render
from usage.lake import LakeSettings

SECRET = "llm-usage-lake"
# containers that read the lake: the loader writes it; the admin UI and the autoscaler's forecaster read usage,
# prices and GPU-hours; routers read prices for budgets in money (router_service/budgets.py)
READS_LAKE = {"loader", "admin-ui", "autoscaler", "router"}


def _lake_env_names() -> set[str]:
    """The environment variables LakeSettings reads (FLEET_ prefix, or its AWS_* aliases)."""
    names = set()
    for name, field in LakeSettings.model_fields.items():
        alias = field.validation_alias
        names |= set(alias.choices) if alias is not None else {f"FLEET_{name.upper()}"}
    return names


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(request.param)


def test_every_lake_reader_gets_the_secret_and_nothing_else_does(rendered):
    overlay, objects = rendered
    seen = set()
    for dep in (o for o in objects if o["kind"] == "Deployment"):
        pod = dep["spec"]["template"]["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            refs = [r["secretRef"] for r in c.get("envFrom", []) if "secretRef" in r]
            gets = any(r["name"] == SECRET and not r.get("optional") for r in refs)
            where = f"{overlay} {dep['metadata']['name']}/{c['name']}"
            assert gets == (c["name"] in READS_LAKE), f"{where}: {'lacks' if not gets else 'must not get'} {SECRET}"
            seen.add(c["name"]) if gets else None
    assert seen == READS_LAKE, f"{overlay}: no Deployment runs {sorted(READS_LAKE - seen)}"


def test_dev_secret_has_the_lake_uri_and_only_keys_the_lake_reads():
    secrets = [o for o in render("cpu-dev") if o["kind"] == "Secret" and o["metadata"]["name"] == SECRET]
    assert len(secrets) == 1
    keys = set(secrets[0]["data"])
    assert {"FLEET_USAGE_LAKE_URI", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= keys
    assert keys <= _lake_env_names(), f"keys nothing reads: {sorted(keys - _lake_env_names())}"


def test_production_commits_no_lake_secret():
    assert not [o for o in render("gpu-prod") if o["kind"] == "Secret"]
