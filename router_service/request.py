"""What a caller asks for, what the router streams back (independent of the wire protocol), and the
request as the router holds it once admitted (`Prepared`)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from common.hashing import prefix_block_hashes
from common.sampling_fields import check_params
from router_service.cancellation import CancelHandle
from router_service.errors import invalid
from router_service.registry_cache import CallerInfo, ModelInfo
from router_service.replica_choice import Placement

TIERS = ("interactive", "standard", "batch")
TIER_INDEX = {name: i for i, name in enumerate(TIERS)}
MAX_STOP_WORDS = 16
MAX_STOP_CHARS = 256        # each stop string: the engine matches every stop against every new token
MAX_STOP_TOTAL_CHARS = 1024
MAX_PROMPT_BYTES = 1_000_000
MAX_CHAT_MESSAGES = 512
MAX_SESSION_CHARS = 256
MAX_N = 8                   # choices per request (`n`): each is a sequence of its own on one replica
# max_tokens when a request sets none: the rest of the context, at most this many per tier (router setting
# FLEET_ROUTER_DEFAULT_MAX_TOKENS overrides it)
DEFAULT_MAX_TOKENS = {"interactive": 1024, "standard": 2048, "batch": 4096}


@dataclass
class GenerateRequest:
    request_id: str  # assigned by the router, unique: the usage de-duplication key, never the caller's
    model: str
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    chat_messages: list[dict] | None = None
    version: str | None = None
    adapter: str = ""
    tier: str = "standard"
    deadline_ms: int | None = None  # absolute, unix epoch milliseconds
    max_tokens: int | None = None  # None: the rest of the context, capped per tier (resolve_max_tokens)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # keep generating past end-of-sequence up to max_tokens (load tests, benchmarks)
    session: str = ""  # rollout stickiness key; the caller name when empty
    client_id: str = ""  # the caller's own request id, echoed back for correlation only (common.names.CLIENT_ID_RE)
    trace_context: dict[str, str] = field(default_factory=dict)  # W3C fields of the current upstream attempt
    # OpenAI sampling fields carried to the engine (bounds: common.sampling_fields; SAMPLING_DEFAULTS = off)
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    guided: dict | None = None  # structured output: {"type": json_object | json_schema | regex, ...}
    tools: list[dict] | None = None  # OpenAI tool definitions, rendered into the chat prompt (router_service/tools.py)
    bill_prompt: bool = True  # False for choices 2..n of an `n` request: its prompt is billed once (OpenAI's rule)

    def sampling_fields(self) -> dict:
        """The sampling fields that differ from their defaults (sent to the engine as one parameter)."""
        return {k: getattr(self, k) for k, default in SAMPLING_DEFAULTS.items() if getattr(self, k) != default}

    def check_sampling(self, vocab_size: int) -> None:
        problem = check_params(self, vocab_size)
        if problem:
            name, why = problem.split(": ", 1)
            raise invalid(name, why)

    def validate(self, max_context: int) -> None:
        """Field checks that need no registry; the message names the field, the reason and what is allowed."""
        if self.tier not in TIERS:
            raise invalid("priority", f"{self.tier!r} is not a tier; allowed: {', '.join(TIERS)}")
        if self.max_tokens is not None:
            if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
                raise invalid("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
            if self.max_tokens > max_context:
                raise invalid("max_tokens", f"{self.max_tokens} exceeds the model's context of {max_context} tokens",
                              "context_length_exceeded")
        if not math.isfinite(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise invalid("temperature", f"must be between 0 and 2, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise invalid("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k < 2**31:
            raise invalid("top_k", f"must be in [0, 2^31) (0 = off), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise invalid("seed", f"must be in [0, 2^64), got {self.seed}")
        if len(self.stop) > MAX_STOP_WORDS or any(not s for s in self.stop):
            raise invalid("stop", f"at most {MAX_STOP_WORDS} non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop) or sum(map(len, self.stop)) > MAX_STOP_TOTAL_CHARS:
            raise invalid("stop", f"each stop string may have at most {MAX_STOP_CHARS} characters and all of them "
                                  f"together {MAX_STOP_TOTAL_CHARS}")
        if self.chat_messages is not None and len(self.chat_messages) > MAX_CHAT_MESSAGES:
            raise invalid("messages", f"{len(self.chat_messages)} messages; at most {MAX_CHAT_MESSAGES}")
        if len(self.session) > MAX_SESSION_CHARS:
            raise invalid("session", f"at most {MAX_SESSION_CHARS} characters")
        if self.prompt_ids is not None and len(self.prompt_ids) > max_context:
            raise invalid("prompt", f"has {len(self.prompt_ids)} token ids; the model's context is {max_context}")
        if self.prompt_text is not None and len(self.prompt_text.encode("utf-8", "surrogatepass")) > MAX_PROMPT_BYTES:
            raise invalid("prompt", f"is larger than {MAX_PROMPT_BYTES} bytes")

    def check_prompt_size(self, max_context: int, vocab_size: int, max_token_chars: int) -> None:
        """Checks before tokenising: a text prompt longer than the context could ever hold (each token stands
        for at most `max_token_chars` characters) is refused unread; token ids must exist in the vocabulary."""
        if self.prompt_ids is not None:
            bad = next((t for t in self.prompt_ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise invalid("prompt", f"token id {bad} is out of range; allowed: 0..{vocab_size - 1}")
            return
        texts = [m["content"] for m in self.chat_messages] if self.chat_messages is not None else [self.prompt_text or ""]
        chars = sum(map(len, texts))
        if chars > max_context * max_token_chars:
            raise invalid("prompt", f"has {chars} characters, more than the model's context of {max_context} tokens "
                                    f"can hold")

    def check_prompt_fits(self, max_context: int, default_cap: int | None = None) -> None:
        """The prompt and max_tokens fit the context; an absent max_tokens becomes the rest of the context,
        at most `default_cap` (the tier's setting), as OpenAI's API does."""
        n = len(self.prompt_ids or [])
        if n == 0:
            raise invalid("prompt", "is empty")
        if n >= max_context:
            raise invalid("messages" if self.chat_messages is not None else "prompt",
                          f"has {n} tokens; that leaves no room for output in the model's context of {max_context} tokens",
                          "context_length_exceeded")
        if self.max_tokens is None:
            cap = DEFAULT_MAX_TOKENS[self.tier] if default_cap is None else default_cap
            self.max_tokens = max(1, min(cap, max_context - n))
        if n + self.max_tokens > max_context:
            raise invalid("max_tokens", f"the prompt has {n} tokens; with max_tokens={self.max_tokens} that is "
                                        f"{n + self.max_tokens}, over the model's context of {max_context} tokens",
                          "context_length_exceeded")


SAMPLING_DEFAULTS = {"logprobs": False, "top_logprobs": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                     "repetition_penalty": 1.0, "logit_bias": {}, "min_p": 0.0, "min_tokens": 0, "stop_token_ids": [],
                     "guided": None}


@dataclass
class TokenDelta:
    text: str
    token_ids: list[int]
    # per id, when asked: (logprob, [(id, logprob) x top_logprobs])
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


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
    budget_warning: str | None = None  # the team passed its budget's soft share (router_service/budgets.py)
    placement: Placement | None = None
    handle: CancelHandle | None = None
    started: bool = False
    _hashes: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    def hashes(self, ids: list[int], block_size: int) -> list[int]:
        key = (len(ids), block_size)
        if key not in self._hashes:
            self._hashes[key] = prefix_block_hashes(ids, block_size, self.req.adapter)   # the engine's rule
        return self._hashes[key]
