"""A request's life inside the engine: its sampling parameters, tokens, KV blocks and status.

A sequence's token list is prompt + generated tokens; `num_computed` counts tokens whose K/V sit in the pool.
Preemption by recompute just frees the blocks and resets `num_computed` to 0: the generated tokens stay, so
the resumed sequence re-prefills prompt + output and continues exactly where it stopped (same ids, since
sampling state - the per-request generator - is kept on the sequence).
"""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch


class Priority(enum.IntEnum):
    INTERACTIVE = 0
    STANDARD = 1
    BATCH = 2


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    ERROR = "error"


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0     # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0               # 0 = off
    seed: int | None = None
    # Output tokens a previous replica already generated for this request (the router resumes a broken
    # stream with prompt + those tokens): sampling step k of this sequence uses the random stream of step
    # seed_offset + k, so a seeded stream resumed elsewhere continues where it stopped.
    seed_offset: int = 0
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # OpenAI's sampling fields (bounds: common.sampling_fields.check_params)
    logprobs: bool = False           # the sampled token's log probability with each released token
    top_logprobs: int = 0            # and the k most likely tokens of the distribution it was drawn from
    presence_penalty: float = 0.0    # OpenAI: logit - presence * (count > 0) - frequency * count (output tokens)
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # transformers' rule over prompt + output: logit / r if > 0 else logit * r
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_p: float = 0.0               # drop tokens below min_p x the most likely token's probability
    min_tokens: int = 0              # EOS and stop_token_ids are masked until this many tokens were generated
    stop_token_ids: list[int] = field(default_factory=list)
    guided: dict | None = None       # structured output spec (python_backends.engine.guided)
    grammar: object | None = None    # its compiled grammar (compiled off the loop by the Triton shim)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def shapes_logits(self) -> bool:
        """Whether this request changes the logits before sampling (penalties, bias, min_tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0


_ids = itertools.count(1)


class Sequence:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, priority: int = Priority.STANDARD,
                 deadline_ms: int = 0, lora_name: str = "", request_id: object = None):
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.num_prompt = len(self.prompt_ids)          # the prompt never changes: read on every step
        self.token_ids = list(prompt_ids)
        self.params = params
        self.priority = int(priority)
        self.deadline_ms = int(deadline_ms or 0)
        self.lora_name = lora_name or ""
        self.lora_slot = -1
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.num_computed = 0            # tokens with K/V in the pool
        self.num_cached_prompt = 0       # prompt tokens served from the prefix cache (first admission)
        self.counted_cache = False
        self.block_hashes: list[int] = []   # chain hashes of full blocks (extended as they fill)
        self.num_hashed_blocks = 0       # leading blocks of block_table registered in the prefix cache
        self.finish_reason: FinishReason | None = None
        self.error = ""                  # why the request was rejected (finish_reason error)
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.admitted_at: float | None = None
        self.preemptions = 0
        self.num_emitted = 0             # output tokens already handed to the caller
        self.generator: torch.Generator | None = None   # seeded requests: made on the device by sampling.py
        # per output token, when params.wants_logprobs: (logprob, [(token id, logprob) x top_logprobs])
        self.token_logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        self.guide = None                # guided.Guide of a structured-output request

    # ------------------------------------------------------------------ views
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def in_prefill(self) -> bool:
        """True while tokens other than the last sampled one still lack K/V."""
        return self.num_computed < self.num_tokens - 1 or self.num_computed == 0

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    def sort_key(self) -> tuple:
        """Admission order: priority, then deadline (none = last), then arrival."""
        return (self.priority, self.deadline_ms or float("inf"), self.arrival, self.seq_id)

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, prio={self.priority}, prompt={self.num_prompt}, out={self.num_output}, "
                f"computed={self.num_computed}, blocks={len(self.block_table)}, {self.status.value})")
