"""The layering of docs/architecture.md, enforced: import-linter's contracts (pyproject.toml,
[tool.importlinter]) and the Triton model shims' imports.

Layers, top to bottom: fleet | admin_ui; router_service | autoscale | build_engines; usage;
registry | python_backends; common. No package imports one above it, siblings in a layer do not import
each other, and no package has an import loop between its modules.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from common.settings import REPO_ROOT

# What the Triton python-backend shims may import from this repository: they run inside tritonserver's
# stub process on every replica, so they stay clear of the CLI, the router and the registry.
SHIM_ALLOWED = {"common", "python_backends"}
REPO_PACKAGES = {"common", "fleet", "admin_ui", "router_service", "autoscale", "build_engines", "usage",
                 "registry", "python_backends"}


def test_import_contracts_hold() -> None:
    # In a child process: import-linter reconfigures logging (dictConfig), which would silence the loggers
    # of every module this test session has already imported.
    run = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                          "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"an import contract is broken:\n{run.stdout}{run.stderr}"
    assert "0 broken" in run.stdout, run.stdout


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
