"""HTTP frontend on the callers' port: OpenAI-compatible `/v1/*` with SSE streaming, admin endpoints, /metrics.

Who may call it: callers with an API key (`/v1/*`), operators and viewers with a named admin token
(`/admin/*`); `/health` and `/metrics` are open. Replica state reports are not here: they go to the internal
listener (internal_api.py)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from pydantic import ValidationError

from common.names import CLIENT_ID_RE, CLIENT_ID_RULE
from router_service import http_security
from router_service.admin_api import admin_router
from router_service.budgets import warning_fields, warning_headers
from router_service.core import Router
from router_service.errors import RouterError
from router_service.http_body import parse_json, read_body
from router_service.metrics import prometheus_page
from router_service.openai_schema import ChatBody, CompletionBody
from router_service.request import TIERS, Finished, Prepared, TokenDelta
from router_service.tracing import FASTAPI_TELEMETRY, TracingMiddleware
from router_service.visibility import visible_models


MAX_BODY_BYTES = 4_000_000


def _error(status: int, code: str, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": code, "code": code}}, status_code=status,
                        headers=headers)


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


def create_app(router: Router) -> FastAPI:
    app = FastAPI(title="LLM fleet router", version="0.1.0", telemetry=FASTAPI_TELEMETRY)
    app.add_middleware(TracingMiddleware)  # spans, caller trace context, access log (router_service.tracing)

    @app.exception_handler(RouterError)
    async def _router_error(_req: Request, exc: RouterError):
        headers = {"Retry-After": str(max(1, exc.retry_after_ms // 1000))} if exc.retry_after_ms else None
        return _error(exc.http_status, exc.code, exc.message, headers)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_req: Request, exc: RequestValidationError):
        return _error(400, "invalid_argument", _describe(exc.errors()))

    @app.get("/health")
    async def health():
        return {"status": "ok", "registry_version": router.registry.snapshot.version}

    app.add_api_route("/metrics", prometheus_page(router), methods=["GET"])

    @app.get("/v1/models")
    async def models(request: Request):
        caller = router.authenticate(_bearer(request))
        snap = router.registry.snapshot
        data = [{"id": name, "object": "model", "owned_by": "fleet", "versions": sorted(versions),
                 "routes": snap.routes.get(name, {}), "tiers": list(TIERS),
                 "status": {v: info.status for v, info in sorted(versions.items())},
                 "max_context": max(v.max_context for v in snap.models[name].values())}
                for name, versions in sorted(visible_models(snap, caller).items())]
        return {"object": "list", "data": data}

    async def run(request: Request, schema: type[CompletionBody] | type[ChatBody], chat: bool):
        caller = router.authenticate(_bearer(request))
        body = await _parse(request, schema)
        req = body.request()
        req.client_id = _client_request_id(request)
        prepared = await router.prepare(caller, req)
        # a caller's x-request-id is its correlation id and comes back as sent; ours is x-fleet-request-id
        ids = {"x-request-id": req.client_id or req.request_id, "x-fleet-request-id": req.request_id}
        if body.stream:  # the background task frees the slot if the caller left before streaming began
            return StreamingResponse(_sse(router, prepared, chat), media_type="text/event-stream",
                                     headers={**ids, **warning_headers(prepared)},
                                     background=BackgroundTask(router.release_unstarted, prepared))
        try:
            items = await _collect_unless_disconnected(request, router.stream(prepared))
        finally:
            router.release_unstarted(prepared)
        if items is None:  # the caller left: generation was stopped; nobody reads this answer
            return Response(status_code=499)
        text = "".join(i.text for i in items if isinstance(i, TokenDelta))
        final = next(i for i in items if isinstance(i, Finished))
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": final.finish_reason}
                  if chat else {"index": 0, "text": text, "finish_reason": final.finish_reason, "logprobs": None})
        return JSONResponse({"id": prepared.req.request_id, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": prepared.model.name,
                             "system_fingerprint": prepared.model.version, "choices": [choice],
                             "usage": _usage(final), **warning_fields(prepared)}, headers=ids)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, CompletionBody, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, ChatBody, chat=True)

    @app.post("/v1/requests/{request_id}/cancel")
    async def cancel_request(request_id: str, request: Request):
        """Cancel one of the caller's own in-flight requests by id (the `id` of its completion)."""
        caller = router.authenticate(_bearer(request))
        router.cancel(request_id, caller)
        return {"id": request_id, "cancelled": True}

    app.include_router(admin_router(router))
    http_security.install(app, lambda: router.registry.snapshot.admin_tokens)
    return app


def _client_request_id(request: Request) -> str:
    value = request.headers.get("x-request-id", "")
    if value and not CLIENT_ID_RE.match(value):
        raise RouterError("invalid_argument", f"header x-request-id: {value[:64]!r} is not allowed; use "
                                              f"{CLIENT_ID_RULE}")
    return value


def _describe(errors) -> str:
    problems = []
    for err in errors:
        loc = ".".join(str(p) for p in err["loc"] if p != "body") or "body"
        problems.append(f"{loc}: {err['msg']}")
    return "; ".join(problems)


async def _parse(request: Request, schema):
    """Parse the JSON body ourselves so every problem names its field (any Content-Type is accepted)."""
    data = parse_json(await read_body(request, MAX_BODY_BYTES))
    if not isinstance(data, dict):
        raise RouterError("invalid_argument", "body: must be a JSON object")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise RouterError("invalid_argument", _describe(exc.errors())) from exc


async def _collect_unless_disconnected(request: Request, stream) -> list | None:
    """All of a non-streamed answer, or None once the caller disconnects (the upstream call is cancelled,
    so the replica stops generating for nobody)."""
    async def collect() -> list:
        return [item async for item in stream]

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.create_task(collect()), asyncio.create_task(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work.cancel()
        raise
    finally:
        watch.cancel()
    if work.done():
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work
    return None


def _usage(final: Finished) -> dict:
    return {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens,
            "total_tokens": final.prompt_tokens + final.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": final.cached_prompt_tokens}}


async def _sse(router: Router, prepared: Prepared, chat: bool):
    req, created = prepared.req, int(time.time())
    base = {"id": req.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": prepared.model.name, "system_fingerprint": prepared.model.version}
    first = True
    try:
        async for item in router.stream(prepared):
            if isinstance(item, TokenDelta):
                if chat:
                    delta = {"content": item.text}
                    if first:
                        delta["role"] = "assistant"
                    choice = {"index": 0, "delta": delta, "finish_reason": None}
                else:
                    choice = {"index": 0, "text": item.text, "finish_reason": None, "logprobs": None}
                first = False
            else:
                choice = ({"index": 0, "delta": {}, "finish_reason": item.finish_reason} if chat
                          else {"index": 0, "text": "", "finish_reason": item.finish_reason, "logprobs": None})
                yield f"data: {json.dumps({**base, 'choices': [choice], 'usage': _usage(item)})}\n\n"
                continue
            yield f"data: {json.dumps({**base, 'choices': [choice]})}\n\n"
    except RouterError as exc:  # after the stream started, errors travel in-band
        yield f"data: {json.dumps({'error': {'message': exc.message, 'type': exc.code, 'code': exc.code}})}\n\n"
    yield "data: [DONE]\n\n"
