"""One build, start to finish: validate, decide (new / no-op / refused), convert or plan the engine, write
the Triton model repository, run the quality gate (build_engines.quality_gate), stage the artefacts, and move
the registry row building -> built -> staged. A failed gate leaves the row `failed` with the report, never
`staged`; `--skip-gate REASON` records the reason instead of a report.

Layout of a finished version (the node-local cache a replica reads at disk speed):
    <engines_dir>/<model>/<version>/weights/            converted weights + MANIFEST.json (sha256 per file)
    <engines_dir>/<model>/<version>/model_repository/   llm, preprocessing, engine|tensorrt_llm, postprocessing
The weights store copy lives at `weights_uri` (`--weights-store`/<model>/<version>, a path or fsspec URL).
The version folder appears by one rename at the end, so an interrupted build leaves nothing routable.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common.settings import Settings

from build_engines import cpu, gate_engine, stage, triton_repo, trtllm
from build_engines.layout import BuildResult, artefacts_ok, clean_stale_partials, store_uri, version_dir
from build_engines.plan import (SMOLLM2_ALIAS, BuildError, BuildOptions, BuildPlan, check_options,
                                inputs_fingerprint, inspect_checkpoint, precheck_checkpoint, resolve)
from build_engines.quality_gate import GateOptions, skipped_report, summary
from build_engines.register import Registration, check_existing, read_row

TOOL_VERSION = "build-engines 0.2"


def conversion_cache_dir(settings: Settings, alias: str | None, sha: str, dtype: str) -> Path:
    """The shared cache of one conversion; SmolLM2 bf16 keeps the name the test fixtures use."""
    if alias == SMOLLM2_ALIAS and dtype == "bf16":
        named = settings.cache_dir / cpu.SMOLLM2_BF16_DIR
        source = _read_json(named.with_name(named.name + ".source.json"))
        if source is None or source.get("checkpoint_sha256") == sha:
            return named
    return settings.cache_dir / f"convert-{sha[:16]}-{dtype}"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def convert_cached(settings: Settings, plan: BuildPlan, sha: str) -> tuple[Path, bool, float]:
    """The converted folder for (checkpoint sha256, dtype): reused when present, else converted once.

    Returns (folder, cache hit, seconds spent converting). A lock keeps two builds from converting at once.
    """
    out = conversion_cache_dir(settings, plan.ckpt.alias, sha, plan.dtype)
    source_file = out.with_name(out.name + ".source.json")
    with stage.file_lock(out.with_name(out.name + ".lock")):
        if (out / "model.safetensors").is_file() or any(out.glob("model*.safetensors")):
            if not source_file.exists():  # made by the test fixture from the same shipped GGUF
                source_file.write_text(json.dumps({"checkpoint_sha256": sha, "dtype": plan.dtype,
                                                   "checkpoint": str(plan.ckpt.path)}))
            return out, True, 0.0
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(out.with_name(out.name + ".partial"), ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        with stage.console.status(f"converting {plan.ckpt.path.name} to {plan.dtype} safetensors "
                                  "(dequantise + save, ~35 s for SmolLM2)"):
            cpu.convert_checkpoint(plan.ckpt.path, out, plan.dtype)
        secs = time.perf_counter() - t
        source_file.write_text(json.dumps({"checkpoint_sha256": sha, "dtype": plan.dtype,
                                           "checkpoint": str(plan.ckpt.path), "seconds": round(secs, 2)}))
        return out, False, secs


def link_or_copy_tree(src: Path, dst: Path, label: str) -> str:
    """Hard-link src's files into dst (same filesystem, read-only use), else copy them."""
    try:
        for p in sorted(src.rglob("*")):
            if p.is_file() and p.name != stage.MANIFEST:
                target = dst / p.relative_to(src)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(p, target)
        return "hardlink"
    except OSError:
        shutil.rmtree(dst, ignore_errors=True)
        stage.copy_tree_local(src, dst, label)
        return "copy"


class GateFailed(RuntimeError):
    """The converted version does not compute what its checkpoint computes (the report says how far off)."""


