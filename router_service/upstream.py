"""Streaming calls from the router to one Triton replica's decoupled ensemble `llm` (docs/architecture.md, Replica interface).

A stream ends on whichever comes first: a response that carries a `finish_reason` (the CPU engine knows why it
stopped), or Triton's empty final response (parameter `triton_final_response`, asked for with
`triton_enable_empty_final_response`). The second is the only end signal of the GPU ensemble: TensorRT-LLM
streams new tokens only, omits `end_id`, and an ensemble step never sees the backend's last-response flag, so
there the router decides `length` (it asked for that many tokens) or `stop` and counts the tokens itself.

LoRA on GPU replicas: TensorRT-LLM caches adapter weights per task id. The first request of an adapter on a
replica asks the replica to attach the weights (request parameter `lora_load`); later ones send only the
name (-> `lora_task_id`). When the backend answers that the task is not cached (evicted, or the replica
restarted), the request is sent again at once with `lora_load`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
from array import array
from collections.abc import AsyncIterator

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.grpc import InferInput, InferRequestedOutput, InferResult
from tritonclient.grpc._utils import _get_inference_request
from tritonclient.utils import InferenceServerException

from common.trtllm_request import GPU_FIELDS  # the sampling fields a TensorRT-LLM replica takes
from router_service import metrics
from router_service.cancellation import CancelHandle
from router_service.request import TIER_INDEX, Finished, GenerateRequest, TokenDelta

log = logging.getLogger(__name__)
ENSEMBLE = "llm"
OUTPUTS = ("text_output", "output_ids", "finish_reason", "usage")
# A CPU replica's engine model, called directly: it streams token ids only and the router decodes the text
# (stream_guard.StreamText), so each response skips the ensemble's hop through the detokenizing
# `postprocessing` model (another Python process) on the cores that run the model.
ENGINE = "engine"
ENGINE_OUTPUTS = ("output_ids", "finish_reason", "usage")
# asked for only when the request wants logprobs: per released id its logprob, and top_logprobs (id, logprob)
# pairs per id, flattened
LOGPROB_OUTPUTS = ("output_logprobs", "top_logprob_ids", "top_logprobs")
# TensorRT-LLM's PeftCacheManager: "LoRA task <id> not found in cache. Please send LoRA weights with request"
LORA_NOT_CACHED = re.compile(r"LoRA task \d+ not found in cache")


class ReplicaFailed(Exception):
    """The replica broke the stream: `alive=False` when the connection failed (died, unreachable), True when
    the replica answered the request with an error (it is up; only this request failed there)."""

    def __init__(self, message: str, alive: bool = False) -> None:
        super().__init__(message)
        self.alive = alive


class ReplicaRefused(Exception):
    """The replica's engine refused the request before generating (its message says why): not retried."""


# The engine shim starts a refusal's error message with this (model_repository/engine/1/model.py)
REFUSED_PREFIX = "refused: "


class Preempted(Exception):
    """The router cancelled this upstream call to make room for interactive work (see batch_yield)."""


def _input(name: str, array: np.ndarray, dtype: str) -> InferInput:
    tensor = InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


def build_inputs(req: GenerateRequest, prompt_ids: list[int], max_tokens: int) -> list[InferInput]:
    inputs = [
        _input("input_ids", np.array(prompt_ids, dtype=np.int32), "INT32"),
        _input("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"),
        _input("temperature", np.array([req.temperature], dtype=np.float32), "FP32"),
        _input("top_p", np.array([req.top_p], dtype=np.float32), "FP32"),
        _input("top_k", np.array([req.top_k], dtype=np.int32), "INT32"),
        _input("lora_name", np.array([req.adapter.encode()], dtype=np.object_), "BYTES"),
    ]
    if req.seed is not None:
        inputs.append(_input("random_seed", np.array([req.seed], dtype=np.uint64), "UINT64"))
    if req.stop:
        inputs.append(_input("stop_words", np.array([s.encode() for s in req.stop], dtype=np.object_), "BYTES"))
    return inputs


def is_final(response) -> bool:
    """Triton's last response of a decoupled stream (the empty one when nothing else carries the flag)."""
    param = response.parameters.get("triton_final_response")
    return param is not None and param.bool_param


def _logprobs(out: dict[str, bytes], k: int) -> list[tuple[float, list[tuple[int, float]]]] | None:
    if "output_logprobs" not in out:
        return None
    chosen, ids, lps = array("f"), array("i"), array("f")
    chosen.frombytes(out["output_logprobs"])
    ids.frombytes(out.get("top_logprob_ids", b""))
    lps.frombytes(out.get("top_logprobs", b""))
    return [(chosen[i], list(zip(ids[i * k:(i + 1) * k], lps[i * k:(i + 1) * k]))) for i in range(len(chosen))]


