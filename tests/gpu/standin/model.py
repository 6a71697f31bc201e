"""A stand-in for TensorRT-LLM's `tensorrt_llm` model, for the GPU ensemble's tests on CPU. NOT TensorRT-LLM.

It is served by the Python backend under the exact config.pbtxt that build_engines renders for the real
`tensorrtllm` backend (only the `backend:` line differs), and behaves as that backend documents
(tensorrtllm_backend v0.17.0, TensorRT-LLM 0.17 executor):
- decoupled: one response per generated token, new tokens only (exclude_input_in_output); the end id is never
  sent; the last response carries Triton's final flag (TRITONSERVER_RESPONSE_COMPLETE_FINAL), possibly with
  zero tokens (when the model produced the end id);
- `kv_cache_reused_blocks` (+ alloc_new / alloc_total) on every response when `return_kv_cache_reuse_stats`
  is set: leading full prompt blocks of `tokens_per_block` already seen (a prefix-block table, LRU);
- a LoRA task cache keyed by `lora_task_id`: weights + config are cached on first sight (shapes checked as the
  backend does: [modules x layers, D*Hi + Ho*D] and [modules x layers, 3]); a task id that is not cached is
  answered with the backend's own error text; LRU eviction beyond `lora_cache_max_tasks`;
- the backend's metric families nv_trt_llm_request_metrics{request_type=active|max|scheduled|context} and
  nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=max|free|used|tokens_per}.
- guided decoding as tensorrtllm_backend >= 0.19 does it with `guided_decoding_backend: xgrammar`: the tokenizer
  from `xgrammar_tokenizer_info_path` (encoded_vocab, tokenizer_str, stop_token_ids), inputs
  `guided_decoding_guide_type` json | json_schema | regex | ebnf_grammar and `guided_decoding_guide`, the
  logits masked by the same xgrammar library (a request for it on a model without the parameters is an error);
- `end_id` -1 (no end id: generate to request_output_len), `min_length` (the end id is masked until then),
  `return_log_probs` -> `output_log_probs` [1, 1, new tokens] (log-softmax of the distribution sampled from).
Tokens come from a real model (the Hugging Face checkpoint at `gpt_model_path`, greedy or sampled with
transformers); adapters are cached and counted but not applied to the logits; repetition/presence/frequency
penalties are accepted and not applied.
"""
import hashlib
import json
import threading
from collections import OrderedDict

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from transformers import AutoModelForCausalLM

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
MAX_KV_BLOCKS = 512


def _get(request, name, default=None):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else tensor.as_numpy()


