"""Where a build's artefacts live and what a build returns: shared by the cpu build (build.py) and the
TensorRT-LLM build (trtllm.py), so neither imports the other's internals.

    <engines_dir>/<model>/<version>/                 node-local copy a replica reads (`version_dir`)
    <weights store>/<model>/<version>                staged copy (`store_uri`), a path or fsspec URL
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.settings import Settings

from build_engines import stage
from build_engines.plan import BuildOptions


@dataclass
class BuildResult:
    """What happened: `noop`, `built` (staged), or `planned` (dry run)."""
    outcome: str
    model: str
    version: str
    row: dict[str, Any] | None = None
    message: str = ""
    plan_text: str = ""
    files: dict[str, str] = field(default_factory=dict)


def version_dir(settings: Settings, model: str, version: str) -> Path:
    return settings.engines_dir / model / version


def default_store(settings: Settings) -> str:
    return str(settings.data_dir / "weights-store")


def store_uri(settings: Settings, opts: BuildOptions) -> str:
    base = (opts.weights_store or default_store(settings)).rstrip("/")
    return f"{base}/{opts.model}/{opts.version}"


def clean_stale_partials(vdir: Path, uri: str) -> None:
    """Remove half-written folders that a killed build (SIGKILL, power loss) left next to the version's."""
    dirs = [vdir] + ([stage.local_path(uri)] if stage.is_local_uri(uri) else [])
    for d in dirs:
        for p in d.parent.glob(f".{d.name}.partial-*") if d.parent.exists() else []:
            shutil.rmtree(p, ignore_errors=True)


def artefacts_ok(settings: Settings, model: str, version: str, uri: str) -> bool:
    vdir = version_dir(settings, model, version)
    return (((vdir / "weights" / stage.MANIFEST).is_file() or (vdir / stage.MANIFEST).is_file())
            and (vdir / "model_repository" / "llm" / "config.pbtxt").is_file()
            and stage.read_manifest(uri) is not None)
