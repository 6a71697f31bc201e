"""Stream a completion from the router with stock `tritonclient.grpc`, exactly as against Triton itself.

    .venv/bin/python examples/triton_client.py "What is the capital of France?"
"""
import argparse
import queue
import uuid
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("prompt")
ap.add_argument("--url", default="127.0.0.1:8031")
ap.add_argument("--model", default="smollm2-135m")
ap.add_argument("--max-tokens", type=int, default=48)
ap.add_argument("--key-file", default=".fleet/dev-api-key")
args = ap.parse_args()

# The model is instruction-tuned: wrap the question in its ChatML template.
prompt = f"<|im_start|>user\n{args.prompt}<|im_end|>\n<|im_start|>assistant\n"
text = grpcclient.InferInput("text_input", [1], "BYTES")
text.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
max_tokens = grpcclient.InferInput("max_tokens", [1], "INT32")
max_tokens.set_data_from_numpy(np.array([args.max_tokens], dtype=np.int32))

responses: queue.Queue = queue.Queue()
client = grpcclient.InferenceServerClient(args.url)
client.start_stream(callback=lambda result, error: responses.put((result, error)),
                    headers={"authorization": f"Bearer {Path(args.key_file).read_text().strip()}"})
client.async_stream_infer(args.model, [text, max_tokens], request_id=uuid.uuid4().hex,
                          parameters={"tier": "interactive"})
while True:
    result, error = responses.get()
    if error is not None:
        raise SystemExit(f"error: {error}")
    print(result.as_numpy("text_output")[0].decode(), end="", flush=True)
    if result.as_numpy("finish_reason")[0]:
        print(f"\n[finish_reason={result.as_numpy('finish_reason')[0].decode()} "
              f"usage(prompt, cached, completion)={result.as_numpy('usage').tolist()}]")
        break
client.stop_stream()
