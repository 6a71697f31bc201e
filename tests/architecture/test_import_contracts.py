"""The layering of docs/architecture.md, enforced: import-linter's contracts (pyproject.toml,
[tool.importlinter]) and the Triton model shims' imports.

Layers, top to bottom: fleet | admin_ui; router_service | autoscale | build_engines; usage;
registry | python_backends; common. No package imports one above it, siblings in a layer do not import
each other, and no package has an import loop between its modules.
"""
from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
from importlinter.cli import lint_imports

from common.settings import REPO_ROOT

# What the Triton python-backend shims may import from this repository: they run inside tritonserver's
# stub process on every replica, so they stay clear of the CLI, the router and the registry.
SHIM_ALLOWED = {"common", "python_backends"}
REPO_PACKAGES = {"common", "fleet", "admin_ui", "router_service", "autoscale", "build_engines", "usage",
                 "registry", "python_backends"}


def test_import_contracts_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO_ROOT)
    exit_code = lint_imports(config_filename=str(REPO_ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    assert exit_code == 0, "an import contract is broken: see the report above"


def _repo_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        found |= {n.split(".")[0] for n in names} & REPO_PACKAGES
    return found


def test_triton_shims_import_only_the_engine_and_common() -> None:
    shims = sorted((REPO_ROOT / "model_repository").rglob("model.py"))
    assert len(shims) >= 4, shims  # preprocessing, engine, postprocessing (+ GPU variants)
    wrong = {os.path.relpath(p, REPO_ROOT): sorted(_repo_imports(p) - SHIM_ALLOWED) for p in shims}
    assert not {k: v for k, v in wrong.items() if v}, wrong
