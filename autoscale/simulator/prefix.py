"""Prefix reuse: the share of prompt tokens a replica serves from its KV cache, per model and tier.

Workload (assumptions.json "prefix"): each request belongs to one of `products` products (Zipf
popularity) whose fixed system prompt it sends first; a share of requests are follow-up turns of a chat
session that resend the history (earlier turns and answers) before the new message; the rest of the
prompt is new text. Mean prompt length stays the workload's (2,000 tokens):
    prompt = system prompt + follow-up share x history + new text.

Which of those tokens hit the cache is decided by the routing and by how long a prefix stays in a
replica's cache (Che's approximation of LRU): a replica's cache is its KV capacity minus the KV of the
sequences it is decoding, and it churns at the rate new tokens enter it (uncached prompt + output), so a
prefix stays `T = cache tokens / insertion tokens/s` seconds after its last use.
- system prompt of product j: hit if it was used on this replica within T: 1 - exp(-r_j T), r_j = the
  rate of product j's requests per replica that can receive them. Prefix-aware routing sends a product
  to the fewest replicas its load needs (consistent hashing with bounded load); round-robin spreads it
  over the whole pool.
- session history: hit if the follow-up lands on the replica of the previous turn (prefix-aware: unless
  bounded load spills it, `spill_share`; round-robin: 1 / replicas) and arrives within T of it
  (exponential think time: 1 - exp(-T / gap)).
Batch prompts are unique documents: their reuse is `batch_reuse` (0 by default).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autoscale.capacity import ModelProfile

TIERS = ("interactive", "standard")


@dataclass(frozen=True)
class PrefixWorkload:
    """The prompt composition and session behaviour (assumptions.json "prefix")."""

    products: int = 200
    product_zipf: float = 1.0
    system_prompt_tokens: float = 700.0
    followup_share: dict | None = None  # per tier: share of requests that are follow-up turns
    history_tokens: float = 1000.0  # mean history a follow-up resends (earlier turns + answers)
    think_time_s: float = 45.0  # mean gap between a turn's answer and the next turn
    routing: str = "prefix-aware"  # prefix-aware | round-robin
    spill_share: float = 0.05  # follow-ups the bounded-load router sends elsewhere
    batch_reuse: float = 0.0
    override: float | None = None  # fixed reuse for interactive + standard (the sensitivity sweep)

    @classmethod
    def from_dict(cls, raw: dict | None) -> "PrefixWorkload":
        raw = dict(raw or {})
        raw.pop("_doc", None)
        return cls(**raw)

    def followups(self, tier: str) -> float:
        return float((self.followup_share or {"interactive": 0.4, "standard": 0.4}).get(tier, 0.0))

    def cacheable_share(self, tier: str, prompt_mean: float) -> float:
        """Share of a tier's prompt tokens that repeat an earlier prefix (the upper bound of reuse)."""
        return min((self.system_prompt_tokens + self.followups(tier) * self.history_tokens) / prompt_mean, 1.0)


@dataclass(frozen=True)
class Reuse:
    """Share of prompt tokens served from cache per tier, and what decided it."""

    interactive: float
    standard: float
    batch: float
    cache_residency_s: float
    system_prompt_hit: float
    history_hit: float

    def by_tier(self) -> dict[str, float]:
        return {"interactive": self.interactive, "standard": self.standard, "batch": self.batch}


def product_shares(pw: PrefixWorkload) -> np.ndarray:
    ranks = np.arange(1, pw.products + 1, dtype=float)
    weights = ranks ** -pw.product_zipf
    return weights / weights.sum()


def reuse_for_pool(pw: PrefixWorkload, model: ModelProfile, prompt_mean: float, output_mean: float,
                   tier_shares: dict[str, float], pool_requests_per_s: float, replicas: float,
                   running_streams_per_replica: float, cache_tokens: float | None = None) -> Reuse:
    """Reuse per tier for a pool serving `pool_requests_per_s` on `replicas` replicas (the design point).

    `cache_tokens` overrides the cache size (a disaggregated prefill replica decodes nothing, so its
    whole KV capacity caches prefixes)."""
    if pw.override is not None:
        return Reuse(pw.override, pw.override, pw.batch_reuse, math.nan, math.nan, math.nan)
    replicas = max(replicas, 1.0)
    lam_rep = pool_requests_per_s / replicas
    if cache_tokens is None:
        running_kv = running_streams_per_replica * (prompt_mean + output_mean / 2)
        cache_tokens = max(model.kv_capacity_tokens - running_kv, 0.0)
    shares = product_shares(pw)
    lam_j = pool_requests_per_s * shares
    if pw.routing == "prefix-aware":  # each product on the fewest replicas that carry its load
        per_rep = lam_j / np.maximum(np.ceil(lam_j / max(lam_rep, 1e-9)), 1.0)
        same_replica = 1.0 - pw.spill_share
    else:
        per_rep = lam_j / replicas
        same_replica = 1.0 / replicas
    fshare = sum(tier_shares[t] * pw.followups(t) for t in TIERS) / max(sum(tier_shares.values()), 1e-9)
    reuse = 0.0
    for _ in range(20):  # fixed point: hits lower the insertion rate, which lengthens the residency
        uncached = prompt_mean * (1.0 - reuse)
        insert = lam_rep * (uncached + output_mean)
        residency = cache_tokens / max(insert, 1e-9)
        sys_hit = float((shares * (1.0 - np.exp(-per_rep * residency))).sum())
        hist_hit = same_replica * (1.0 - math.exp(-residency / pw.think_time_s))
        new = (pw.system_prompt_tokens * sys_hit + fshare * pw.history_tokens * hist_hit) / prompt_mean
        if abs(new - reuse) < 1e-6:
            break
        reuse = new
    per_tier = {t: min((pw.system_prompt_tokens * sys_hit + pw.followups(t) * pw.history_tokens * hist_hit)
                       / prompt_mean, 0.95) for t in TIERS}
    return Reuse(per_tier["interactive"], per_tier["standard"], pw.batch_reuse, residency, sys_hit, hist_hit)
