"""A zero-cost replica stand-in for router benchmarks ONLY (bench/router/capacity.py). NOT our engine.

Served by a real tritonserver (Python backend) under the engine's model name and I/O contract
(model_repository/engine/config.pbtxt): decoupled, `max_tokens` token ids streamed `chunk` per response
(`output_ids` = the delta), the last response carrying `finish_reason` ("length") and `usage` =
[prompt, 0, completion]. It computes nothing: each response is sent as soon as the previous one, so what a
benchmark measures in front of it is the router's own cost. The token ids cycle through ordinary word pieces so
the router's detokeniser has real text to decode.
"""
import json

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
WORD_IDS = np.arange(1000, 1064, dtype=np.int32)   # plain word pieces of the SmolLM2 vocabulary


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.chunk = max(1, int(params.get("chunk", "1")))
        self.sequence = 0

    def _response(self, ids, finish, usage):
        self.sequence += 1
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("output_ids", np.asarray(ids, dtype=np.int32)),
            pb_utils.Tensor("sequence_index", np.array([self.sequence], dtype=np.uint64)),
            pb_utils.Tensor("finish_reason", np.array([finish.encode()], dtype=np.object_)),
            pb_utils.Tensor("usage", np.asarray(usage, dtype=np.int32))])

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            prompt = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy().reshape(-1)
            limit = pb_utils.get_input_tensor_by_name(request, "max_tokens")
            n = int(limit.as_numpy().reshape(-1)[0]) if limit is not None else 16
            sent = 0
            while sent < n:
                k = min(self.chunk, n - sent)
                ids = WORD_IDS[(np.arange(sent, sent + k)) % len(WORD_IDS)]
                sent += k
                last = sent >= n
                sender.send(self._response(ids, "length" if last else "", [len(prompt), 0, sent] if last else
                                           [0, 0, 0]), flags=FINAL if last else 0)
        return None
