"""GPU `postprocessing` (TensorRT-LLM ensemble): one tensorrt_llm response -> the ensemble's outside shape.

With streaming and exclude_input_in_output each response holds the new tokens only, and the end id is never
among them. No response says it is the last: the stream's end is Triton's empty final response, which the
router reads (router_service/upstream.py), so finish_reason is always "" here and the router counts tokens.
usage = [0, cached prompt tokens, tokens in this response]; cached = kv_cache_reused_blocks x tokens_per_block
(the engine's block size), present when the request asked for return_kv_cache_reuse_stats. The prompt length
is the router's: an ensemble step may not mix inputs of the decoupled tensorrt_llm with other models' outputs.
Each delta is decoded alone (no per-sequence state: this model never learns when a sequence ends).
`output_logprobs` (each new token's logprob, [tokens]) only when tensorrt_llm sent `output_log_probs` (the
request set return_log_probs); the router reads it as the delta's logprobs.
"""
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from common.text import load_tokenizer
from python_backends.gpu_metrics import GpuCounters, replica_labels


def _arr(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.tokenizer = load_tokenizer(params["tokenizer_dir"])
        self.tokens_per_block = int(params["tokens_per_block"])
        self.metrics = GpuCounters(pb_utils, ("fleet_engine_generated_tokens_total",), replica_labels())

    def finalize(self):
        self.metrics.close()

    def execute(self, requests):
        return [self._one(r) for r in requests]

    def _one(self, request):
        seq_len = int(_arr(request, "sequence_length").reshape(-1)[0])
        ids = _arr(request, "output_ids").reshape(-1)[:seq_len].astype(np.int32)  # batch 1, beam 1
        reused = _arr(request, "kv_cache_reused_blocks")
        cached = 0 if reused is None else int(reused.reshape(-1)[0]) * self.tokens_per_block
        text = self.tokenizer.decode(ids.tolist(), skip_special_tokens=True) if ids.size else ""
        self.metrics.add("fleet_engine_generated_tokens_total", int(ids.size))
        tensors = [pb_utils.Tensor("text_output", np.array([text.encode()], dtype=object)),
                   pb_utils.Tensor("output_ids_out", ids),
                   pb_utils.Tensor("finish_reason", np.array([b""], dtype=object)),
                   pb_utils.Tensor("usage", np.array([0, max(cached, 0), ids.size], dtype=np.int32))]
        logprobs = _arr(request, "output_log_probs")  # [batch 1, beam 1, tokens of this response]
        if logprobs is not None:
            tensors.append(pb_utils.Tensor("output_logprobs",
                                           logprobs.reshape(-1)[:ids.size].astype(np.float32)))
        return pb_utils.InferenceResponse(output_tensors=tensors)
