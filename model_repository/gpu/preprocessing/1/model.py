"""GPU `preprocessing` (TensorRT-LLM ensemble): the request -> the tensorrt_llm model's inputs.

Runs inside NVIDIA's Triton TRT-LLM container with this project installed (docs/build_engines.md); not
executed on the CPU machines. Shapes carry an explicit batch dim of 1 (this model does not batch; the
tensorrt_llm model does). An adapter request always carries `lora_task_id`;
its weights (`<adapters_dir>/<lora_name>/model.lora_{weights,config}.npy`, written by build_engines' PEFT
conversion in TensorRT-LLM's layout) are attached only when the router sets request parameter `lora_load`:
TensorRT-LLM keeps them in its LoRA cache, so they cross into the backend once per replica (again only after
the backend answered that the task is not cached).
Request parameters read here: `lora_load`, `ignore_eos` (end_id -1, no EOS stop words), `seed_offset` (a
resumed seeded stream) and `sampling` (penalties, min_tokens, stop_token_ids, logprobs, guided decoding),
mapped by common/trtllm_request.py.
"""
import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from common.eos import eos_token_ids, stop_words_tensor
from common.hashing import lora_task_id
from common.names import valid_adapter_name  # a name, never a path: no folder outside adapters_dir
from common.text import load_tokenizer
from common.trtllm_request import NO_END_ID, random_seed, sampling_inputs
from python_backends.gpu_metrics import GpuCounters, replica_labels

DEFAULT_MAX_TOKENS = 256


def _opt(request, name, default):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return default if t is None else t.as_numpy().reshape(-1)[0]


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.tokenizer = load_tokenizer(params["tokenizer_dir"])
        # TensorRT-LLM takes one end_id: the first EOS; every other one (Llama-3-Instruct's <|eot_id|>, ...)
        # is a one-token stop word, so the stream ends on whichever the model emits
        eos = eos_token_ids(params["tokenizer_dir"], self.tokenizer)
        self.end_id, self.extra_eos = eos[0], [[i] for i in eos[1:]]
        self.adapters = Path(params["adapters_dir"])
        self.max_context = int(params["max_context"])
        self.guided_decoding = params.get("guided_decoding") == "on"
        self.metrics = GpuCounters(pb_utils, ("fleet_engine_prefix_cache_queried_tokens_total",), replica_labels())

    def finalize(self):
        self.metrics.close()

    def execute(self, requests):
        out = []
        for request in requests:
            try:
                out.append(pb_utils.InferenceResponse(output_tensors=self._tensors(request)))
            except ValueError as exc:
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
        return out

    def _stop_words(self, request, ignore_eos: bool, token_words: list[list[int]]) -> np.ndarray:
        """The model's other EOS ids (unless ignore_eos), the request's stop token ids, then its stop strings,
        as TensorRT-LLM's stop_words_list."""
        t = pb_utils.get_input_tensor_by_name(request, "stop_words")
        words = [w.decode() if isinstance(w, bytes) else str(w) for w in (t.as_numpy().reshape(-1) if t else [])]
        return stop_words_tensor(([] if ignore_eos else self.extra_eos) + token_words
                                 + [self.tokenizer.encode(w, add_special_tokens=False).ids for w in words])

    def _tensors(self, request) -> list:
        ids_t = pb_utils.get_input_tensor_by_name(request, "input_ids")
        if ids_t is not None:
            ids = ids_t.as_numpy().astype(np.int32).reshape(-1)
        else:
            raw = _opt(request, "text_input", None)
            if raw is None:
                raise ValueError("one of text_input (BYTES[1]) or input_ids (INT32[-1]) is required")
            text = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
            ids = np.array(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)
        if ids.size == 0:
            raise ValueError("the prompt is empty")
        max_tokens = int(_opt(request, "max_tokens", DEFAULT_MAX_TOKENS))
        if ids.size + 1 > self.max_context:
            raise ValueError(f"prompt has {ids.size} tokens; max context is {self.max_context}")
        max_tokens = max(1, min(max_tokens, self.max_context - ids.size))
        params = json.loads(request.parameters() or "{}")
        ignore_eos = params.get("ignore_eos") is True
        try:
            sampling = json.loads(params.get("sampling") or "{}")
        except json.JSONDecodeError as exc:
            raise ValueError(f"request parameter sampling: not JSON ({exc})") from exc
        if sampling.get("guided") and not self.guided_decoding:  # "refused: ": a 400 from the router, not retried
            raise ValueError("refused: response_format: this GPU deployment's TensorRT-LLM backend does not apply "
                             "guided decoding (needs tensorrtllm_backend >= 0.19; docs/gpu_path.md); send the "
                             "request without response_format or to a model served by CPU engine replicas")
        extra, token_words = sampling_inputs(sampling)
        temperature = float(_opt(request, "temperature", 1.0))
        top_k = int(_opt(request, "top_k", 0)) if temperature > 0 else 1  # temperature 0 = greedy
        one = lambda v, dt: np.array([[v]], dtype=dt)  # noqa: E731
        tensors = [
            pb_utils.Tensor("input_ids_out", ids[None, :]),
            pb_utils.Tensor("input_lengths", one(ids.size, np.int32)),
            pb_utils.Tensor("request_output_len", one(max_tokens, np.int32)),
            pb_utils.Tensor("end_id", one(NO_END_ID if ignore_eos else self.end_id, np.int32)),
            pb_utils.Tensor("pad_id", one(self.end_id, np.int32)),
            pb_utils.Tensor("stop_words_list", self._stop_words(request, ignore_eos, token_words)),
            pb_utils.Tensor("temperature_out", one(max(temperature, 1e-5), np.float32)),
            pb_utils.Tensor("runtime_top_k", one(top_k, np.int32)),
            pb_utils.Tensor("runtime_top_p", one(float(_opt(request, "top_p", 1.0)), np.float32)),
            pb_utils.Tensor("random_seed_out", one(random_seed(int(_opt(request, "random_seed", 0)),
                                                               int(params.get("seed_offset", 0))), np.uint64)),
            pb_utils.Tensor("streaming", one(bool(_opt(request, "stream", True)), np.bool_)),
            pb_utils.Tensor("return_kv_cache_reuse_stats", one(True, np.bool_)),
        ]
        tensors += [pb_utils.Tensor(name, value) for name, value in extra.items()]
        raw = _opt(request, "lora_name", b"")
        adapter = raw.decode() if isinstance(raw, bytes) else str(raw)
        if adapter:
            folder = self.adapters / adapter
            if not valid_adapter_name(adapter) or not (folder / "model.lora_weights.npy").exists():
                raise ValueError(f"unknown adapter {adapter!r}")
            tensors.append(pb_utils.Tensor("lora_task_id", one(lora_task_id(adapter), np.uint64)))
            if params.get("lora_load"):
                weights = np.load(folder / "model.lora_weights.npy").astype(np.float16)
                config = np.load(folder / "model.lora_config.npy").astype(np.int32)
                tensors += [pb_utils.Tensor("lora_weights", weights.reshape((1,) + weights.shape[-2:])),
                            pb_utils.Tensor("lora_config", config.reshape((1,) + config.shape[-2:]))]
        self.metrics.add("fleet_engine_prefix_cache_queried_tokens_total", int(ids.size))  # accepted requests only
        return tensors
