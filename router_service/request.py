"""What a caller asks for, what the router streams back (independent of the wire protocol), and the
request as the router holds it once admitted (`Prepared`)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from common.hashing import prefix_block_hashes
from router_service.cancellation import CancelHandle
from router_service.errors import invalid
from router_service.registry_cache import CallerInfo, ModelInfo
from router_service.replica_choice import Placement

TIERS = ("interactive", "standard", "batch")
TIER_INDEX = {name: i for i, name in enumerate(TIERS)}
MAX_STOP_WORDS = 16
MAX_PROMPT_BYTES = 1_000_000


@dataclass
class GenerateRequest:
    request_id: str
    model: str
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    chat_messages: list[dict] | None = None
    version: str | None = None
    adapter: str = ""
    tier: str = "standard"
    deadline_ms: int | None = None  # absolute, unix epoch milliseconds
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    session: str = ""  # rollout stickiness key; the caller name when empty

    def validate(self, max_context: int) -> None:
        """Field checks that need no registry; the message names the field, the reason and what is allowed."""
        if self.tier not in TIERS:
            raise invalid("priority", f"{self.tier!r} is not a tier; allowed: {', '.join(TIERS)}")
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise invalid("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if self.max_tokens > max_context:
            raise invalid("max_tokens", f"{self.max_tokens} exceeds the model's context of {max_context} tokens")
        if not math.isfinite(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise invalid("temperature", f"must be between 0 and 2, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise invalid("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise invalid("top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise invalid("seed", f"must be in [0, 2^64), got {self.seed}")
        if len(self.stop) > MAX_STOP_WORDS or any(not s for s in self.stop):
            raise invalid("stop", f"at most {MAX_STOP_WORDS} non-empty strings")
        if self.prompt_text is not None and len(self.prompt_text.encode("utf-8", "surrogatepass")) > MAX_PROMPT_BYTES:
            raise invalid("prompt", f"is larger than {MAX_PROMPT_BYTES} bytes")

    def check_prompt_fits(self, max_context: int) -> None:
        n = len(self.prompt_ids or [])
        if n == 0:
            raise invalid("prompt", "is empty")
        if n + self.max_tokens > max_context:
            raise invalid("prompt", f"has {n} tokens; with max_tokens={self.max_tokens} that is {n + self.max_tokens}, "
                                    f"over the model's context of {max_context} tokens")


@dataclass
class TokenDelta:
    text: str
    token_ids: list[int]


@dataclass
class Finished:
    finish_reason: str
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    model: str
    version: str
    replica_id: str


@dataclass
class Prepared:
    """An admitted request: the caller, the resolved model version, the prompt ids and its reserved slot."""
    req: GenerateRequest
    caller: CallerInfo
    model: ModelInfo
    prompt_ids: list[int]
    arrived: float = field(default_factory=time.monotonic)
    home: str = "local"
    quota_reserved: int = 0
    placement: Placement | None = None
    handle: CancelHandle | None = None
    started: bool = False
    _hashes: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    def hashes(self, ids: list[int], block_size: int) -> list[int]:
        key = (len(ids), block_size)
        if key not in self._hashes:
            self._hashes[key] = prefix_block_hashes(ids, block_size, self.req.adapter)   # the engine's rule
        return self._hashes[key]