def _scalar(request, name, default):
    value = _get(request, name)
    return default if value is None else value.reshape(-1)[0].item()


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config["parameters"].items()}
        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(params["gpt_model_path"], torch_dtype=torch.float32).eval()
        self.tokens_per_block = int(params.get("tokens_per_block_standin", "16"))
        self.lora_cache_tasks = int(params.get("lora_cache_tasks_standin", "4"))
        self.lock = threading.Lock()          # one forward pass at a time (no inflight batching here)
        self.state = threading.Lock()
        self.blocks: OrderedDict = OrderedDict()  # prefix block hash -> None (LRU)
        self.loras: OrderedDict = OrderedDict()   # task id -> (weights, config) (LRU)
        self.active = 0
        self.used_blocks = 0
        labels = {"model": args["model_name"], "version": args["model_version"]}
        requests = pb_utils.MetricFamily("nv_trt_llm_request_metrics", "TRT LLM request metrics",
                                         pb_utils.MetricFamily.GAUGE)
        kv = pb_utils.MetricFamily("nv_trt_llm_kv_cache_block_metrics", "TRT LLM KV cache block metrics",
                                   pb_utils.MetricFamily.GAUGE)
        uploads = pb_utils.MetricFamily("standin_lora_weight_uploads_total",
                                        "LoRA weights received with a request (stand-in only)",
                                        pb_utils.MetricFamily.COUNTER)
        self.m_active = requests.Metric(labels={**labels, "request_type": "active"})
        self.m_sched = requests.Metric(labels={**labels, "request_type": "scheduled"})
        requests.Metric(labels={**labels, "request_type": "max"}).set(int(config["max_batch_size"]))
        kv.Metric(labels={**labels, "kv_cache_block_type": "max"}).set(MAX_KV_BLOCKS)
        kv.Metric(labels={**labels, "kv_cache_block_type": "tokens_per"}).set(self.tokens_per_block)
        self.m_free = kv.Metric(labels={**labels, "kv_cache_block_type": "free"})
        self.m_used = kv.Metric(labels={**labels, "kv_cache_block_type": "used"})
        self.m_free.set(MAX_KV_BLOCKS)
        self.m_used.set(0)
        self.m_uploads = uploads.Metric(labels=labels)
        self.families = (requests, kv, uploads)  # metric families live as long as the model
        self.grammars = self._grammar_compiler(params)

    def _grammar_compiler(self, params):
        """xgrammar's compiler over the backend's tokenizer-info file, as the C++ backend builds it (None when
        the model config does not enable guided decoding)."""
        path = params.get("xgrammar_tokenizer_info_path", "")
        if params.get("guided_decoding_backend") != "xgrammar" or not path or path.startswith("${"):
            return None
        import xgrammar as xgr
        with open(path) as f:
            info = json.load(f)
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(info["tokenizer_str"])
        tokenizer = xgr.TokenizerInfo(info["encoded_vocab"], meta["vocab_type"],
                                      vocab_size=self.model.config.vocab_size,
                                      stop_token_ids=info["stop_token_ids"], add_prefix_space=meta["add_prefix_space"])
        return xgr.GrammarCompiler(tokenizer, max_threads=1)

    def _guide(self, request):
        """The request's grammar matcher (None when unconstrained), as the backend's GuidedDecodingParams."""
        kind = _get(request, "guided_decoding_guide_type")
        if kind is None:
            return None
        kind = kind.reshape(-1)[0]
        kind = kind.decode() if isinstance(kind, bytes) else str(kind)
        text = _get(request, "guided_decoding_guide")
        text = "" if text is None else text.reshape(-1)[0]
        text = text.decode() if isinstance(text, bytes) else str(text)
        if self.grammars is None:
            raise ValueError("Guided decoding is not enabled: set guided_decoding_backend and "
                             "xgrammar_tokenizer_info_path in the tensorrt_llm model config")
        import xgrammar as xgr
        try:
            if kind == "json":
                grammar = self.grammars.compile_builtin_json_grammar()
            elif kind == "json_schema":
                grammar = self.grammars.compile_json_schema(text, any_whitespace=False)
            elif kind == "regex":
                grammar = self.grammars.compile_regex(text)
            elif kind == "ebnf_grammar":
                grammar = self.grammars.compile_grammar(text)
            else:
                raise ValueError(f"guided_decoding_guide_type {kind!r} is not one of json, json_schema, regex, "
                                 "ebnf_grammar")
        except RuntimeError as exc:
            raise ValueError(f"guided decoding guide cannot be compiled: {exc}") from exc
        return xgr.GrammarMatcher(grammar)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                job = self._admit(request)
            except ValueError as exc:  # the backend answers a bad request with an error and the final flag
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))), flags=FINAL)
                continue
            threading.Thread(target=self._generate, args=(sender, *job), daemon=True).start()
        return None

    # ------------------------------------------------------------------ request checks (the backend's contract)
    def _admit(self, request):
        ids = _get(request, "input_ids").reshape(-1).astype(np.int64)
        max_new = int(_scalar(request, "request_output_len", 16))
        end_id = int(_scalar(request, "end_id", -1))
        if _get(request, "lora_task_id") is not None:
            self._lora(request)
        stops = []
        words = _get(request, "stop_words_list")
        if words is not None:
            flat, offsets = words.reshape(2, -1)
            start = 0
            for end in offsets:
                if end < 0:
                    break
                stops.append(flat[start:end].tolist())
                start = int(end)
        reuse_stats = bool(_scalar(request, "return_kv_cache_reuse_stats", False))
        sampling = (float(_scalar(request, "temperature", 1.0)), int(_scalar(request, "runtime_top_k", 1)),
                    int(_scalar(request, "random_seed", 0)), int(_scalar(request, "min_length", 0)),
                    bool(_scalar(request, "return_log_probs", False)), self._guide(request))
        return ids, max_new, end_id, stops, reuse_stats, sampling

    def _lora(self, request):
        task = int(_scalar(request, "lora_task_id", 0))
        weights, config = _get(request, "lora_weights"), _get(request, "lora_config")
        with self.state:
            if weights is None or config is None:
                if task not in self.loras:
                    raise ValueError(f"LoRA task {task} not found in cache. Please send LoRA weights with request")
                self.loras.move_to_end(task)
                return
            weights, config = weights.reshape(weights.shape[-2:]), config.reshape(config.shape[-2:])
            if config.shape[-1] != 3 or weights.shape[0] != config.shape[0]:
                raise ValueError(f"lora_weights {weights.shape} and lora_config {config.shape} do not match: "
                                 "expected [N, D*Hi + Ho*D] and [N, 3]")
            self.loras[task] = (weights, config)
            self.loras.move_to_end(task)
            while len(self.loras) > self.lora_cache_tasks:
                self.loras.popitem(last=False)
        self.m_uploads.increment(1)

    # ------------------------------------------------------------------ generation
    def _prefix_blocks(self, ids):
        """Chained hashes of the prompt's full blocks, leaving the last token to be computed (as the engine does)."""
        out, parent, bs = [], b"", self.tokens_per_block
        for i in range(0, (len(ids) - 1) // bs * bs, bs):
            parent = hashlib.sha256(parent + ids[i:i + bs].tobytes()).digest()
            out.append(parent)
        return out

    def _generate(self, sender, ids, max_new, end_id, stops, reuse_stats, sampling):
        blocks = self._prefix_blocks(ids)
        with self.state:
            reused = 0
            for h in blocks:
                if h not in self.blocks:
                    break
                reused += 1
            for h in blocks:
                self.blocks[h] = None
                self.blocks.move_to_end(h)
            while len(self.blocks) > MAX_KV_BLOCKS // 2:
                self.blocks.popitem(last=False)
            total = -(-(len(ids) + max_new) // self.tokens_per_block)
            self.active += 1
            self.used_blocks += total
            self._publish()
        stats = {"kv_cache_reused_blocks": reused, "kv_cache_alloc_new_blocks": total - reused,
                 "kv_cache_alloc_total_blocks": total} if reuse_stats else {}
        temperature, top_k, seed, min_length, want_logprobs, matcher = sampling
        gen = torch.Generator().manual_seed(seed)
        out: list[int] = []
        past, step_input = None, torch.tensor([ids.tolist()])
        try:
            while True:
                if sender.is_cancelled():
                    sender.send(flags=FINAL)
                    return
                with self.lock, torch.no_grad():
                    result = self.model(input_ids=step_input, past_key_values=past, use_cache=True)
                past, logits = result.past_key_values, result.logits[0, -1].float().clone()
                if matcher is not None:
                    self._mask(matcher, logits)
                if 0 <= end_id < logits.numel() and len(out) < min_length:
                    logits[end_id] = -float("inf")
                greedy = top_k == 1 or temperature <= 1e-4
                scaled = logits if greedy else logits / temperature
                if greedy:
                    token = int(torch.argmax(logits))
                else:
                    token = int(torch.multinomial(torch.softmax(scaled, -1), 1, generator=gen))
                if matcher is not None:
                    matcher.accept_token(token)
                finished_by_end = token == end_id
                new = [] if finished_by_end else [token]  # the executor never streams the end id
                logprobs = [float(torch.log_softmax(scaled, -1)[token])] * len(new) if want_logprobs else None
                out += new
                last = finished_by_end or len(out) >= max_new or any(s and out[-len(s):] == s for s in stops)
                sender.send(self._response(new, stats, logprobs), flags=FINAL if last else 0)
                if last:
                    return
                step_input = torch.tensor([[token]])
        except Exception as exc:  # the backend reports executor errors on the stream, with the final flag
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"Executor failed: {exc}")), flags=FINAL)
        finally:
            with self.state:
                self.active -= 1
                self.used_blocks -= total
                self._publish()

    @staticmethod
    def _mask(matcher, logits):
        import xgrammar as xgr
        bitmask = xgr.allocate_token_bitmask(1, logits.numel())
        matcher.fill_next_token_bitmask(bitmask)
        row = logits.view(1, -1)
        xgr.apply_token_bitmask_inplace(row, bitmask)

    def _response(self, new, stats, logprobs=None):
        tensors = [pb_utils.Tensor("output_ids", np.array([[new]], dtype=np.int32).reshape(1, 1, len(new))),
                   pb_utils.Tensor("sequence_length", np.array([[len(new)]], dtype=np.int32))]
        tensors += [pb_utils.Tensor(k, np.array([[v]], dtype=np.int32)) for k, v in stats.items()]
        if logprobs is not None:  # the backend sends it only when return_log_probs was set
            tensors.append(pb_utils.Tensor("output_log_probs",
                                           np.array(logprobs, dtype=np.float32).reshape(1, 1, len(logprobs))))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _publish(self):
        self.m_active.set(self.active)
        self.m_sched.set(self.active)
        self.m_used.set(self.used_blocks)
        self.m_free.set(MAX_KV_BLOCKS - self.used_blocks)

    def finalize(self):
        self.families = ()
