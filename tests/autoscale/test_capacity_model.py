"""Capacity model, prefix reuse, calibration and the reuse sweep (pure functions; no full-day run)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from autoscale.capacity import ModelProfile
from autoscale.simulator.calibrate import calibrated_assumptions, load_calibration
from autoscale.simulator.costs import unit_costs
from autoscale.simulator.prefix import PrefixWorkload, reuse_for_pool
from autoscale.simulator.settings import SimSettings

ROOT = Path(__file__).resolve().parents[2]
H200 = ROOT / "autoscale" / "simulator" / "calibration" / "h200-8b-transformers.jsonl"


@pytest.fixture(scope="module")
def models() -> dict[str, ModelProfile]:
    return {m.name: m for m in SimSettings().models}


def test_kv_bytes_per_token_and_capacity_come_from_the_model_shape(models) -> None:
    large, small = models["large-70b-fp8"], models["small-8b-fp16"]
    assert large.kv_bytes_per_token == 2 * 80 * 8 * 128 * 1  # fp8 KV, GQA with 8 KV heads
    assert small.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert large.kv_capacity_tokens == pytest.approx((4 * 80 * 0.9 - 70) * 1e9 / 163840)


def test_decode_only_replica_sustains_exactly_the_requirements_decode_rate(models) -> None:
    large, small = models["large-70b-fp8"], models["small-8b-fp16"]
    cap = large.capacity(0.0, 2150, 300, 40.0, role="decode")
    assert cap.requests_per_s * 300 == pytest.approx(2500)  # step(2500 / 40 streams) = 25 ms
    assert cap.bound == "stream-speed"
    # LoRA traffic slows every step of the small model's mixed batches
    assert small.capacity(0.0, 2150, 300, 40.0, role="decode").requests_per_s * 300 < 4000


def test_colocated_step_with_prefill_stays_within_the_stream_speed_target(models) -> None:
    large = models["large-70b-fp8"]
    cap = large.capacity(1000, 2150, 300, 40.0)
    s0, s1 = large.step_curve(40.0)
    lam = cap.requests_per_s
    step = s0 + s1 * lam * 300 / 40 + lam * cap.prefill_s / 40  # fixed + decode batch + prefill chunk per step
    assert step == pytest.approx(1 / 40)
    # prefill sharing the steps costs throughput against the simple P/prefill + O/decode sum
    assert cap.replica_seconds > 1000 / 15000 + 300 / 2500


def test_long_contexts_are_bounded_by_kv_capacity(models) -> None:
    small = models["small-8b-fp16"]
    cap = small.capacity(0.0, 32000, 300, 40.0, role="decode")  # 13 sequences of 32k fill the KV cache
    assert cap.bound == "kv-capacity"
    held_s = 300 / 40 + small.kv_transfer_s(32000)  # decoding, plus while its KV arrives
    assert cap.requests_per_s * held_s * 32000 == pytest.approx(small.kv_capacity_tokens, rel=1e-6)


def test_prefix_aware_routing_reuses_more_than_round_robin(models) -> None:
    raw = SimSettings().assumptions["prefix"]
    small = models["small-8b-fp16"]
    mix = {"interactive": 0.6, "standard": 0.4}
    aware = reuse_for_pool(PrefixWorkload.from_dict(raw), small, 2000, 300, mix, 1200, 150, 60)
    rr = reuse_for_pool(PrefixWorkload.from_dict(raw | {"routing": "round-robin"}), small, 2000, 300, mix, 1200, 150, 60)
    assert aware.interactive > rr.interactive
    assert rr.history_hit < 0.01  # a follow-up lands on the previous turn's replica 1 time in 150
    cacheable = PrefixWorkload.from_dict(raw).cacheable_share("interactive", 2000)
    assert aware.interactive <= cacheable + 1e-9
    slower = reuse_for_pool(PrefixWorkload.from_dict(raw | {"think_time_s": 600}), small, 2000, 300, mix, 1200, 150, 60)
    assert slower.history_hit < aware.history_hit


def test_reuse_override_and_disaggregated_costs(models) -> None:
    pw = dataclasses.replace(SimSettings().prefix, override=0.8)
    large = models["large-70b-fp8"]
    colo = unit_costs(large, pw, "colocated", 2000, 300, 0.6, 500, 0.85, 40)[0]
    assert colo.reuse["interactive"] == 0.8 and colo.reuse["batch"] == 0.0
    prefill, decode = unit_costs(large, pw, "disaggregated", 2000, 300, 0.6, 500, 0.85, 40)
    assert prefill.w_fg == pytest.approx(400 / 15000)
    assert decode.kv_transfer_s == pytest.approx(2150 * 163840 / (25e9 * 4))
    assert prefill.token_share + decode.token_share == pytest.approx(1.0)


def test_calibration_from_the_h200_measurement() -> None:
    cal = load_calibration(H200)
    assert cal.prefill_tokens_per_s == 34374
    s0, s1 = cal.fit()
    assert 0.06 < s0 < 0.075 and s1 > 0  # transformers: ~70 ms fixed step
    out = calibrated_assumptions(SimSettings().assumptions, H200, None, 40.0)
    small = ModelProfile.from_dict(next(m for m in out["models"] if m["name"] == "small-8b-fp16"), out["gpu"])
    assert small.calibration["stream_target_reachable"] is False
    cap = small.capacity(1000, 2150, 300, 40.0)
    assert cap.bound == "unreachable-speed" and cap.stream_tokens_per_s < 40


def test_calibration_from_the_engine_bench_json(tmp_path: Path) -> None:
    bench = {"systems": {"engine": {
        "1": {"requests": 4, "prompt_tokens": 2000, "cached_prompt_tokens": 0, "ttft_ms_p50": 500.0, "itl_ms_p50": 20.0},
        "8": {"requests": 8, "prompt_tokens": 4000, "cached_prompt_tokens": 0, "ttft_ms_p50": 2000.0, "itl_ms_p50": 34.0}}}}
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(bench))
    cal = load_calibration(path)
    assert cal.prefill_tokens_per_s == pytest.approx(1000.0)  # 500 uncached tokens in 0.5 s
    assert cal.fit() == pytest.approx((0.018, 0.002))
    path.write_text(json.dumps({"systems": {}}))
    with pytest.raises(ValueError, match="decode step times"):
        load_calibration(path)


def test_gpu_decode_curve_script_writes_a_calibration_file(tmp_path: Path) -> None:
    """The GPU measurement script runs on a CPU with a tiny shape (smoke) and its output calibrates."""
    import subprocess
    import sys

    out = tmp_path / "curve.jsonl"
    subprocess.run([sys.executable, str(ROOT / "bench" / "autoscale" / "gpu_decode_curve.py"), "--device", "cpu",
                    "--shape", "tiny", "--batches", "1", "2", "--reps", "2", "--ctx", "64", "--prompt", "32",
                    "--out", str(out)], check=True, capture_output=True, timeout=120)
    cal = load_calibration(out)
    assert len(cal.points) == 2 and cal.prefill_tokens_per_s > 0
    assert all(step > 0 for _, step in cal.points)


def test_the_measured_h200_graph_step_matches_the_shape_derived_fixed_step() -> None:
    cal = load_calibration(ROOT / "autoscale" / "simulator" / "calibration" / "h200-8b-plain-pytorch-graph.jsonl")
    s0, _ = cal.fit()
    small = next(m for m in SimSettings().models if m.name == "small-8b-fp16")
    derived = small.step_curve(40.0)[0] / small.compute_factor
    assert s0 == pytest.approx(derived, rel=0.1)  # weights / HBM bandwidth + overhead: 7.0 ms vs 6.6 ms measured