def _decode(result) -> tuple[str, list[int], str, list[int]]:
    """(delta text, delta ids, finish reason, usage) of one streamed response, read straight from the raw
    output buffers (hot path; `as_numpy` costs ~30 us per response)."""
    resp = result.get_response()
    raw = resp.raw_output_contents
    if not resp.outputs:
        return "", [], "", [0, 0, 0]
    if len(raw) != len(resp.outputs):
        text = result.as_numpy("text_output")
        return (text.reshape(-1)[0].decode("utf-8") if text is not None else "",
                result.as_numpy("output_ids").reshape(-1).tolist(),
                result.as_numpy("finish_reason").reshape(-1)[0].decode(),
                result.as_numpy("usage").reshape(-1).tolist() if result.as_numpy("usage") is not None else [0, 0, 0])
    out: dict[str, bytes] = {o.name: raw[i] for i, o in enumerate(resp.outputs)}
    usage = array("i")
    usage.frombytes(out.get("usage", b""))
    ids = array("i")
    ids.frombytes(out.get("output_ids", b""))
    return (out.get("text_output", b"")[4:].decode("utf-8"), ids.tolist(), out.get("finish_reason", b"")[4:].decode(),
            usage.tolist() or [0, 0, 0])


class LoraNotCached(Exception):
    """The replica's TensorRT-LLM LoRA cache does not hold the adapter (evicted, or the replica restarted)."""


