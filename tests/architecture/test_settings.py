"""One settings path: each service reads its environment once, into a typed pydantic-settings object,
under the variable names the platform has always used; nothing else in the code reads `os.environ`."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from common.settings import REPO_ROOT, Settings, load_from_env, load_settings
from python_backends.engine.config import engine_overrides
from python_backends.engine.state_report import identity_from_env
from router_service.settings import RouterSettings

CODE = ["common", "fleet", "admin_ui", "router_service", "autoscale", "build_engines", "usage", "registry",
        "python_backends", "model_repository"]


def _env_reads(path: Path) -> list[str]:
    """Lines that read the environment; copying it whole for a child process (`dict(os.environ)`) is fine."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        is_environ = isinstance(node, ast.Attribute) and node.attr == "environ" and \
            isinstance(node.value, ast.Name) and node.value.id == "os"
        is_getenv = isinstance(node, ast.Attribute) and node.attr == "getenv"
        if is_getenv:
            found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
        elif is_environ:
            parent = parents.get(node)
            copied = isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id == "dict"
            if not copied:
                found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
    return found


def test_no_module_reads_the_environment_outside_the_settings_objects() -> None:
    reads = [hit for pkg in CODE for path in sorted((REPO_ROOT / pkg).rglob("*.py")) for hit in _env_reads(path)]
    assert reads == [], "read these through a settings object (docs/architecture.md, Ports and settings)"


@pytest.mark.parametrize("var, value, read", [
    ("FLEET_ROUTER_HTTP_PORT", "18030", lambda: load_settings().router_http_port == 18030),
    ("KAFKA_BOOTSTRAP_SERVERS", "kafka:9", lambda: (lambda s: s.kafka_bootstrap == "kafka:9" and s.kafka_is_external)(
        load_settings())),
    ("FLEET_AUTOSCALER", "off", lambda: load_settings().autoscaler is False),
    ("FLEET_ADMIN_TOKEN", "t0k", lambda: load_settings().admin_tokens().get("t0k") == "operator"),
    ("TRTLLM_EXAMPLES_DIR", "/x/examples", lambda: load_settings().trtllm_examples_dir == "/x/examples"),
    ("FLEET_ROUTER_MAX_WAITING", "12", lambda: load_from_env(RouterSettings).max_waiting == 12),
    ("FLEET_ROUTER_POLICY", "least_loaded",
     lambda: load_from_env(RouterSettings).choice_params().policy == "least_loaded"),
    ("FLEET_ROUTER_BATCH_YIELD", "preempt", lambda: load_from_env(RouterSettings).batch_yielder().mode == "preempt"),
    ("FLEET_ENGINE_NUM_KV_BLOCKS", "512", lambda: engine_overrides().get("num_kv_blocks") == 512),
    ("FLEET_ROUTER_URLS", "http://r1/,http://r2", lambda: identity_from_env()["routers"] == ["http://r1", "http://r2"]),
])
def test_each_variable_keeps_its_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, var: str, value: str,
                                      read) -> None:
    monkeypatch.setenv("FLEET_DATA_DIR", str(tmp_path))
    monkeypatch.setenv(var, value)
    assert read()


@pytest.mark.parametrize("var, value, cls", [("FLEET_KAFKA_PORT", "ninety", Settings),
                                             ("FLEET_ROUTER_POLICY", "fastest", RouterSettings),
                                             ("FLEET_ROUTER_BATCH_SHARE", "1.5", RouterSettings)])
def test_a_bad_value_stops_the_service_naming_the_variable(monkeypatch: pytest.MonkeyPatch, var: str, value: str,
                                                          cls) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as info:
        load_from_env(cls)
    assert f"{var}:" in str(info.value) and repr(value) in str(info.value)


def test_derived_defaults_follow_the_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLEET_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("FLEET_DB_URL", raising=False)
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.setenv("FLEET_KAFKA_PORT", "19092")
    s = load_settings()
    assert s.db_url == f"sqlite:///{tmp_path / 'registry.sqlite'}" and s.kafka_bootstrap == "127.0.0.1:19092"
    assert not s.kafka_is_external and s.spool_dir == tmp_path / "spool"
