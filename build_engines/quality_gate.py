"""The quality gate of a build: does the converted engine compute what the checkpoint computes?

After conversion, the engine (ours on CPU, or the built TensorRT-LLM engine on a GPU node) runs the fixed
evaluation set shipped in build_engines/eval/prompts.jsonl and is compared, position by position, with the
checkpoint's own transformers run in fp32 (gate_reference.py). Teacher forcing on the reference continuation
(the reference's greedy tokens) keeps one early divergence from cascading: every position is scored on the
same context. Metrics:
- greedy agreement: share of positions whose top-1 token equals the reference's top-1;
- |logprob delta| of the reference token, mean and max (and p99) over positions;
- perplexity of the reference continuation, engine vs reference, as a relative delta.
Thresholds depend on the dtype (stricter for fp32/bf16 than for fp8) and can be overridden per build. The report
(numbers, thresholds, pass/fail, eval-set sha256) is stored with the version in the registry (`quality_gate`).
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

EVAL_SET = Path(__file__).with_name("eval") / "prompts.jsonl"
DEFAULT_PROMPTS = 48       # CI-sized: SmolLM2-135M's gate stays well under a minute on 2 cores
DEFAULT_GEN_TOKENS = 16    # reference continuation length scored per prompt
GATE_VERSION = 1           # bump when the metric definitions change (part of the cache keys)


@dataclass(frozen=True)
class Thresholds:
    """What a version must reach to pass. Agreement is a floor; the deltas are ceilings."""
    min_agreement: float
    max_mean_logprob_delta: float
    max_ppl_rel_delta: float

    def failures(self, m: dict[str, float]) -> list[str]:
        out = []
        if m["agreement"] < self.min_agreement:
            out.append(f"greedy agreement {m['agreement']:.4f} < {self.min_agreement}")
        if m["mean_abs_logprob_delta"] > self.max_mean_logprob_delta:
            out.append(f"mean |logprob delta| {m['mean_abs_logprob_delta']:.4f} > {self.max_mean_logprob_delta}")
        if m["ppl_rel_delta"] > self.max_ppl_rel_delta:
            out.append(f"perplexity relative delta {m['ppl_rel_delta']:.4f} > {self.max_ppl_rel_delta}")
        return out


# Per dtype. fp32: the same numbers up to summation order. bf16/fp16: SmolLM2-135M's bf16 conversion measures
# agreement 0.966-0.970, mean delta 0.027-0.028, perplexity delta < 0.003 (docs/build_engines.md), with margin. fp8 (TensorRT-LLM, ModelOpt) follows
# the looser accuracy NVIDIA states for fp8 PTQ, so the gate still catches a broken conversion.
DEFAULT_THRESHOLDS = {
    "fp32": Thresholds(0.99, 0.01, 0.01),
    "bf16": Thresholds(0.90, 0.10, 0.05),
    "fp16": Thresholds(0.92, 0.08, 0.04),
    "fp8": Thresholds(0.80, 0.25, 0.12),
}
THRESHOLD_KEYS = tuple(Thresholds.__dataclass_fields__)


def thresholds_for(dtype: str, overrides: dict[str, float] | None = None) -> Thresholds:
    """The dtype's defaults with `overrides` (field name -> value, e.g. from --gate-threshold) applied."""
    if dtype not in DEFAULT_THRESHOLDS:
        raise ValueError(f"--dtype: no quality-gate thresholds for {dtype!r}; known: {sorted(DEFAULT_THRESHOLDS)}")
    return replace(DEFAULT_THRESHOLDS[dtype], **(overrides or {}))


def parse_threshold(text: str) -> tuple[str, float]:
    """'min_agreement=0.95' -> ('min_agreement', 0.95); a clear error naming the flag otherwise."""
    key, sep, value = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or key not in THRESHOLD_KEYS:
        raise ValueError(f"--gate-threshold: {text!r} is not KEY=VALUE with KEY one of {list(THRESHOLD_KEYS)}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"--gate-threshold: {key} must be a number, got {value!r}") from None
    if not 0.0 <= number <= (1.0 if key == "min_agreement" else 100.0):
        raise ValueError(f"--gate-threshold: {key}={number} is out of range "
                         f"({'0..1' if key == 'min_agreement' else '0..100'})")
    return key, number


@dataclass(frozen=True)
class GateOptions:
    """How the gate runs for one build (CLI: --gate-prompts, --gate-tokens, --gate-threshold, --skip-gate)."""
    prompts: int = DEFAULT_PROMPTS
    gen_tokens: int = DEFAULT_GEN_TOKENS
    thresholds: dict[str, float] = field(default_factory=dict)
    skip_reason: str = ""  # non-empty: gate skipped, this reason recorded in the registry

    def __post_init__(self) -> None:
        available = len(load_eval_set())
        if not 1 <= self.prompts <= available:
            raise ValueError(f"--gate-prompts: {self.prompts} is out of range; allowed 1..{available} "
                             "(the prompts of the shipped evaluation set)")
        if not 1 <= self.gen_tokens <= 256:
            raise ValueError(f"--gate-tokens: {self.gen_tokens} is out of range; allowed 1..256")
        for key in self.thresholds:
            if key not in THRESHOLD_KEYS:
                raise ValueError(f"--gate-threshold: unknown key {key!r}; allowed {list(THRESHOLD_KEYS)}")


def load_eval_set(path: Path = EVAL_SET) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]


