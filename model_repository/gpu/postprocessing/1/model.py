"""GPU `postprocessing` (TensorRT-LLM ensemble): one tensorrt_llm response -> the ensemble's outside shape.

With streaming and exclude_input_in_output each response holds the new tokens only. The final response is
recognised by the end id (finish_reason `stop`) or, when not streaming, by the full length (`length`).
Runs inside NVIDIA's Triton TRT-LLM container; not executed on the CPU machines.
"""
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from common.text import load_tokenizer


def _arr(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy()


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.tokenizer = load_tokenizer(params["tokenizer_dir"])

    def execute(self, requests):
        return [self._one(r) for r in requests]

    def _one(self, request):
        seq_len = int(_arr(request, "sequence_length").reshape(-1)[0])
        ids = _arr(request, "output_ids").reshape(-1)[:seq_len].astype(np.int32)  # batch 1, beam 1
        end_id = int(_arr(request, "end_id").reshape(-1)[0])
        prompt = int(_arr(request, "input_lengths").reshape(-1)[0])
        limit = int(_arr(request, "request_output_len").reshape(-1)[0])
        finish = ""
        if ids.size and end_id in ids.tolist():
            ids, finish = ids[: ids.tolist().index(end_id)], "stop"
        elif ids.size >= limit:
            finish = "length"
        text = self.tokenizer.decode(ids.tolist(), skip_special_tokens=True) if ids.size else ""
        usage = np.array([prompt, 0, ids.size if finish else 0], dtype=np.int32)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("text_output", np.array([text.encode()], dtype=object)),
            pb_utils.Tensor("output_ids_out", ids),
            pb_utils.Tensor("finish_reason", np.array([finish.encode()], dtype=object)),
            pb_utils.Tensor("usage", usage)])
