"""KServe v2 gRPC frontend: stock `tritonclient.grpc` works against the router as against Triton.

Model names are registry model names (e.g. `smollm2-135m`); `model_version` picks a version explicitly,
otherwise the rollout split does. ModelInfer errors end the call with the matching gRPC status; on a
ModelStreamInfer stream each request's error travels in-band (`error_message`, naming the request id) and
the other requests on the stream carry on. Responses queue per stream with a bound (see stream_guard).

Who may call it: callers with an API key, for every RPC but ServerLive / ServerReady / ServerMetadata;
ModelMetadata, ModelReady and RepositoryIndex show only what the key may use (visibility.py).

A stopping router (SIGTERM, `Router.begin_stop`) answers new and queued requests UNAVAILABLE (in-band on a
stream) and ends each ModelStreamInfer stream with UNAVAILABLE once none of its requests runs, so an idle open
stream does not hold the stop for the whole grace period; the caller opens a new one (another router).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from router_service import tracing
from router_service.core import Router
from router_service.errors import STOPPING_RETRY_AFTER_MS, RouterError
from router_service.grpc_decode import DecodeGuard, Undecodable
from router_service.kserve_codec import decode_request, encode_stream_response, merge_responses
from router_service.visibility import visible_models

log = logging.getLogger(__name__)
SERVER_NAME = "llm-fleet-router"
SERVER_VERSION = "0.1.0"


def _api_key(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key.lower() == "authorization" and value.lower().startswith("bearer "):
            return value[7:].strip()
    return None


async def _abort(context: grpc.aio.ServicerContext, exc: RouterError) -> None:
    if exc.retry_after_ms is not None:
        context.set_trailing_metadata((("retry-after-ms", str(exc.retry_after_ms)),))
    await context.abort(exc.grpc_status, exc.message)


class KServeServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, router: Router) -> None:
        self.router = router
        self.stream_queues: set[asyncio.Queue] = set()  # each open ModelStreamInfer's, woken on stop
        router.stop_hooks.append(self._wake_streams)

    def _wake_streams(self) -> None:
        for queue in self.stream_queues:
            if not queue.full():  # a full one is busy: its loop checks `stopping` after each item anyway
                queue.put_nowait("stop")

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=True)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION, extensions=["streaming"])

    async def _visible(self, context) -> dict:
        """The models (and pinnable versions) the calling key may see; aborts UNAUTHENTICATED without one."""
        try:
            caller = self.router.authenticate(_api_key(context))
        except RouterError as exc:
            await _abort(context, exc)
        return visible_models(self.router.registry.snapshot, caller)

    async def ModelReady(self, request, context):
        versions = (await self._visible(context)).get(request.name)
        ok = versions is not None and (not request.version or request.version in versions)
        return pb.ModelReadyResponse(ready=ok)

    async def ModelMetadata(self, request, context):
        visible = await self._visible(context)
        versions = visible.get(request.name)
        if versions is None:
            known = ", ".join(sorted(visible)) or "none"
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.name[:64]!r} is not served to you; "
                                                           f"models you may use: {known}")
        T = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=request.name, versions=sorted(versions), platform="llm-fleet",
            inputs=[T(name="text_input", datatype="BYTES", shape=[1]), T(name="input_ids", datatype="INT32", shape=[-1]),
                    T(name="max_tokens", datatype="INT32", shape=[1]), T(name="temperature", datatype="FP32", shape=[1]),
                    T(name="top_p", datatype="FP32", shape=[1]), T(name="top_k", datatype="INT32", shape=[1]),
                    T(name="random_seed", datatype="UINT64", shape=[1]), T(name="stop_words", datatype="BYTES", shape=[-1]),
                    T(name="lora_name", datatype="BYTES", shape=[1]), T(name="stream", datatype="BOOL", shape=[1])],
            outputs=[T(name="text_output", datatype="BYTES", shape=[1]), T(name="output_ids", datatype="INT32", shape=[-1]),
                     T(name="finish_reason", datatype="BYTES", shape=[1]), T(name="usage", datatype="INT32", shape=[3])])

    async def RepositoryIndex(self, request, context):
        snap = self.router.registry.snapshot
        out = pb.RepositoryIndexResponse()
        for name, versions in sorted((await self._visible(context)).items()):
            for version, info in sorted(versions.items()):
                pct = snap.routes.get(name, {}).get(version, 0)
                out.models.add(name=name, version=version, state="READY" if info.status == "serving" else info.status.upper(),
                               reason=f"max_context={info.max_context} route={pct}% tiers=interactive,standard,batch")
        return out

    async def _run(self, request: pb.ModelInferRequest, api_key: str | None):
        arrived = time.monotonic()  # the request's total deadline counts from here
        caller = self.router.authenticate(api_key)
        if isinstance(request, Undecodable):  # on a stream: this request's bytes did not parse (grpc_decode)
            raise RouterError("invalid_argument", request.message)
        prepared = await self.router.prepare(caller, decode_request(request), arrived)
        return prepared

    async def ModelInfer(self, request, context):
        prepared = None
        with tracing.grpc_request("ModelInfer", context.invocation_metadata(), request.id):
            try:
                prepared = await self._run(request, _api_key(context))
                items = [item async for item in self.router.stream(prepared)]
            except RouterError as exc:
                tracing.refused(exc.code)
                await _abort(context, exc)
            finally:
                if prepared is not None:
                    self.router.release_unstarted(prepared)
        return merge_responses(prepared.req, prepared.model.version, items)

    async def ModelStreamInfer(self, request_iterator, context):
        """Each request on the stream runs concurrently; responses are interleaved as they come. A request's
        error is sent in-band and ends only that request."""
        api_key = _api_key(context)
        limits = self.router.timeouts
        queue: asyncio.Queue = asyncio.Queue(maxsize=limits.queue_items)
        tasks: set[asyncio.Task] = set()

        async def put(item) -> None:
            if not queue.full():    # the common case, without wait_for's task per response
                queue.put_nowait(item)
                return
            try:
                await asyncio.wait_for(queue.put(item), limits.slow_reader_s)
            except TimeoutError:
                raise RouterError("resource_exhausted", f"the caller read no response for {limits.slow_reader_s:g} s "
                                  f"with {limits.queue_items} waiting: request stopped") from None

        async def run_one(request: pb.ModelInferRequest) -> None:
            with tracing.grpc_request("ModelStreamInfer", context.invocation_metadata(), request.id):
                await serve_one(request)

        async def serve_one(request: pb.ModelInferRequest) -> None:
            prepared = None
            try:
                prepared = await self._run(request, api_key)
                async with contextlib.aclosing(self.router.stream(prepared)) as items:
                    async for item in items:
                        await put(encode_stream_response(prepared.req, prepared.model.version, item))
            except RouterError as exc:  # the key belongs to the stream: a bad one ends the whole stream
                tracing.refused(exc.code)
                await queue.put(exc if exc.code == "unauthenticated" else _stream_error(request, exc))
            except Exception as exc:
                log.exception("stream request failed")
                await queue.put(_stream_error(request, RouterError("internal", f"internal error: {exc}")))
            finally:
                if prepared is not None:
                    self.router.release_unstarted(prepared)
                with contextlib.suppress(asyncio.CancelledError):
                    await queue.put(None)  # this request's last item

        pending = 0  # requests whose last queue item (None) has not been taken yet

        async def read_requests() -> None:
            nonlocal pending
            async for request in request_iterator:
                pending += 1
                task = asyncio.create_task(run_one(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await queue.put("eof")

        reader = asyncio.create_task(read_requests())
        self.stream_queues.add(queue)
        client_done = False
        try:
            while not (client_done and pending == 0):
                if self.router.stopping and pending == 0:
                    await _abort(context, RouterError("unavailable", "router is stopping: this stream's requests "
                                                      "are done; open a new stream (another router) for more",
                                                      STOPPING_RETRY_AFTER_MS))
                item = await queue.get()
                if item is None:
                    pending -= 1
                elif isinstance(item, str):  # "eof": the caller sent all its requests; "stop": checked above
                    client_done = client_done or item == "eof"
                elif isinstance(item, RouterError):
                    await _abort(context, item)
                else:
                    yield item
        finally:  # caller went away or aborted: cancel upstream work so replicas free KV blocks
            self.stream_queues.discard(queue)
            reader.cancel()
            for task in list(tasks):
                task.cancel()


def _stream_error(request: pb.ModelInferRequest, exc: RouterError) -> pb.ModelStreamInferResponse:
    """One request's error on a stream, in-band: the stream and its other requests go on."""
    rid = request.id or "(no id)"
    retry = f" (retry after {exc.retry_after_ms} ms)" if exc.retry_after_ms is not None else ""
    resp = pb.ModelInferResponse(model_name=request.model_name, model_version=request.model_version, id=request.id)
    if exc.retry_after_ms is not None:
        resp.parameters["retry_after_ms"].int64_param = exc.retry_after_ms
    return pb.ModelStreamInferResponse(error_message=f"request {rid}: {exc.grpc_status.name}: {exc.message}{retry}",
                                       infer_response=resp)


async def start_grpc_server(router: Router, host: str, port: int) -> grpc.aio.Server:
    server = grpc.aio.server(interceptors=[DecodeGuard()],  # undecodable bytes: INVALID_ARGUMENT, not UNKNOWN
                             options=[("grpc.max_receive_message_length", 16 * 1024 * 1024),
                                      ("grpc.max_send_message_length", 16 * 1024 * 1024)])
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(KServeServicer(router), server)
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server
