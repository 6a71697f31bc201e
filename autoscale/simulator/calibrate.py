"""`fleet simulate --calibrate FILE`: replace a model's assumed throughput with measured step costs.

Accepted inputs (what the project's benchmarks write):
- JSON lines with `batch`, `prefill_tok_s` and `decode_step_ms` per row (the GPU reference run,
  autoscale/simulator/calibration/h200-8b-transformers.jsonl);
- the engine benchmark's JSON (`bench/results/engine-*.json`, CPU or GPU): `systems.engine.<concurrency>`
  with `itl_ms_p50` (the decode step at that batch), prompt / cached prompt tokens and `ttft_ms_p50`.
  Its prefill rate is uncached prompt tokens per request / TTFT p50 at the lowest concurrency: queueing is
  inside that TTFT, so it is a lower bound.

The decode points are fitted to step(B) = s0 + s1 * B (least squares, both >= 0), as NVIDIA Dynamo's
planner interpolates profiled curves; prefill tokens/s is the best measured rate. A measurement on G GPUs
applied to a replica of R GPUs scales prefill and divides step times by R / G (ideal tensor parallelism;
said in the result's `calibration.scaling`).
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from autoscale.capacity import ModelProfile

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Calibration:
    """Measured per-GPU-group costs: prefill tokens/s and (batch, decode step seconds) points."""

    source: str
    prefill_tokens_per_s: float
    points: tuple[tuple[float, float], ...]
    gpus: int = 1

    def fit(self) -> tuple[float, float]:
        """(s0, s1) of step(B) = s0 + s1 B; one point means a flat step (s1 = 0)."""
        b = np.array([p[0] for p in self.points], dtype=float)
        s = np.array([p[1] for p in self.points], dtype=float)
        if len(b) == 1:
            return float(s[0]), 0.0
        s1, s0 = np.polyfit(b, s, 1)
        if s1 < 0:  # noisy points: a flat step is the honest reading
            return float(s.mean()), 0.0
        if s0 < 0:
            return 0.0, float((s * b).sum() / (b * b).sum())
        return float(s0), float(s1)


def _from_jsonl(rows: list[dict], source: str) -> Calibration:
    points = tuple((float(r["batch"]), float(r["decode_step_ms"]) / 1e3) for r in rows if r.get("decode_step_ms"))
    prefill = max(float(r.get("prefill_tok_s") or 0.0) for r in rows)
    return Calibration(source, prefill, points, int(rows[0].get("gpus", 1)))


def _from_engine_bench(payload: dict, source: str) -> Calibration:
    levels = payload.get("systems", {}).get("engine") or {}
    points, prefill = [], 0.0
    for conc, row in sorted(levels.items(), key=lambda kv: int(kv[0])):
        if row.get("itl_ms_p50"):
            points.append((float(conc), float(row["itl_ms_p50"]) / 1e3))
        if row.get("ttft_ms_p50") and row.get("requests"):
            uncached = (float(row.get("prompt_tokens", 0)) - float(row.get("cached_prompt_tokens", 0))) / row["requests"]
            prefill = max(prefill, uncached / (float(row["ttft_ms_p50"]) / 1e3))
    return Calibration(source, prefill, tuple(points), int(payload.get("gpus", 1)))


def load_calibration(path: Path) -> Calibration:
    """Parse a benchmark file (JSON lines or the engine bench's JSON); ValueError naming what is missing."""
    text = path.read_text()
    try:
        payload = json.loads(text)
        rows = payload if isinstance(payload, list) else None
    except json.JSONDecodeError:
        try:
            payload, rows = None, [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: neither JSON nor JSON lines ({exc}); expected the engine bench's JSON or "
                             "JSON lines with batch/prefill_tok_s/decode_step_ms") from exc
    if rows:
        if not all(isinstance(r, dict) and "batch" in r and "decode_step_ms" in r for r in rows):
            raise ValueError(f"{path}: every JSON line needs batch and decode_step_ms (and prefill_tok_s)")
        cal = _from_jsonl(rows, str(path))
    elif isinstance(payload, dict) and "systems" in payload:
        cal = _from_engine_bench(payload, str(path))
    else:
        raise ValueError(f"{path}: expected JSON lines with batch/prefill_tok_s/decode_step_ms or the engine "
                         "bench's JSON (systems.engine.<concurrency>.itl_ms_p50)")
    if not cal.points or cal.prefill_tokens_per_s <= 0:
        raise ValueError(f"{path}: needs decode step times and a prefill rate; found {len(cal.points)} decode "
                         f"points and prefill {cal.prefill_tokens_per_s:.0f} tokens/s")
    return cal


def apply_calibration(model: ModelProfile, cal: Calibration, stream_target: float) -> ModelProfile:
    """The model with measured prefill and decode-step curve (scaled to its GPUs per replica)."""
    scale = model.gpus_per_replica / cal.gpus
    s0, s1 = cal.fit()
    s0, s1 = s0 / scale, s1 / scale
    b_max = max(p[0] for p in cal.points)
    calibrated = replace(model, prefill_tokens_per_s=cal.prefill_tokens_per_s * scale, decode_step_s=(s0, s1),
                         decode_tokens_per_s=b_max / (s0 + s1 * b_max),
                         calibration={**asdict(cal), "step_s0_ms": s0 * 1e3, "step_s1_ms": s1 * 1e3,
                                      "scaling": f"x{scale:g} (measured on {cal.gpus} GPU, replica has "
                                                 f"{model.gpus_per_replica}; ideal tensor parallelism)",
                                      "max_stream_tokens_per_s": 1.0 / s0 if s0 > 0 else None,
                                      "stream_target_reachable": s0 * stream_target < 1.0})
    log.info("calibrated %s from %s: prefill %.0f tok/s, step %.2f ms + %.3f ms x batch%s", model.name, cal.source,
             calibrated.prefill_tokens_per_s, s0 * 1e3, s1 * 1e3,
             "" if s0 * stream_target < 1 else f" (no batch reaches {stream_target:g} tokens/s per stream)")
    return calibrated


def calibrated_assumptions(assumptions: dict, path: Path, model_name: str | None, stream_target: float) -> dict:
    """A copy of the assumptions with one model's entry replaced by its calibrated profile."""
    cal = load_calibration(path)
    models = assumptions["models"]
    names = [m["name"] for m in models]
    if model_name is None:  # default: the model whose replica has as many GPUs as the measurement
        model_name = next((m["name"] for m in models if m["gpus_per_replica"] == cal.gpus), names[0])
    if model_name not in names:
        raise ValueError(f"--calibrate-model {model_name!r} is not in the assumptions; choose from {names}")
    out = dict(assumptions)
    out["models"] = []
    for raw in models:
        if raw["name"] == model_name:
            m = apply_calibration(ModelProfile.from_dict(raw, assumptions.get("gpu")), cal, stream_target)
            raw = {**raw, "prefill_tokens_per_s": m.prefill_tokens_per_s, "decode_tokens_per_s": m.decode_tokens_per_s,
                   "decode_step_s": list(m.decode_step_s), "calibration": m.calibration}
        out["models"].append(raw)
    return out
