"""The router's own settings (FLEET_ROUTER_*), read once at start by `python -m router_service` and
passed into the parts that use them: replica choice, admission, batch yielding, the gateway.

The defaults are the components' own (a Router built in a test without settings behaves the same);
docs/router.md ("Settings") explains each one.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from router_service.batch_yield import DEFAULT_GRACE_S, BatchYield
from router_service.gateway import DEFAULT_BURST, DEFAULT_RATE_PER_S, Gateway
from router_service.replica_choice import ChoiceParams

DEFAULT_MAX_WAITING = 256
_CHOICE = ChoiceParams()


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

    def choice_params(self) -> ChoiceParams:
        return ChoiceParams(load_weight=self.load_weight, epsilon=self.load_epsilon,
                            adapter_miss_tokens=self.adapter_miss_tokens,
                            replica_concurrency=self.replica_concurrency, batch_share=self.batch_share,
                            policy=self.policy)

    def gateway(self) -> Gateway:
        return Gateway(self.rate_limit_rps, self.rate_limit_burst)

    def batch_yielder(self) -> BatchYield:
        return BatchYield(self.batch_yield, self.batch_grace_s)
