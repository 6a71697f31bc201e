"""The router's own settings (FLEET_ROUTER_*), read once at start by `python -m router_service` and
passed into the parts that use them: replica choice, admission, batch yielding, the gateway.

The defaults are the components' own (a Router built in a test without settings behaves the same);
docs/router.md ("Settings") explains each one.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from router_service.batch_yield import DEFAULT_GRACE_S, BatchYield
from router_service.gateway import DEFAULT_BURST, DEFAULT_RATE_PER_S, Gateway
from router_service.replica_choice import ChoiceParams
from router_service.rollout import DEFAULT_GATE_PERCENT
from router_service.replica_probe import Healing, ProbeSettings
from router_service.request import DEFAULT_MAX_TOKENS
from router_service.stream_guard import (DEFAULT_FIRST_TOKEN_S, DEFAULT_INTER_TOKEN_S, DEFAULT_SLOW_READER_S,
                                         DEFAULT_STREAM_DEADLINE_S, DEFAULT_STREAM_QUEUE, StreamTimeouts, per_tier)

DEFAULT_MAX_WAITING = 256
_CHOICE = ChoiceParams()
_HEALING = Healing()


class RouterSettings(BaseSettings):
    """Every field reads FLEET_ROUTER_<FIELD> (upper case)."""
    model_config = SettingsConfigDict(env_prefix="FLEET_ROUTER_", frozen=True, extra="ignore")

    max_waiting: int = Field(DEFAULT_MAX_WAITING, gt=0, description="admission queue bound per model version")
    replica_concurrency: int = Field(_CHOICE.replica_concurrency, gt=0)
    batch_share: float = Field(_CHOICE.batch_share, gt=0, le=1)
    batch_yield: Literal["share", "preempt"] = "share"
    batch_grace_s: float = Field(DEFAULT_GRACE_S, ge=0)
    load_weight: float = Field(_CHOICE.load_weight, ge=0)
    load_epsilon: float = Field(_CHOICE.epsilon, ge=0)
    adapter_miss_tokens: int = Field(_CHOICE.adapter_miss_tokens, ge=0)
    policy: Literal["ours", "round_robin", "least_loaded", "prefix_hash"] = "ours"
    rate_limit_rps: float = Field(DEFAULT_RATE_PER_S, gt=0)
    rate_limit_burst: float = Field(DEFAULT_BURST, gt=0)
    start_wait_s: float = Field(600.0, gt=0, description="a replica row `starting` for longer than this no longer "
                                                        "counts as starting (requests stop waiting for it)")
    first_token_timeout_s: str = Field("", description="per tier, e.g. 'interactive=15,standard=30,batch=60'")
    inter_token_timeout_s: str = Field("", description="per tier, e.g. 'interactive=10,standard=15,batch=30'")
    stream_deadline_s: str = Field("", description="total time from arrival to a stream's end, per tier, e.g. "
                                                   "'interactive=120,standard=300,batch=300'; the longest is also "
                                                   "the router's stop grace (docs/kubernetes.md)")
    stream_queue: int = Field(DEFAULT_STREAM_QUEUE, gt=0, description="gRPC stream responses queued for a reader")
    slow_reader_timeout_s: float = Field(DEFAULT_SLOW_READER_S, gt=0)
    rollout_gate_percent: int = Field(DEFAULT_GATE_PERCENT, ge=0, le=100,
                                      description="a version may take more than this share of its model's traffic "
                                                  "only with a passed quality gate (or an audited operator override)")
    # self-healing (docs/reliability.md): waits on slow and suspect replicas, probes of cordoned ones
    slow_limit_s: float = Field(_HEALING.slow_limit_s, gt=0)
    recover_wait_s: float = Field(_HEALING.recover_wait_s, gt=0)
    probe_first_s: float = Field(_HEALING.probe.first_s, gt=0)
    probe_max_interval_s: float = Field(_HEALING.probe.max_interval_s, gt=0)
    probe_timeout_s: float = Field(_HEALING.probe.timeout_s, gt=0)
    probe_restart_after: int = Field(_HEALING.probe.restart_after, gt=0)
    default_max_tokens: str = Field("", description="max_tokens of a request that sets none: the rest of the "
                                                    "context, at most this per tier, e.g. 'interactive=1024,"
                                                    "standard=2048,batch=4096' or one number")

    @field_validator("first_token_timeout_s", "inter_token_timeout_s", "stream_deadline_s")
    @classmethod
    def _tiers(cls, value: str) -> str:
        per_tier(value, DEFAULT_FIRST_TOKEN_S)  # raises with the problem: the router refuses to start
        return value

    @field_validator("default_max_tokens")
    @classmethod
    def _token_caps(cls, value: str) -> str:
        caps = per_tier(value, {k: float(v) for k, v in DEFAULT_MAX_TOKENS.items()})
        if any(v != int(v) for v in caps.values()):
            raise ValueError(f"{value!r}: token caps must be whole numbers")
        return value

    def max_tokens_caps(self) -> dict[str, int]:
        return {k: int(v) for k, v in per_tier(self.default_max_tokens,
                                               {k: float(v) for k, v in DEFAULT_MAX_TOKENS.items()}).items()}

    def choice_params(self) -> ChoiceParams:
        return ChoiceParams(load_weight=self.load_weight, epsilon=self.load_epsilon,
                            adapter_miss_tokens=self.adapter_miss_tokens,
                            replica_concurrency=self.replica_concurrency, batch_share=self.batch_share,
                            policy=self.policy)

    def gateway(self) -> Gateway:
        return Gateway(self.rate_limit_rps, self.rate_limit_burst)

    def stream_timeouts(self) -> StreamTimeouts:
        return StreamTimeouts(per_tier(self.first_token_timeout_s, DEFAULT_FIRST_TOKEN_S),
                              per_tier(self.inter_token_timeout_s, DEFAULT_INTER_TOKEN_S),
                              self.stream_queue, self.slow_reader_timeout_s,
                              per_tier(self.stream_deadline_s, DEFAULT_STREAM_DEADLINE_S))

    def healing(self) -> Healing:
        return Healing(self.slow_limit_s, self.recover_wait_s,
                       ProbeSettings(self.probe_first_s, self.probe_max_interval_s, self.probe_timeout_s,
                                     self.probe_restart_after))

    def batch_yielder(self) -> BatchYield:
        return BatchYield(self.batch_yield, self.batch_grace_s)
