"""Render the Triton model repository of one model version from the templates in model_repository/.

Each template config.pbtxt may hold ${placeholders}; model.py shims are copied as they are.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from string import Template

from fleet.settings import REPO_ROOT

TEMPLATES = REPO_ROOT / "model_repository"
CPU_STEPS = ("llm", "preprocessing", "engine", "postprocessing")


def render_repository(out_dir: Path, values: dict[str, str], steps: tuple[str, ...] = CPU_STEPS,
                      templates: Path = TEMPLATES) -> Path:
    """Write `steps` from `templates` into out_dir with ${placeholders} filled; replaces out_dir whole."""
    tmp = out_dir.with_name(out_dir.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    for step in steps:
        src, dst = templates / step, tmp / step
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        config = dst / "config.pbtxt"
        config.write_text(Template(config.read_text()).substitute(values))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def cpu_values(weights_dir: Path, adapters_dir: Path, max_context: int, dtype: str = "bf16") -> dict[str, str]:
    return {"weights_dir": str(weights_dir), "adapters_dir": str(adapters_dir), "dtype": dtype,
            "max_context": str(max_context)}
