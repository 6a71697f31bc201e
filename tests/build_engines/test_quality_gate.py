"""The quality gate of build-engines, for real: a tiny random Llama checkpoint made with transformers (SmolLM2's
tokenizer), converted by build-engines, gated by our engine against transformers fp32. A good conversion
passes and its report is stored with the `staged` version; a damaged conversion (one tensor of the converted
safetensors transposed, as a wrong conversion would) fails and the row is `failed` with the numbers, never
`staged`; --skip-gate needs a reason and records it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from build_engines import quality_gate as qg
from build_engines.build import build
from build_engines.cli import main as cli_main
from build_engines.plan import BuildError, parse_options
from build_engines.quality_gate import GateOptions
from build_engines.register import read_row
from common.settings import Settings, load_settings
from registry.db import session_scope
from registry.queries import list_audit

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
GATE = GateOptions(prompts=24, gen_tokens=8)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A 2-layer random Llama with SmolLM2's vocabulary and tokenizer, saved as a Hugging Face folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(33)
    LlamaForCausalLM(cfg).save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(smollm2_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def gate_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This module's own cache (conversions, gate references): the damage below never reaches the shared one."""
    return tmp_path_factory.mktemp("gate-cache")


@pytest.fixture
def gate_settings(tmp_path: Path, gate_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("FLEET_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("FLEET_CACHE_DIR", str(gate_cache))
    return load_settings()


@pytest.fixture
def converted(sqlite_url: str):
    """Where the test's conversion landed; removed afterwards, so the next test converts a clean copy."""
    folders: list[Path] = []

    def conv_of(version: str) -> Path:
        folders.append(Path(read_row(sqlite_url, "tiny", version)["build_info"]["conversion_cache"]["path"]))
        return folders[-1]
    yield conv_of
    for f in folders:
        shutil.rmtree(f, ignore_errors=True)
        f.with_name(f.name + ".source.json").unlink(missing_ok=True)


def _opts(ckpt: Path, version: str):
    return parse_options(model="tiny", version=version, checkpoint=str(ckpt), target="cpu", dtype="fp32")


def _damage(conv_dir: Path, name: str) -> None:
    """Transpose one square weight in the converted safetensors (a new file: hard links to it stay intact)."""
    path = conv_dir / "model.safetensors"
    tensors = load_file(path)
    tensors[name] = tensors[name].t().contiguous()
    tmp = path.with_name("damaged.safetensors")
    save_file(tensors, tmp, metadata={"format": "pt"})
    tmp.replace(path)


def test_good_conversion_passes_and_damaged_one_is_failed(gate_settings: Settings, sqlite_url: str,
                                                          tiny_llama: Path, converted) -> None:
    good = build(_opts(tiny_llama, "1"), gate_settings, sqlite_url, GATE)
    row = good.row
    assert row["status"] == "staged"
    report = row["quality_gate"]
    assert report["passed"] is True and report["failures"] == []
    m = report["metrics"]
    assert m["positions"] == 24 * 8
    assert m["agreement"] >= 0.99 and m["mean_abs_logprob_delta"] < 1e-3  # fp32 vs fp32: summation order only
    assert report["thresholds"] == {"min_agreement": 0.99, "max_mean_logprob_delta": 0.01, "max_ppl_rel_delta": 0.01}
    assert report["eval_set"]["sha256"] == qg.eval_set_sha256() and report["eval_set"]["prompts"] == 24
    assert report["reference"]["kind"].startswith("transformers fp32")

    conv = converted("1")
    _damage(conv, "model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(BuildError, match="quality gate FAILED") as err:
        build(_opts(tiny_llama, "2"), gate_settings, sqlite_url, GATE)
    assert err.value.field == "quality gate"
    bad = read_row(sqlite_url, "tiny", "2")
    assert bad["status"] == "failed" and "greedy agreement" in bad["status_reason"]
    assert bad["quality_gate"]["passed"] is False
    assert bad["quality_gate"]["metrics"]["agreement"] < 0.99
    assert bad["quality_gate"]["candidate"]["weights_sha256"] != report["candidate"]["weights_sha256"]
    assert not (gate_settings.engines_dir / "tiny" / "2").exists()  # nothing staged, nothing routable
    assert read_row(sqlite_url, "tiny", "1")["status"] == "staged"  # the good version's weights untouched
    with session_scope(sqlite_url) as s:
        last = [a for a in list_audit(s) if a.target == "tiny/2"][0]
    assert last.action == "build_failed" and last.after["quality_gate"]["passed"] is False


def test_zeroed_weight_fails_the_gate_through_the_cli(gate_settings: Settings, sqlite_url: str, tiny_llama: Path,
                                                      converted, capsys: pytest.CaptureFixture[str]) -> None:
    """Exit status 1, the numbers on the console, the row `failed`: a conversion that lost a tensor's values
    (one MLP's down projection zeroed)."""
    args = ["--model", "tiny", "--version", "1", "--checkpoint", str(tiny_llama), "--dtype", "fp32",
            "--db-url", sqlite_url, "--gate-prompts", "24", "--gate-tokens", "8"]
    assert cli_main(args) == 0
    conv = converted("1")
    tensors = load_file(conv / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"].zero_()
    save_file(tensors, conv / "x.safetensors", metadata={"format": "pt"})
    (conv / "x.safetensors").replace(conv / "model.safetensors")
    capsys.readouterr()
    assert cli_main([*args[:3], "2", *args[4:]]) == 1
    out = capsys.readouterr().err
    assert "quality gate FAILED" in out and "agreement" in out
    assert read_row(sqlite_url, "tiny", "2")["status"] == "failed"


def test_skip_gate_needs_a_reason_and_records_it(gate_settings: Settings, sqlite_url: str, tiny_llama: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", "tiny", "--version", "1", "--checkpoint", str(tiny_llama), "--dtype", "fp32",
            "--db-url", sqlite_url]
    assert cli_main([*args, "--skip-gate", "x"]) == 2
    assert "--skip-gate: the reason 'x' is too short" in capsys.readouterr().err
    assert cli_main([*args, "--gate-threshold", "min_agreement=2"]) == 2
    assert "--gate-threshold: min_agreement=2.0 is out of range" in capsys.readouterr().err.replace("\n", " ")
    assert not Path(sqlite_url.removeprefix("sqlite:///")).exists()  # nothing was done, not even a row
    assert cli_main([*args, "--skip-gate", "INC-42: gate reference too large for this node"]) == 0
    row = read_row(sqlite_url, "tiny", "1")
    assert row["status"] == "staged"
    assert row["quality_gate"] == {**qg.skipped_report("INC-42: gate reference too large for this node")}
    assert row["quality_gate"]["passed"] is False  # an ungated version is not a passed one (rollout rule)


def test_metrics_and_thresholds_per_dtype() -> None:
    ref = qg.Reference([[1]], [[5, 6, 7, 8]], [[5, 6, 7, 8]], [[-0.1, -0.2, -0.3, -0.4]])
    same = qg.compare(ref, qg.Scored([[5, 6, 7, 8]], [[-0.1, -0.2, -0.3, -0.4]]))
    assert same["agreement"] == 1.0 and same["mean_abs_logprob_delta"] == 0 and same["ppl_rel_delta"] == 0
    off = qg.compare(ref, qg.Scored([[5, 9, 7, 9]], [[-0.1, -1.2, -0.3, float("nan")]]))
    assert off["agreement"] == 0.5 and off["max_abs_logprob_delta"] > 1000  # NaN counts as worst case
    assert qg.thresholds_for("fp8").min_agreement < qg.thresholds_for("bf16").min_agreement \
        < qg.thresholds_for("fp32").min_agreement
    assert qg.thresholds_for("bf16", {"min_agreement": 0.5}).min_agreement == 0.5
    with pytest.raises(ValueError, match="--dtype: no quality-gate thresholds for 'int4'"):
        qg.thresholds_for("int4")
    report = qg.make_report(ref, qg.Scored([[5, 9, 7, 9]], [[-0.1, -1.2, -0.3, -0.4]]), "bf16", GateOptions(),
                            "test", {})
    assert report["passed"] is False and any("greedy agreement 0.5000 < 0.9" in f for f in report["failures"])
    assert json.loads(json.dumps(report)) == report  # stored as JSON in the registry