def eval_set_sha256(path: Path = EVAL_SET) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class Reference:
    """The checkpoint's own fp32 run: per prompt its ids, the greedy continuation, and at each continuation
    position the reference's top-1 token and log-probability of the continuation token."""
    prompt_ids: list[list[int]]
    continuation: list[list[int]]
    top1: list[list[int]]
    logprobs: list[list[float]]
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Scored:
    """The candidate engine's numbers at the same positions as the reference."""
    top1: list[list[int]]
    logprobs: list[list[float]]


def score_positions(logits: torch.Tensor, targets: Sequence[int]) -> tuple[list[int], list[float]]:
    """[positions, vocab] logits -> (top-1 ids, log-probability of each target id); fp32 softmax."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    idx = torch.tensor(list(targets), dtype=torch.long, device=logp.device)
    return logp.argmax(-1).tolist(), logp.gather(1, idx[:, None])[:, 0].tolist()


def compare(ref: Reference, got: Scored) -> dict[str, float]:
    """The gate's metrics over every scored position (a NaN/inf logprob counts as a worst-case delta)."""
    agree, deltas, lp_ref, lp_got = 0, [], 0.0, 0.0
    for r_top, r_lp, g_top, g_lp in zip(ref.top1, ref.logprobs, got.top1, got.logprobs, strict=True):
        for a, b, x, y in zip(r_top, g_top, r_lp, g_lp, strict=True):
            agree += a == b
            y = y if math.isfinite(y) else -1e4
            deltas.append(abs(x - y))
            lp_ref, lp_got = lp_ref + x, lp_got + y
    n = len(deltas)
    deltas.sort()
    ppl_ref, ppl_got = math.exp(-lp_ref / n), math.exp(min(700.0, -lp_got / n))
    return {"positions": n, "agreement": round(agree / n, 5),
            "mean_abs_logprob_delta": round(sum(deltas) / n, 5), "max_abs_logprob_delta": round(deltas[-1], 5),
            "p99_abs_logprob_delta": round(deltas[min(n - 1, int(0.99 * n))], 5),
            "ppl_reference": round(ppl_ref, 4), "ppl_engine": round(ppl_got, 4),
            "ppl_rel_delta": round(abs(ppl_got / ppl_ref - 1.0), 5)}


def make_report(ref: Reference, got: Scored, dtype: str, opts: GateOptions, engine: str,
                seconds: dict[str, float]) -> dict[str, Any]:
    """The stored report: metrics, thresholds, pass/fail with the reasons, what was compared with what."""
    metrics = compare(ref, got)
    limits = thresholds_for(dtype, opts.thresholds)
    failures = limits.failures(metrics)
    return {"gate_version": GATE_VERSION, "passed": not failures, "failures": failures, "dtype": dtype,
            "metrics": metrics, "thresholds": asdict(limits), "engine": engine,
            "reference": ref.meta, "eval_set": {"path": str(EVAL_SET.relative_to(EVAL_SET.parents[2])),
                                                "sha256": eval_set_sha256(), "prompts": len(ref.prompt_ids),
                                                "gen_tokens": opts.gen_tokens},
            "seconds": {k: round(v, 2) for k, v in seconds.items()}}


def skipped_report(reason: str) -> dict[str, Any]:
    """What the registry records for --skip-gate: no numbers, the reason, and passed=False so the ramp rule
    (router_service.rollout) treats the version as ungated unless an operator overrides."""
    return {"gate_version": GATE_VERSION, "passed": False, "skipped": True, "skip_reason": reason,
            "failures": [f"gate skipped: {reason}"]}


def summary(report: dict[str, Any]) -> str:
    """One line for the console and the registry's status_reason."""
    if report.get("skipped"):
        return f"quality gate skipped ({report['skip_reason']})"
    m = report["metrics"]
    verdict = "passed" if report["passed"] else "FAILED: " + "; ".join(report["failures"])
    return (f"quality gate {verdict} (agreement {m['agreement']:.3f}, mean |dlogp| "
            f"{m['mean_abs_logprob_delta']:.4f}, max {m['max_abs_logprob_delta']:.3f}, ppl "
            f"{m['ppl_engine']:.3f} vs {m['ppl_reference']:.3f}, {m['positions']} positions)")


def run_gate(reference: Callable[[], Reference], engine_scores: Callable[[Reference], Scored], dtype: str,
             opts: GateOptions, engine: str) -> dict[str, Any]:
    """Reference run (or its cache), candidate run, report: shared by the cpu and the TensorRT-LLM builds."""
    t = time.perf_counter()
    ref = reference()
    t_ref = time.perf_counter() - t
    t = time.perf_counter()
    got = engine_scores(ref)
    return make_report(ref, got, dtype, opts, engine,
                       {"reference": t_ref, "engine": time.perf_counter() - t})
