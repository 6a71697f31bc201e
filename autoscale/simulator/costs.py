"""What one request costs each scaled unit: replica-seconds per request per tier, after prefix reuse.

A unit is what a policy scales: one (region, model) pool when prefill and decode share replicas
(`colocated`), or two pools (`prefill`, `decode`) when they are disaggregated. Costs come from the
capacity model (autoscale/capacity.py) at the workload's mean request, with the prefix reuse the
workload model gives at the pool's peak-hour design point (autoscale/simulator/prefix.py); reuse and
capacity depend on each other (hits shorten prefill; busier replicas keep less cache), so both are
iterated to a fixed point. Computed once per run: costs do not depend on the policy.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from autoscale.capacity import Capacity, ModelProfile
from autoscale.simulator.prefix import PrefixWorkload, Reuse, reuse_for_pool

ROLES = {"colocated": ("colocated",), "disaggregated": ("prefill", "decode")}


@dataclass(frozen=True)
class UnitCost:
    """Per-request costs of one unit (replica-seconds), and the numbers behind them."""

    role: str  # colocated | prefill | decode
    w_fg: float  # interactive + standard request (mixture of the two tiers' reuse)
    w_batch: float
    prefill_s: float  # prefill replica-seconds of an interactive/standard request (TTFT service time)
    prefill_effective_tokens_per_s: float  # prompt tokens / prefill_s: folds reuse into the queue model
    decode_effective_tokens_per_s: float  # output tokens / decode replica-seconds
    token_share: float  # share of a request's tokens this unit is credited with (prompt, output or both)
    stream_tokens_per_s: float
    bound: str
    reuse: dict
    kv_transfer_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def _tier_mix(interactive_share: float) -> dict[str, float]:
    return {"interactive": interactive_share, "standard": 1.0 - interactive_share}


def unit_costs(model: ModelProfile, pw: PrefixWorkload, architecture: str, prompt_mean: float, output_mean: float,
               interactive_share: float, peak_requests_per_s: float, target_utilisation: float,
               stream_target: float) -> list[UnitCost]:
    """Costs of the units one (region, model) pool becomes under `architecture` (colocated | disaggregated)."""
    mix = _tier_mix(interactive_share)
    ctx = prompt_mean + output_mean / 2.0
    if architecture == "colocated":
        reuse = Reuse(0.0, 0.0, pw.batch_reuse, 0.0, 0.0, 0.0)
        for _ in range(8):
            fg = mix["interactive"] * reuse.interactive + mix["standard"] * reuse.standard
            cap = model.capacity(prompt_mean * (1 - fg), ctx, output_mean, stream_target)
            busy = cap.requests_per_s * target_utilisation
            reuse = reuse_for_pool(pw, model, prompt_mean, output_mean, mix, peak_requests_per_s,
                                   peak_requests_per_s / busy, busy * output_mean / cap.stream_tokens_per_s)
        return [_colocated(model, reuse, mix, prompt_mean, output_mean, ctx, stream_target)]
    if architecture != "disaggregated":
        raise ValueError(f"unknown architecture {architecture!r}: colocated or disaggregated")
    reuse = Reuse(0.0, 0.0, pw.batch_reuse, 0.0, 0.0, 0.0)
    for _ in range(8):  # prefill replicas cache prefixes in their whole KV capacity: they decode nothing
        fg = mix["interactive"] * reuse.interactive + mix["standard"] * reuse.standard
        cap = model.capacity(prompt_mean * (1 - fg), ctx, output_mean, stream_target, role="prefill")
        busy = cap.requests_per_s * target_utilisation
        reuse = reuse_for_pool(pw, model, prompt_mean, output_mean, mix, peak_requests_per_s,
                               peak_requests_per_s / busy, 0.0, cache_tokens=model.kv_capacity_tokens)
    fg = mix["interactive"] * reuse.interactive + mix["standard"] * reuse.standard
    pre = model.capacity(prompt_mean * (1 - fg), ctx, output_mean, stream_target, role="prefill")
    pre_b = model.capacity(prompt_mean * (1 - reuse.batch), ctx, output_mean, stream_target, role="prefill")
    dec = model.capacity(0.0, ctx, output_mean, stream_target, role="decode")
    transfer = model.kv_transfer_s(ctx)
    return [
        UnitCost("prefill", pre.replica_seconds, pre_b.replica_seconds, pre.prefill_s,
                 prompt_mean / max(pre.prefill_s, 1e-12), float("inf"),
                 prompt_mean / (prompt_mean + output_mean), stream_target, pre.bound, reuse.by_tier() | _why(reuse)),
        UnitCost("decode", dec.replica_seconds, dec.replica_seconds, 0.0, float("inf"),
                 output_mean / dec.replica_seconds, output_mean / (prompt_mean + output_mean),
                 dec.stream_tokens_per_s, dec.bound, {}, transfer),
    ]


def _why(reuse: Reuse) -> dict:
    return {"cache_residency_s": reuse.cache_residency_s, "system_prompt_hit": reuse.system_prompt_hit,
            "history_hit": reuse.history_hit}


def _colocated(model: ModelProfile, reuse: Reuse, mix: dict, prompt_mean: float, output_mean: float, ctx: float,
               stream_target: float) -> UnitCost:
    caps: dict[str, Capacity] = {t: model.capacity(prompt_mean * (1 - r), ctx, output_mean, stream_target)
                                 for t, r in reuse.by_tier().items()}
    w_fg = sum(mix[t] * caps[t].replica_seconds for t in mix)
    prefill_s = sum(mix[t] * caps[t].prefill_s for t in mix)
    cap = caps["interactive"]
    return UnitCost("colocated", w_fg, caps["batch"].replica_seconds, prefill_s, prompt_mean / max(prefill_s, 1e-12),
                    output_mean / max(w_fg - prefill_s, 1e-12), 1.0, cap.stream_tokens_per_s, cap.bound,
                    reuse.by_tier() | _why(reuse))
