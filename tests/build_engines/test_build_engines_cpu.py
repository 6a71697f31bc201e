"""build-engines, target cpu: real conversions (cached), real staging, a real registry (SQLite + PostgreSQL)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest

from build_engines import build as build_mod
from build_engines import stage
from build_engines.build import build
from build_engines.plan import BuildError, parse_options
from build_engines.register import read_row
from common.settings import Settings
from registry.db import session_scope
from registry.queries import list_audit, set_routes


def _opts(version: str = "2", **kw):
    return parse_options(model="smollm2-135m", version=version, checkpoint="smollm2", target="cpu", **kw)


def _statuses(db_url: str, target: str) -> list[str]:
    with session_scope(db_url) as s:
        return [a.action for a in reversed(list_audit(s)) if a.target == target]


def test_cpu_build_registers_stages_and_is_idempotent(be_settings: Settings, db_url: str, smollm2_dir: Path) -> None:
    result = build(_opts(), be_settings, db_url)
    assert result.outcome == "built"
    row = result.row
    assert row["status"] == "staged" and row["engine_kind"] == "cpu" and row["tensor_parallel"] == 1
    assert row["dtype"] == "bf16" and row["max_context"] == 2048  # min(8192 from config, --max-context 2048)
    assert _statuses(db_url, "smollm2-135m/2") == ["build_started", "build_built", "build_staged"]
    vdir = be_settings.engines_dir / "smollm2-135m" / "2"
    assert row["repository_path"] == str(vdir / "model_repository")
    for step in ("llm", "preprocessing", "engine", "postprocessing"):
        assert (vdir / "model_repository" / step / "config.pbtxt").is_file()
        assert (vdir / "model_repository" / step / "1").is_dir()
    engine_cfg = (vdir / "model_repository" / "engine" / "config.pbtxt").read_text()
    assert f'"{vdir / "weights"}"' in engine_cfg and '"2048"' in engine_cfg
    info = row["build_info"]
    assert info["conversion_cache"]["hit"] is True
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(info["files"])
    # Both copies hold exactly the recorded checksums.
    stage.verify(vdir / "weights", info["files"], "local")
    stage.verify(Path(row["weights_uri"]), info["files"], "store")
    assert json.loads((Path(row["weights_uri"]) / stage.MANIFEST).read_text()) == info["files"]

    again = build(_opts(), be_settings, db_url)
    assert again.outcome == "noop" and "nothing to do" in again.message
    assert _statuses(db_url, "smollm2-135m/2") == ["build_started", "build_built", "build_staged"]


def test_existing_version_with_other_inputs_is_refused_unless_forced(be_settings: Settings, sqlite_url: str,
                                                                    smollm2_dir: Path) -> None:
    build(_opts(), be_settings, sqlite_url)
    with pytest.raises(BuildError, match="already exists .* different inputs") as err:
        build(_opts(max_context=1024), be_settings, sqlite_url)
    assert err.value.field == "--version"
    assert read_row(sqlite_url, "smollm2-135m", "2")["max_context"] == 2048  # untouched
    with session_scope(sqlite_url) as s:
        set_routes(s, "smollm2-135m", {"2": 100}, actor="test")
    with pytest.raises(BuildError, match="receives 100% of traffic"):
        build(_opts(max_context=1024, force=True), be_settings, sqlite_url)
    with session_scope(sqlite_url) as s:
        build(_opts(version="3"), be_settings, sqlite_url)
        set_routes(s, "smollm2-135m", {"3": 100}, actor="test")
    forced = build(_opts(max_context=1024, force=True), be_settings, sqlite_url)
    assert forced.outcome == "built" and forced.row["max_context"] == 1024
    assert forced.row["build_info"]["previous"]["reason"] == "forced"


@pytest.mark.parametrize("exc", [OSError("disk full"), KeyboardInterrupt("signal SIGTERM")])
def test_failure_midway_leaves_a_failed_row_and_nothing_routable(be_settings: Settings, sqlite_url: str,
                                                                 smollm2_dir: Path, monkeypatch, exc) -> None:
    def broken(*_a, **_k):
        raise exc
    monkeypatch.setattr(build_mod.stage, "stage_to_store", broken)
    with pytest.raises(BuildError if isinstance(exc, OSError) else KeyboardInterrupt):
        build(_opts(), be_settings, sqlite_url)
    row = read_row(sqlite_url, "smollm2-135m", "2")
    assert row["status"] == "failed"
    assert "stage to weights store" in row["status_reason"]
    assert ("interrupted" if isinstance(exc, KeyboardInterrupt) else "disk full") in row["status_reason"]
    model_dir = be_settings.engines_dir / "smollm2-135m"
    assert not (model_dir / "2").exists()
    assert not [p for p in model_dir.iterdir() if ".partial" in p.name]
    assert _statuses(sqlite_url, "smollm2-135m/2")[-1] == "build_failed"
    monkeypatch.undo()
    killed = model_dir / ".2.partial-deadbeef"  # what a SIGKILLed build would leave behind
    (killed / "weights").mkdir(parents=True)
    retry = build(_opts(), be_settings, sqlite_url)  # a failed version may be rebuilt without --force
    assert not killed.exists()
    assert retry.outcome == "built" and retry.row["status"] == "staged"


def test_bad_input_fails_before_any_work(be_settings: Settings, sqlite_url: str, tmp_path: Path,
                                         smollm2_dir: Path) -> None:
    cases = [
        (dict(checkpoint=str(tmp_path / "missing")), "--checkpoint", "does not exist"),
        (dict(checkpoint=str(tmp_path)), "--checkpoint", "without config.json"),
        (dict(dtype="int3"), "--dtype", "allowed: ['bf16', 'fp16', 'fp32']"),
        (dict(tensor_parallel=2), "--tensor-parallel", "allowed: 1"),
        (dict(checkpoint=str(smollm2_dir), target="trtllm", tensor_parallel=2), "--tensor-parallel",
         "does not divide the model's 9 attention heads; allowed: [1, 3, 9]"),
    ]
    bad_gguf = tmp_path / "x.gguf"
    bad_gguf.write_bytes(b"NOPE")
    cases.append((dict(checkpoint=str(bad_gguf)), "--checkpoint", "GGUF magic"))
    for kw, field, text in cases:
        args = dict(model="smollm2-135m", version="2", checkpoint="smollm2", target="cpu") | kw
        with pytest.raises(BuildError) as err:
            build(parse_options(**args), be_settings, sqlite_url)
        assert err.value.field == field and text in str(err.value), (kw, str(err.value))
    with pytest.raises(BuildError, match="--version"):
        parse_options(model="smollm2-135m", version="../2", checkpoint="smollm2")
    assert not be_settings.engines_dir.exists() or not any(be_settings.engines_dir.rglob("config.pbtxt"))
    assert not Path(sqlite_url.removeprefix("sqlite:///")).exists()  # not even a registry row


def test_fsspec_weights_store_and_node_local_fetch(be_settings: Settings, sqlite_url: str, smollm2_dir: Path,
                                                   tmp_path: Path) -> None:
    """An object store through fsspec (memory://): upload, verify, then refill a node-local cache from it."""
    result = build(_opts(weights_store="memory://weights"), be_settings, sqlite_url)
    uri = result.row["weights_uri"]
    assert uri == "memory://weights/smollm2-135m/2"
    fs = fsspec.filesystem("memory")
    assert fs.exists("/weights/smollm2-135m/2/MANIFEST.json")
    local = tmp_path / "node-cache" / "smollm2-135m-2"
    stage.fetch_from_store(uri, local)
    stage.verify(local, result.row["build_info"]["files"], "fetched")
    assert stage.fetch_from_store(uri, local) == local  # complete copy: reused as is


def test_cli_exit_codes_and_messages(be_settings: Settings, smollm2_dir: Path, tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'cli.sqlite'}"
    cmd = [sys.executable, "-m", "build_engines.cli", "--model", "smollm2-135m", "--version", "1",
           "--checkpoint", "smollm2", "--target", "cpu", "--db-url", db]
    first = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["status"] == "staged"
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert second.returncode == 0 and "nothing to do" in second.stderr
    bad = subprocess.run(cmd + ["--max-context", "512"], capture_output=True, text=True, timeout=240)
    assert bad.returncode == 2 and "--version" in bad.stderr and "--force" in bad.stderr
    typo = subprocess.run(cmd[:-2] + ["--dtype", "fp4"], capture_output=True, text=True, timeout=240)
    assert typo.returncode == 2 and "'fp4' is not supported" in typo.stderr


def test_fresh_node_refills_its_cache_from_the_store(be_settings: Settings, sqlite_url: str,
                                                     smollm2_dir: Path) -> None:
    """A node without the version's folder gets it back from the weights store, checksums verified."""
    import shutil
    from build_engines.build import ensure_node_local
    row = build(_opts(), be_settings, sqlite_url).row
    vdir = be_settings.engines_dir / "smollm2-135m" / "2"
    shutil.rmtree(vdir)
    repo = ensure_node_local(be_settings, "smollm2-135m", "2", sqlite_url)
    assert repo == Path(row["repository_path"])
    stage.verify(vdir / "weights", row["build_info"]["files"], "refilled")
    assert f'"{vdir / "weights"}"' in (repo / "engine" / "config.pbtxt").read_text()
    with pytest.raises(BuildError, match="not staged"):
        ensure_node_local(be_settings, "smollm2-135m", "9", sqlite_url)


def test_sigterm_mid_conversion_records_failed(tmp_path: Path) -> None:
    """A real SIGTERM while converting (empty conversion cache): exit 130, row `failed`, nothing published."""
    import os
    import signal
    import time
    env = dict(os.environ, FLEET_DATA_DIR=str(tmp_path / "data"), FLEET_CACHE_DIR=str(tmp_path / "cache"))
    db = f"sqlite:///{tmp_path / 'sig.sqlite'}"
    proc = subprocess.Popen([sys.executable, "-m", "build_engines.cli", "--model", "smollm2-135m", "--version", "7",
                             "--checkpoint", "smollm2", "--db-url", db], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not list((tmp_path / "cache").glob("*.lock")):
        time.sleep(0.2)  # the conversion has started once its lock file exists
    time.sleep(3.0)  # well inside the ~35 s conversion (past the imports)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    row = read_row(db, "smollm2-135m", "7")
    assert row["status"] == "failed" and "interrupted during convert" in row["status_reason"], row
    assert not (tmp_path / "data" / "engines" / "smollm2-135m" / "7").exists()
