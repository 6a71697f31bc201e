"""Triton shim for `postprocessing`: the engine's token deltas -> text deltas, per sequence."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from common.text import IncrementalDetokenizer, load_tokenizer


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.tokenizer = load_tokenizer(params["tokenizer_dir"]["string_value"])
        self.streams: dict[int, IncrementalDetokenizer] = {}  # sequence_index -> decode state

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        ids = pb_utils.get_input_tensor_by_name(request, "output_ids").as_numpy().astype(np.int32).reshape(-1)
        seq = int(pb_utils.get_input_tensor_by_name(request, "sequence_index").as_numpy().reshape(-1)[0])
        finish = pb_utils.get_input_tensor_by_name(request, "finish_reason").as_numpy().reshape(-1)[0]
        usage = pb_utils.get_input_tensor_by_name(request, "usage").as_numpy().astype(np.int32).reshape(-1)
        detok = self.streams.get(seq)
        if detok is None:
            detok = self.streams[seq] = IncrementalDetokenizer(self.tokenizer)
        text = detok.add(ids.tolist())
        if finish:  # final response of this sequence: emit anything held back and drop the state
            text += detok.flush()
            del self.streams[seq]
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("output_ids", ids),
            pb_utils.Tensor("finish_reason", np.array([finish], dtype=np.object_)),
            pb_utils.Tensor("usage", usage),
        ])
