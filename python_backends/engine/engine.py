"""LLMEngine: add_request / abort / step over the scheduler, the KV cache manager and the model runner.

One `step()` = schedule (decodes + prefill chunks), one batched forward, sampling for every sequence whose
chunk reached its last token, stop checks, and the outputs of that iteration (delta token ids, and on the last
one the finish reason and usage). Finished sequences leave at once and free their blocks, so queued ones can
join in the very next iteration. Not thread-safe: one thread (EngineLoop) drives it.

Async decode (`async_decode=1`; off by default, see docs/engine.md): a step's sampled ids stay on the device and the step is
left in flight; the next `step()` launches the following decode step first - its input ids gathered on the
device from the in-flight ids, its metadata built on the host while the device still runs - and only then
waits for the in-flight ids and returns their outputs. So schedule/prepare/output handling overlap the
device instead of adding to each step. That lookahead runs only when it needs no scheduling decision (every
running sequence is decoding, nothing waits, the pool has the blocks); otherwise the in-flight step is
resolved first and the scheduler runs as usual. A sequence that turns out to have finished (EOS, a stop
string, an abort) has one wasted row in the step launched after it; its result is dropped. Sequences that
finish by length are known in advance and left out.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from python_backends.engine.config import EngineConfig
from python_backends.engine.device import CpuThreads, resolve_device
from python_backends.engine.kv_cache_manager import KVCacheManager
from python_backends.engine.lora import FUSED, LoraManager
from python_backends.engine.metrics import EngineStats
from python_backends.engine.batch import SeqChunk
from python_backends.engine.model_runner import ModelRunner, precision, read_model_config
from common.sampling_fields import check_params
from python_backends.engine.guided import GrammarCache, Guide, apply_masks
from python_backends.engine.logits import shape_logits
from python_backends.engine.sampling import StepLogprobs, sample_with_logprobs
from python_backends.engine.scheduler import Scheduler
from python_backends.engine.sequence import FinishReason, SamplingParams, Sequence, Status
from python_backends.engine.stops import StopChecker


@dataclass
class StepOutput:
    seq: Sequence
    token_ids: list[int]              # newly released output ids (often one, may be none)
    finish_reason: str = ""           # "" until the final output
    # per released id, when the request asked: (logprob, [(id, logprob) x top_logprobs])
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)

    @property
    def usage(self) -> tuple[int, int, int]:
        return (self.seq.num_prompt, self.seq.num_cached_prompt, self.seq.num_emitted)


@dataclass
class _Inflight:
    """A launched step whose sampled ids have not been read on the host yet."""
    seqs: list[Sequence]              # sampled sequences, in the row order of ids
    ids: torch.Tensor                 # their sampled ids, on the device
    host: torch.Tensor                # pinned host copy being filled (CUDA), else ids itself
    event: torch.cuda.Event | None    # recorded after the copy: waiting on it does not wait for later steps
    prefill_tokens: int
    lookahead: bool                   # launched ahead: its sequences' new full blocks are indexed on resolve
    logprobs: StepLogprobs | None = None   # rows that asked for logprobs (still on the device)


class LLMEngine:
    def __init__(self, config: EngineConfig, state_dict: dict[str, torch.Tensor] | None = None):
        """state_dict: weights to use instead of weights_dir/model.safetensors (benchmarks on random weights;
        weights_dir then needs only config.json)."""
        self.config = config
        self.device = resolve_device(config.device)
        self.cpu_threads = CpuThreads(config.threads, config.small_step_threads, config.small_step_max_rows) \
            if self.device.type == "cpu" else None
        weights = Path(config.weights_dir)
        tok = weights / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(tok)) if tok.exists() else None   # needed for stop strings only
        mcfg = read_model_config(weights)
        hidden, inter = mcfg["hidden_size"], mcfg["intermediate_size"]
        hd = mcfg.get("head_dim") or hidden // mcfg["num_attention_heads"]
        q_out, kv_out = mcfg["num_attention_heads"] * hd, mcfg["num_key_value_heads"] * hd
        dims = {"qkv": (hidden, [q_out, kv_out, kv_out]), "o": (q_out, [hidden]),
                "gate_up": (hidden, [inter, inter]), "down": (inter, [hidden])}
        assert set(dims) == set(FUSED)
        self.lora = LoraManager(config.adapters_dir, mcfg["num_hidden_layers"], dims,
                                precision(config.dtype, config.cpu_matmul, self.device)[1],
                                config.max_loras, config.max_lora_rank, self.device) if config.adapters_dir else None
        self.runner = ModelRunner(weights, config.dtype, config.num_kv_blocks, config.block_size,
                                  config.max_context, self.lora, config.cpu_matmul, self.device,
                                  state_dict, config.kv_memory_fraction, config.cpu_decode_attention,
                                  config.cpu_kernels, config.cpu_bf16_gemm, config.max_num_seqs)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size)
        if self.device.type == "cuda" and config.cuda_graphs and self.runner.paged:
            self.runner.capture_graphs(config.max_num_seqs)
        self.scheduler = Scheduler(config, self.kv, self._acquire_lora, self._release_lora)
        self.stats = EngineStats()
        self.stop_checkers: dict[int, StopChecker] = {}
        self._pending: list[StepOutput] = []     # outputs decided outside step() (rejections, aborts)
        self.async_decode = config.async_decode == 1
        self._inflight: _Inflight | None = None
        self.lookahead_steps = 0
        self.steps = 0
        self.last_scheduled = 0
        self._grammars: GrammarCache | None = None
        self._grammars_lock = threading.Lock()

    def grammars(self) -> GrammarCache:
        """The model's grammar compiler and cache (made on first use; any thread)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCache(self.config.weights_dir, self.runner.vocab)
            return self._grammars

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None, priority: int = 1,
                    deadline_ms: int = 0, lora_name: str = "", request_id: object = None) -> Sequence:
        params = params or SamplingParams(max_tokens=self.config.default_max_tokens)
        seq = Sequence(prompt_ids, params, priority, deadline_ms, lora_name, request_id)
        error = self._validate(seq)
        if error:
            return self._reject(seq, error)
        if params.guided is not None:
            try:
                grammar = params.grammar if params.grammar is not None else self.grammars().compile(params.guided)
                # a resumed stream: its last seed_offset prompt ids are output already emitted elsewhere
                seq.guide = Guide(grammar, seq.prompt_ids[seq.num_prompt - params.seed_offset:]
                                  if params.seed_offset else [])
            except ValueError as exc:
                return self._reject(seq, str(exc))
        # never generate past the context window
        params.max_tokens = max(0, min(params.max_tokens, self.config.max_context - seq.num_prompt))
        if params.stop:
            self.stop_checkers[seq.seq_id] = StopChecker(self.tokenizer, params.stop)
        self.scheduler.add(seq)
        return seq

    def _reject(self, seq: Sequence, error: str) -> Sequence:
        seq.status = Status.FINISHED
        seq.finish_reason = FinishReason.ERROR
        seq.error = error
        self._pending.append(StepOutput(seq, [], FinishReason.ERROR.value))
        return seq

    def _validate(self, seq: Sequence) -> str:
        if seq.num_prompt == 0:
            return "empty prompt"
        if seq.num_prompt >= self.config.max_context:
            return f"prompt of {seq.num_prompt} tokens does not fit max_context {self.config.max_context}"
        if any(t < 0 or t >= self.runner.vocab for t in seq.prompt_ids):
            return "token id out of range"
        if self.kv.blocks_for(seq.num_prompt + 1) > self.kv.pool.num_usable:
            return "prompt does not fit the KV pool"
        if seq.lora_name and (self.lora is None or not self.lora.available(seq.lora_name)):
            return f"unknown adapter {seq.lora_name!r}"
        if seq.params.stop and self.tokenizer is None:
            return "stop strings need the model's tokenizer.json"
        return check_params(seq.params, self.runner.vocab)

    def abort(self, seq: Sequence, reason: FinishReason = FinishReason.CANCELLED) -> None:
        """Stop a sequence now and free its blocks (cancellation, deadline)."""
        if seq.finished:
            return
        self._finish(seq, reason)
        self._pending.append(StepOutput(seq, [], reason.value))

    def take_pending(self) -> list[StepOutput]:
        outputs, self._pending = self._pending, []
        return outputs

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending) or self._inflight is not None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        self.stop_checkers.pop(seq.seq_id, None)

    def _acquire_lora(self, seq: Sequence) -> bool:
        if not seq.lora_name:
            return True
        slot = self.lora.acquire(seq.lora_name)
        if slot is None:
            return False
        seq.lora_slot = slot
        return True

    def _release_lora(self, seq: Sequence) -> None:
        if seq.lora_name and seq.lora_slot >= 0:
            self.lora.release(seq.lora_name)
            seq.lora_slot = -1

    # ------------------------------------------------------------------ one iteration
    def step(self) -> list[StepOutput]:
        try:
            return self._step()
        except BaseException:
            self._inflight = None        # its ids may never arrive; the loop fails the sequences
            raise

    def _step(self) -> list[StepOutput]:
        outputs, self._pending = self._pending, []
        now_ms = time.time() * 1000.0
        for seq in [s for s in self.scheduler.running + self.scheduler.waiting if s.deadline_ms and now_ms > s.deadline_ms]:
            self._finish(seq, FinishReason.DEADLINE)
            outputs.append(StepOutput(seq, [], FinishReason.DEADLINE.value))
        if self._inflight is not None:
            prev, self._inflight = self._inflight, None
            nxt = self._lookahead(prev)
            if nxt:
                self._inflight = self._launch_lookahead(nxt, prev)
                return outputs + self._resolve(prev)
            outputs += self._resolve(prev)
        scheduled = self.scheduler.schedule()
        self.last_scheduled = len(scheduled)
        if not scheduled:
            return outputs
        now = time.monotonic()
        chunks, sampled = [], []
        prefill_tokens = 0
        for item in scheduled:
            seq = item.seq
            if seq.admitted_at is None:
                seq.admitted_at = now
                self.stats.on_admit(now - seq.arrival)
            start = seq.num_computed
            end = start + item.num_tokens
            need_logits = end == seq.num_tokens
            chunks.append(SeqChunk(seq.token_ids[start:end], start, seq.block_table, need_logits, seq.lora_slot))
            if need_logits:
                sampled.append(seq)
            if not item.is_decode:
                prefill_tokens += item.num_tokens
        if self.cpu_threads is not None:
            self.cpu_threads.for_rows(sum(len(c.token_ids) for c in chunks))
        logits = self.runner.forward(self.runner.prepare(chunks))
        for item in scheduled:
            item.seq.num_computed += item.num_tokens
            self.kv.commit(item.seq)
        if not sampled:
            self.stats.on_step(0, prefill_tokens)
            self.steps += 1
            return outputs
        flight = self._launch_sampling(logits, sampled, prefill_tokens, lookahead=False)
        if self.async_decode:
            self._inflight = flight
            return outputs
        return outputs + self._resolve(flight)

    # ------------------------------------------------------------------ async decode
    def _lookahead(self, prev: _Inflight) -> list[Sequence]:
        """The sequences of the next decode step when it can be launched before prev's ids are known: every
        running sequence was sampled in prev, nothing waits, and the pool has every block needed (so no
        preemption). Sequences that finish by length once prev resolves are left out. [] = resolve first."""
        sched = self.scheduler
        if not self.async_decode or sched.waiting or len(prev.seqs) != len(sched.running):
            return []
        if any(s.params.shapes_logits or s.guide is not None for s in prev.seqs):   # need the in-flight token
            return []
        nxt: list[Sequence] = []
        new_blocks = 0
        for seq in prev.seqs:
            if seq.status is not Status.RUNNING or seq.num_computed != seq.num_tokens:
                return []
            if seq.num_output + 1 >= seq.params.max_tokens or seq.num_tokens + 1 >= self.config.max_context:
                continue
            nxt.append(seq)
            new_blocks += self.kv.blocks_for(seq.num_computed + 1) - len(seq.block_table)
        return nxt if new_blocks <= self.kv.pool.num_free else []

    def _launch_lookahead(self, seqs: list[Sequence], prev: _Inflight) -> _Inflight:
        """One decode row per sequence at the position of its in-flight token; the input ids are gathered on
        the device from prev's sampled ids (the host packs row indices in their place)."""
        row = {s.seq_id: i for i, s in enumerate(prev.seqs)}
        chunks = []
        for seq in seqs:
            self.kv.ensure(seq, seq.num_computed + 1)
            chunks.append(SeqChunk([row[seq.seq_id]], seq.num_computed, seq.block_table, True, seq.lora_slot))
        batch = self.runner.prepare(chunks)
        batch.input_ids = prev.ids.index_select(0, batch.input_ids)
        logits = self.runner.forward(batch)
        for seq in seqs:
            seq.num_computed += 1
        self.last_scheduled = len(seqs)
        self.lookahead_steps += 1
        return self._launch_sampling(logits, seqs, 0, lookahead=True)

    def _launch_sampling(self, logits: torch.Tensor, seqs: list[Sequence], prefill_tokens: int,
                         lookahead: bool) -> _Inflight:
        kernels = self.runner.kernels
        shaped = shape_logits(logits, seqs, self.runner.eos_ids, ahead=int(lookahead))
        guided = [r for r, s in enumerate(seqs) if s.guide is not None]
        if guided:   # grammar masks on the constrained rows, one call (outside any captured graph)
            shaped = logits.float().clone() if shaped is logits else shaped
            apply_masks(shaped, guided, [seqs[r].guide for r in guided], shaped.shape[-1])
        argmax = kernels.argmax_rows if kernels is not None and shaped is logits else None
        ids, logprobs = sample_with_logprobs(shaped, seqs, ahead=int(lookahead),   # lookahead: prev's token not appended
                                             argmax=argmax)
        host, event = ids, None
        if ids.device.type == "cuda":
            host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            host.copy_(ids, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return _Inflight(seqs, ids, host, event, prefill_tokens, lookahead, logprobs)

    def _resolve(self, flight: _Inflight) -> list[StepOutput]:
        """Wait for a launched step's ids (only them: later launches keep running) and apply them."""
        if flight.event is not None:
            flight.event.synchronize()
        new_ids = flight.host.tolist()
        lps = flight.logprobs.per_row(flight.seqs) if flight.logprobs is not None else {}
        now = time.monotonic()
        outputs = []
        for row, (seq, tok) in enumerate(zip(flight.seqs, new_ids)):
            if seq.finished:             # stopped or aborted after this step was launched: a wasted row
                continue
            if flight.lookahead:
                self.kv.commit(seq)
            outputs.append(self._append(seq, tok, now, lps.get(row)))
        self.stats.on_step(len(outputs), flight.prefill_tokens)
        self.steps += 1
        return outputs

    def _append(self, seq: Sequence, tok: int, now: float, logprob=None) -> StepOutput:
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.stats.on_first_token(now - seq.arrival)
        elif seq.last_token_at is not None:
            self.stats.on_token(now - seq.last_token_at)
        seq.last_token_at = now
        p = seq.params
        if (tok in self.runner.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            # EOS (or a stop token id) itself is not emitted; release whatever stop-string hold-back was keeping
            release = seq.output_ids[seq.num_emitted:]
            return self._done(seq, release, FinishReason.STOP)
        seq.token_ids.append(tok)
        if logprob is not None:
            seq.token_logprobs.append(logprob)
        if seq.guide is not None and seq.guide.accept(tok):   # a complete value: nothing more may follow
            return self._done(seq, seq.output_ids[seq.num_emitted:], FinishReason.STOP)
        checker = self.stop_checkers.get(seq.seq_id)
        if checker is not None:
            safe, hit = checker.update(seq.output_ids)
            release = seq.output_ids[seq.num_emitted:safe]
            if hit:
                return self._done(seq, release, FinishReason.STOP)
        else:
            release = [tok]
        if seq.num_output >= p.max_tokens or seq.num_tokens >= self.config.max_context:
            return self._done(seq, seq.output_ids[seq.num_emitted:], FinishReason.LENGTH)
        out = StepOutput(seq, release, logprobs=self._released_logprobs(seq, len(release)))
        seq.num_emitted += len(release)
        return out

    def _done(self, seq: Sequence, release: list[int], reason: FinishReason) -> StepOutput:
        logprobs = self._released_logprobs(seq, len(release))
        seq.num_emitted += len(release)
        self._finish(seq, reason)
        return StepOutput(seq, release, reason.value, logprobs)

    @staticmethod
    def _released_logprobs(seq: Sequence, n: int):
        if not seq.params.wants_logprobs:
            return None
        return seq.token_logprobs[seq.num_emitted:seq.num_emitted + n]

    # ------------------------------------------------------------------ introspection
    def kv_overhead(self) -> float:
        """Referenced KV blocks' capacity / resident tokens (1.0 = no waste)."""
        resident = sum(s.num_computed for s in self.scheduler.running)
        return self.kv.pool.num_used * self.config.block_size / resident if resident else 1.0