class ReplicaClient:
    """One long-lived gRPC channel per replica; each request is its own bidirectional stream."""

    def __init__(self, replica_id: str, grpc_url: str) -> None:
        self.replica_id = replica_id
        self.client = grpcclient.InferenceServerClient(grpc_url)
        self.lora_sent: set[str] = set()  # adapters whose weights this replica was asked to load
        self.engine_direct: bool | None = None  # serves model `engine` (a CPU replica); asked once

    async def close(self) -> None:
        await self.client.close()

    async def serves_engine(self) -> bool:
        """Whether this replica serves our engine model, which the router then calls directly (GPU replicas
        serve TensorRT-LLM behind the ensemble only). Asked once per replica; unanswered = not yet known."""
        if self.engine_direct is None:
            try:
                self.engine_direct = bool(await self.client.is_model_ready(ENGINE, client_timeout=2.0))
            except InferenceServerException:
                return False
        return self.engine_direct

    def _open(self, req: GenerateRequest, prompt_ids: list[int], max_tokens: int, done: asyncio.Event, lora_load: bool,
              seed_offset: int = 0, direct: bool = False):
        params = {"llm_priority": TIER_INDEX[req.tier], "deadline_ms": int(req.deadline_ms or 0)}
        if lora_load:
            params["lora_load"] = True
        if req.ignore_eos:
            params["ignore_eos"] = True
        sampling = req.sampling_fields()
        if sampling:
            other = [k for k in sampling if k not in GPU_FIELDS]
            if not direct and other:  # TensorRT-LLM has no top-k logprobs, logit_bias by id or min_p (docs/gpu_path.md)
                raise ReplicaRefused(f"{', '.join(other)}: served by CPU engine replicas only; this model's "
                                     f"TensorRT-LLM replicas take {', '.join(sorted(GPU_FIELDS))}")
            params["sampling"] = json.dumps({k: ({str(t): b for t, b in v.items()} if k == "logit_bias" else v)
                                             for k, v in sampling.items()}, separators=(",", ":"))
        if seed_offset:  # a resumed seeded stream: the engine continues the random stream at this step
            params["seed_offset"] = seed_offset
        params.update(req.trace_context)  # traceparent of this attempt's span (router_service.tracing)
        request = _get_inference_request(
            model_name=ENGINE if direct else ENSEMBLE, inputs=build_inputs(req, prompt_ids, max_tokens),
            model_version="", request_id=req.request_id,
            outputs=[InferRequestedOutput(name) for name in (ENGINE_OUTPUTS if direct else OUTPUTS)
                     + ((LOGPROB_OUTPUTS if direct else LOGPROB_OUTPUTS[:1]) if req.logprobs or req.top_logprobs
                        else ())], sequence_id=0,
            sequence_start=False, sequence_end=False, priority=0, timeout=None, parameters=params)
        # tritonclient's stream_infer refuses `triton_`-prefixed parameters, so the request is built with its
        # own helper and Triton's switch for the empty final response is set here.
        request.parameters["triton_enable_empty_final_response"].bool_param = True

        async def requests():
            yield request
            await done.wait()  # keep our side open until the replica has sent its last response
        # traceparent also as gRPC metadata: Triton's OpenTelemetry mode continues the caller's trace from it
        return self.client._client_stub.ModelStreamInfer(requests(), metadata=tuple(req.trace_context.items()) or None)

    async def generate(self, req: GenerateRequest, prompt_ids: list[int], max_tokens: int,
                       handle: CancelHandle | None = None, seed_offset: int = 0,
                       direct: bool = False) -> AsyncIterator[TokenDelta | Finished]:
        """Stream deltas then one Finished; raises ReplicaFailed if the replica breaks the stream. `direct`:
        call the replica's `engine` model (see serves_engine); its deltas then carry ids and no text.

        Closing this generator early (caller cancel) cancels the upstream call, so the engine frees the
        sequence's KV blocks at once. `handle.cancel()` (cancel by id) does the same from elsewhere and
        this generator then ends with a Finished(`cancelled`).
        """
        adapter = req.adapter
        lora_load = bool(adapter) and adapter not in self.lora_sent
        if lora_load:
            metrics.LORA_WEIGHT_SENDS.labels(self.replica_id, "first").inc()
        try:
            async for item in self._attempt(req, prompt_ids, max_tokens, handle, lora_load, seed_offset, direct):
                yield item
        except LoraNotCached:
            log.info("replica %s no longer caches adapter %s: sending its weights again", self.replica_id, adapter)
            metrics.LORA_WEIGHT_SENDS.labels(self.replica_id, "not_cached").inc()
            async for item in self._attempt(req, prompt_ids, max_tokens, handle, True, seed_offset, direct):
                yield item

    async def _attempt(self, req: GenerateRequest, prompt_ids: list[int], max_tokens: int,
                       handle: CancelHandle | None, lora_load: bool,
                       seed_offset: int = 0, direct: bool = False) -> AsyncIterator[TokenDelta | Finished]:
        done = asyncio.Event()
        if lora_load:
            self.lora_sent.add(req.adapter)
        stream = self._open(req, prompt_ids, max_tokens, done, lora_load, seed_offset, direct)
        if handle is not None:
            handle.upstream = stream
            if handle.cancelled or handle.preempted:
                stream.cancel()
        finished, emitted, cached = False, 0, 0
        try:
            async for response in stream:
                if response.error_message:
                    if LORA_NOT_CACHED.search(response.error_message) and not emitted and not lora_load:
                        self.lora_sent.discard(req.adapter)
                        raise LoraNotCached(response.error_message)
                    at = response.error_message.find(REFUSED_PREFIX)   # Triton may prefix the backend's text
                    if at >= 0 and not emitted:
                        raise ReplicaRefused(response.error_message[at + len(REFUSED_PREFIX):])
                    raise ReplicaFailed(response.error_message, alive=True)
                text, ids, reason, usage = _decode(InferResult(response.infer_response))
                resp = response.infer_response
                lps = _logprobs({o.name: resp.raw_output_contents[i] for i, o in enumerate(resp.outputs)},
                                req.top_logprobs) if len(resp.raw_output_contents) == len(resp.outputs) else None
                if reason == "error":  # a replica too old to send the engine's message: a failure there
                    raise ReplicaFailed("the replica ended the stream with an error", alive=True)
                emitted += len(ids)
                cached = max(cached, int(usage[1]))  # GPU: kv_cache_reused_blocks x block size, on every response
                if text or ids:
                    yield TokenDelta(text, ids, lps)
                final = is_final(response.infer_response)
                if reason or final:
                    # GPU ensemble: the final flag is the end; the router asked for max_tokens, so fewer = stop
                    finished = True
                    yield Finished(reason or ("length" if emitted >= max_tokens else "stop"), len(prompt_ids),
                                   cached, emitted, model="", version="", replica_id=self.replica_id)
                    return
            if handle is not None and (handle.cancelled or handle.preempted):
                raise asyncio.CancelledError()  # our own cancel ended the call cleanly; handled below
            raise ReplicaFailed("stream ended without a final response")
        except (InferenceServerException, grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            task = asyncio.current_task()
            ours = handle is not None and (handle.cancelled or handle.preempted)
            if isinstance(exc, asyncio.CancelledError) and (not ours or (task is not None and task.cancelling())):
                raise  # the caller went away: propagate
            if ours and handle.cancelled:
                finished = True  # cancelled by id: end the stream cleanly
                yield Finished("cancelled", len(prompt_ids), 0, 0, model="", version="", replica_id=self.replica_id)
                return
            if ours:
                raise Preempted() from None
            raise ReplicaFailed(str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)) from exc
        finally:
            if handle is not None:
                handle.upstream = None
            done.set()
            if not finished:
                stream.cancel()