def quality_gate(settings: Settings, plan: BuildPlan, sha: str, conv: Path, weights_sha256: str,
                 gate: GateOptions) -> dict[str, Any]:
    """The gate's report for this cpu build (or the skip record)."""
    if gate.skip_reason:
        stage.console.print(f"[yellow]quality gate skipped: {gate.skip_reason}[/yellow]", highlight=False)
        return skipped_report(gate.skip_reason)
    report = gate_engine.cpu_gate(plan.ckpt.path, sha, conv, weights_sha256, plan.dtype, gate, settings.cache_dir)
    stage.console.print(("[green]" if report["passed"] else "[red]") + summary(report) + "[/]", highlight=False)
    return report


def build(opts: BuildOptions, settings: Settings, db_url: str | None = None,
          gate: GateOptions | None = None, calib_dataset: str | None = None) -> BuildResult:
    """Run one build; raises BuildError for bad input (before any work) or a failed step (row -> failed),
    including a failed quality gate (`gate`: how it runs; default GateOptions()). `calib_dataset`: the trtllm
    target's local calibration folder (default the shipped build_engines/calib)."""
    db_url = db_url or settings.db_url
    gate = gate or GateOptions()
    if calib_dataset and opts.target != "trtllm":
        raise BuildError("--calib-dataset", "only the trtllm target calibrates (fp8); the cpu target takes none")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    check_options(opts)
    ckpt_path, alias = precheck_checkpoint(opts.checkpoint)
    if opts.target == "trtllm":
        return trtllm.build_trtllm(opts, settings, db_url, gate, calib_dataset)
    sha = stage.checkpoint_sha256(ckpt_path, settings.cache_dir / "checksums.json")
    timings["checksum_s"] = time.perf_counter() - t0
    hint = conversion_cache_dir(settings, alias, sha, "bf16")  # same config.json whatever the dtype
    plan = resolve(opts, inspect_checkpoint(opts.checkpoint, config_hint=hint))
    fields = plan.fingerprint_fields(sha)
    fingerprint = inputs_fingerprint(fields)
    uri = store_uri(settings, opts)
    vdir = version_dir(settings, opts.model, opts.version)
    if opts.dry_run:
        text = "\n".join([f"target cpu: {opts.model} version {opts.version}",
                          f"  convert {plan.ckpt.path} -> {conversion_cache_dir(settings, alias, sha, plan.dtype)} "
                          f"({plan.dtype} safetensors + tokenizer + config; reused when cached)",
                          f"  node-local copy -> {vdir}/weights, Triton repository -> {vdir}/model_repository",
                          f"  quality gate: {gate.prompts} prompts x {gate.gen_tokens} tokens vs transformers fp32"
                          + (f" SKIPPED ({gate.skip_reason})" if gate.skip_reason else "")
                          + " (failed -> registered failed)",
                          f"  stage -> {uri}; register status building -> built -> staged",
                          f"  max_context {plan.max_context}, inputs sha256 {fingerprint}"])
        return BuildResult("planned", opts.model, opts.version, message="dry run: nothing done", plan_text=text)

    with stage.file_lock(vdir.with_name(f".{opts.version}.lock"), blocking=False) as held:
        if not held:
            raise BuildError("--version", f"another build-engines is building {opts.model} version {opts.version} "
                                          "right now; wait for it to finish")
        clean_stale_partials(vdir, uri)
        reg = Registration(db_url, opts.model, opts.version)
        existing = check_existing(db_url, opts.model, opts.version, fingerprint, opts.force,
                                  artefacts_ok(settings, opts.model, opts.version, uri))
        if existing.decision == "noop":
            return BuildResult("noop", opts.model, opts.version, read_row(db_url, opts.model, opts.version),
                               f"{opts.model} version {opts.version} is already built from the same inputs "
                               f"(status {existing.status}); nothing to do")
        build_info: dict[str, Any] = {
            "tool": TOOL_VERSION, "host": platform.node(), "inputs": fields, "inputs_sha256": fingerprint,
            "options": opts.model_dump(mode="json"), "previous": existing.__dict__,
            "checkpoint": {"path": str(plan.ckpt.path), "kind": plan.ckpt.kind, "sha256": sha},
            "started_at": datetime.now(timezone.utc).isoformat(), "timings_s": timings}
        reg.begin(weights_uri=uri, dtype=plan.dtype, tensor_parallel=1, max_context=plan.max_context,
                  engine_kind="cpu", repository_path="", build_info=build_info)
        partial = vdir.with_name(f".{opts.version}.partial-{uuid.uuid4().hex[:8]}")
        step = "convert"
        try:
            t = time.perf_counter()
            conv, hit, conv_s = convert_cached(settings, plan, sha)
            timings["convert_s"] = time.perf_counter() - t
            build_info["conversion_cache"] = {"path": str(conv), "hit": hit, "convert_s": round(conv_s, 2)}
            step = "write node-local copy"
            t = time.perf_counter()
            build_info["local_copy"] = link_or_copy_tree(conv, partial / "weights", "weights")
            manifest = stage.manifest_of(partial / "weights", "weights")
            (partial / "weights" / stage.MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
            timings["local_copy_s"] = time.perf_counter() - t
            step = "render Triton repository"
            values = triton_repo.cpu_values(vdir / "weights", settings.data_dir / "adapters", plan.max_context,
                                            plan.dtype)
            triton_repo.render_repository(partial / "model_repository", values)
            repo_manifest = stage.manifest_of(partial / "model_repository", "repository")
            build_info.update(weights_sha256=stage.tree_digest(manifest), files=manifest,
                              repository_sha256=stage.tree_digest(repo_manifest))
            reg.update("built", build_info=build_info)
            step = "quality gate"
            t = time.perf_counter()
            report = quality_gate(settings, plan, sha, conv, build_info["weights_sha256"], gate)
            timings["quality_gate_s"] = time.perf_counter() - t
            if not report["passed"] and not report.get("skipped"):
                raise GateFailed(summary(report))
            step = "stage to weights store"
            t = time.perf_counter()
            stage.stage_to_store(partial / "weights", uri, manifest)
            timings["stage_store_s"] = time.perf_counter() - t
            step = "publish node-local copy"
            stage.replace_dir(partial, vdir)
            timings["total_s"] = time.perf_counter() - t0
            build_info["finished_at"] = datetime.now(timezone.utc).isoformat()
            timings.update({k: round(v, 3) for k, v in timings.items()})
            reg.update("staged", repository_path=str(vdir / "model_repository"), weights_uri=uri,
                       build_info=build_info, quality_gate=report)
        except BaseException as exc:
            why = "interrupted" if isinstance(exc, (KeyboardInterrupt, SystemExit)) else type(exc).__name__
            if isinstance(exc, GateFailed):
                reg.fail(str(exc), build_info, quality_gate=report)
            else:
                reg.fail(f"{why} during {step}: {exc}", build_info)
            shutil.rmtree(partial, ignore_errors=True)
            if isinstance(exc, GateFailed):
                raise BuildError(step, f"{exc}; {opts.model} version {opts.version} is registered failed "
                                       "with the report") from exc
            if isinstance(exc, Exception) and not isinstance(exc, BuildError):
                raise BuildError(step, f"{type(exc).__name__}: {exc}") from exc
            raise
    row = read_row(db_url, opts.model, opts.version)
    return BuildResult("built", opts.model, opts.version, row,
                       f"{opts.model} version {opts.version} staged in {timings['total_s']:.1f} s "
                       f"(conversion cache {'hit' if hit else 'miss'}; {summary(report)})",
                       files={"repository": str(vdir / "model_repository"), "weights": str(vdir / "weights"),
                              "weights_uri": uri})


def ensure_node_local(settings: Settings, model: str, version: str, db_url: str | None = None,
                      store: str | None = None) -> Path:
    """The version's Triton repository on this node, filling the node-local cache from the weights store
    when it is missing (a fresh node) and re-rendering the repository for this node's paths (cpu target).

    Returns the repository path to hand to `tritonserver`. Checksums are verified against the store's manifest.
    `store` reads the same staged copy through another URL (e.g. an HTTP view of the store).
    """
    row = read_row(db_url or settings.db_url, model, version)
    if row is None or row["status"] not in ("staged", "serving", "draining"):
        raise BuildError("--version", f"{model} version {version} is not staged "
                                      f"(status {row['status'] if row else 'missing'})")
    vdir, uri = version_dir(settings, model, version), store or row["weights_uri"]
    if row["engine_kind"] != "cpu":
        if not (vdir / stage.MANIFEST).is_file():
            stage.fetch_from_store(uri, vdir)
        return vdir / "model_repository"
    stage.fetch_from_store(uri, vdir / "weights")
    repo = vdir / "model_repository"
    if not (repo / "llm" / "config.pbtxt").is_file():
        values = triton_repo.cpu_values(vdir / "weights", settings.data_dir / "adapters", row["max_context"],
                                        row["dtype"])
        triton_repo.render_repository(repo, values)
    return repo
