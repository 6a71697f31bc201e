"""Triton shim for `preprocessing`: text_input -> prompt_ids (or input_ids passed through)."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from common.text import load_tokenizer


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.tokenizer = load_tokenizer(params["tokenizer_dir"]["string_value"])

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        ids_tensor = pb_utils.get_input_tensor_by_name(request, "input_ids")
        text_tensor = pb_utils.get_input_tensor_by_name(request, "text_input")
        if ids_tensor is not None:
            ids = ids_tensor.as_numpy().astype(np.int32).reshape(-1)
        elif text_tensor is not None:
            raw = text_tensor.as_numpy().reshape(-1)[0]
            try:
                text = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
            except UnicodeDecodeError as exc:
                return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"text_input is not valid UTF-8: {exc}"))
            ids = np.array(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)
        else:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(
                "one of text_input (BYTES[1]) or input_ids (INT32[-1]) is required"))
        if ids.size == 0:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError("the prompt is empty"))
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("prompt_ids", ids)])
