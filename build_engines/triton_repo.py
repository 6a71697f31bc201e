"""Render the Triton model repository of one model version from the templates in model_repository/.

Each template config.pbtxt may hold ${placeholders}; model.py shims are copied as they are.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from string import Template

from common.settings import REPO_ROOT

TEMPLATES = REPO_ROOT / "model_repository"
CPU_STEPS = ("llm", "preprocessing", "engine", "postprocessing")


def render_repository(out_dir: Path, values: dict[str, str], steps: tuple[str, ...] = CPU_STEPS,
                      templates: Path = TEMPLATES) -> Path:
    """Write `steps` from `templates` into out_dir with ${placeholders} filled; replaces out_dir whole."""
    return render_steps(out_dir, values, {step: templates / step for step in steps})


def render_steps(out_dir: Path, values: dict[str, str], sources: dict[str, Path]) -> Path:
    """Write each model folder `sources[name]` into out_dir/name with ${placeholders} filled.

    Every model gets a version folder `1/` (git does not keep empty ones); out_dir is replaced whole.
    """
    tmp = out_dir.with_name(out_dir.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    for step, src in sources.items():
        dst = tmp / step
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".gitkeep"))
        (dst / "1").mkdir(exist_ok=True)
        config = dst / "config.pbtxt"
        config.write_text(Template(config.read_text()).substitute(values))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def cpu_values(weights_dir: Path, adapters_dir: Path, max_context: int, dtype: str = "bf16",
               device: str = "cpu") -> dict[str, str]:
    """${placeholders} of the engine templates (engine, preprocessing, postprocessing); device cpu or cuda[:N]
    (on CUDA the engine's Triton instance is KIND_GPU and its KV pool is sized from free device memory)."""
    gpu = device.startswith("cuda")
    return {"weights_dir": str(weights_dir), "adapters_dir": str(adapters_dir), "dtype": dtype,
            "max_context": str(max_context), "device": device, "instance_kind": "KIND_GPU" if gpu else "KIND_CPU",
            "num_kv_blocks": "0" if gpu else "4096"}
