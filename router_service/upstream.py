"""Streaming calls from the router to one Triton replica's decoupled ensemble `llm`
(docs/architecture.md, Replica interface)."""
from __future__ import annotations

import asyncio
from array import array
from collections.abc import AsyncIterator

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.grpc import InferInput, InferRequestedOutput
from tritonclient.utils import InferenceServerException

from router_service.cancellation import CancelHandle
from router_service.request import TIER_INDEX, Finished, GenerateRequest, TokenDelta

ENSEMBLE = "llm"
OUTPUTS = ("text_output", "output_ids", "finish_reason", "usage")


class ReplicaFailed(Exception):
    """The replica broke the stream: `alive=False` when the connection failed (died, unreachable), True when
    the replica answered the request with an error (it is up; only this request failed there)."""

    def __init__(self, message: str, alive: bool = False) -> None:
        super().__init__(message)
        self.alive = alive


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


def _decode(result) -> tuple[str, list[int], str, list[int]]:
    """(delta text, delta ids, finish reason, usage) of one streamed response, read straight from the raw
    output buffers (hot path; `as_numpy` costs ~30 us per response)."""
    resp = result.get_response()
    raw = resp.raw_output_contents
    if len(raw) != len(resp.outputs):
        return (result.as_numpy("text_output").reshape(-1)[0].decode("utf-8"),
                result.as_numpy("output_ids").reshape(-1).tolist(),
                result.as_numpy("finish_reason").reshape(-1)[0].decode(),
                result.as_numpy("usage").reshape(-1).tolist() if result.as_numpy("usage") is not None else [0, 0, 0])
    out: dict[str, bytes] = {o.name: raw[i] for i, o in enumerate(resp.outputs)}
    usage = array("i")
    usage.frombytes(out.get("usage", b""))
    ids = array("i")
    ids.frombytes(out.get("output_ids", b""))
    return (out["text_output"][4:].decode("utf-8"), ids.tolist(), out.get("finish_reason", b"")[4:].decode(),
            usage.tolist() or [0, 0, 0])


class ReplicaClient:
    """One long-lived gRPC channel per replica; each request is its own bidirectional stream."""

    def __init__(self, replica_id: str, grpc_url: str) -> None:
        self.replica_id = replica_id
        self.client = grpcclient.InferenceServerClient(grpc_url)

    async def close(self) -> None:
        await self.client.close()

    async def generate(self, req: GenerateRequest, prompt_ids: list[int], max_tokens: int,
                       handle: CancelHandle | None = None) -> AsyncIterator[TokenDelta | Finished]:
        """Stream deltas then one Finished; raises ReplicaFailed if the replica breaks the stream.

        Closing this generator early (caller cancel) cancels the upstream call, so the engine frees the
        sequence's KV blocks at once. `handle.cancel()` (cancel by id) does the same from elsewhere and
        this generator then ends with a Finished(`cancelled`).
        """
        done = asyncio.Event()

        async def requests():
            yield {
                "model_name": ENSEMBLE,
                "inputs": build_inputs(req, prompt_ids, max_tokens),
                "outputs": [InferRequestedOutput(name) for name in OUTPUTS],
                "request_id": req.request_id,
                "parameters": {"llm_priority": TIER_INDEX[req.tier], "deadline_ms": int(req.deadline_ms or 0)},
            }
            await done.wait()  # keep our side open until the replica has sent its last response

        stream = self.client.stream_infer(requests())
        if handle is not None:
            handle.upstream = stream
            if handle.cancelled or handle.preempted:
                stream.cancel()
        finished = False
        try:
            async for result, error in stream:
                if error is not None:
                    raise ReplicaFailed(str(error), alive=True)
                text, ids, reason, usage = _decode(result)
                if text or ids:
                    yield TokenDelta(text, ids)
                if reason:
                    finished = True
                    yield Finished(reason, int(usage[0]), int(usage[1]), int(usage[2]), model="", version="",
                                   replica_id=self.replica_id)
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
