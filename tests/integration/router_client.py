"""Async KServe streaming client helpers for the router tests and bench/router (stock tritonclient aio)."""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import InferInput, InferRequestedOutput
from tritonclient.utils import InferenceServerException

IN_BAND_ERROR = re.compile(r"request [^:]*: ([A-Z_]+): ")
RETRY_AFTER = re.compile(r"\(retry after (\d+) ms\)$")
CHATML = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"


@dataclass
class StreamResult:
    text: str = ""
    ids: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    duration_s: float = 0.0
    finish_reason: str = ""
    usage: list[int] = field(default_factory=list)
    error: str | None = None          # gRPC status name, e.g. RESOURCE_EXHAUSTED
    error_message: str = ""
    retry_after_ms: int | None = None  # from the trailing metadata of a refused call
    response_id: str = ""              # the id the router answered with (its usage record's id)


def build_inputs(prompt: str | list[int], max_tokens: int, temperature: float = 0.0,
                 seed: int | None = None) -> list[InferInput]:
    if isinstance(prompt, str):
        first = InferInput("text_input", [1], "BYTES")
        first.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    else:
        first = InferInput("input_ids", [len(prompt)], "INT32")
        first.set_data_from_numpy(np.array(prompt, dtype=np.int32))
    mt = InferInput("max_tokens", [1], "INT32")
    mt.set_data_from_numpy(np.array([max_tokens], dtype=np.int32))
    temp = InferInput("temperature", [1], "FP32")
    temp.set_data_from_numpy(np.array([temperature], dtype=np.float32))
    inputs = [first, mt, temp]
    if seed is not None:
        rs = InferInput("random_seed", [1], "UINT64")
        rs.set_data_from_numpy(np.array([seed], dtype=np.uint64))
        inputs.append(rs)
    return inputs


async def stream_once(client: grpcaio.InferenceServerClient, model: str, prompt: str | list[int], max_tokens: int,
                      api_key: str, request_id: str = "", on_token=None, temperature: float = 0.0,
                      seed: int | None = None, **params) -> StreamResult:
    """One streamed request; `on_token(result_so_far)` is awaited after each delta."""
    out = StreamResult()
    started = time.monotonic()

    async def requests():
        yield {"model_name": model, "inputs": build_inputs(prompt, max_tokens, temperature, seed),
               "outputs": [InferRequestedOutput(n) for n in ("text_output", "output_ids", "finish_reason", "usage")],
               "request_id": request_id, "parameters": params or None}

    stream = client.stream_infer(requests(), headers={"authorization": f"Bearer {api_key}"})
    try:
        async for result, error in stream:
            if error is not None:  # in-band: "request <id>: <STATUS>: <message>[ (retry after N ms)]"
                out.error_message = str(error)
                found = IN_BAND_ERROR.search(out.error_message)
                out.error = found.group(1) if found else "ERROR"
                retry = RETRY_AFTER.search(out.error_message)
                out.retry_after_ms = int(retry.group(1)) if retry else None
                break
            out.response_id = out.response_id or result.get_response().id
            ids = result.as_numpy("output_ids").reshape(-1).tolist()
            text = result.as_numpy("text_output").reshape(-1)[0].decode()
            if (ids or text) and out.ttft_s is None:
                out.ttft_s = time.monotonic() - started
            out.ids.extend(ids)
            out.text += text
            reason = result.as_numpy("finish_reason").reshape(-1)[0].decode()
            if reason:
                out.finish_reason = reason
                out.usage = result.as_numpy("usage").reshape(-1).tolist()
                break
            if on_token is not None:
                await on_token(out)
    except InferenceServerException as exc:
        out.error, out.error_message = str(exc.status()).replace("StatusCode.", ""), exc.message()
    except grpc.aio.AioRpcError as exc:
        out.error, out.error_message = exc.code().name, exc.details() or ""
        trailer = dict(exc.trailing_metadata() or ())
        if "retry-after-ms" in trailer:
            out.retry_after_ms = int(trailer["retry-after-ms"])
    finally:
        stream.cancel()
    out.duration_s = time.monotonic() - started
    return out


def p95(values: list[float]) -> float:
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]
