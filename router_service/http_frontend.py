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
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic import ValidationError

from router_service import http_security
from router_service.admin_api import admin_router
from router_service.budgets import warning_fields, warning_headers
from router_service.core import Router
from common.names import CLIENT_ID_RE, CLIENT_ID_RULE
from router_service.errors import RouterError, invalid
from router_service.http_body import parse_json, read_body
from router_service.metrics import prometheus_page
from router_service.openai_schema import ChatBody, CompletionBody
from router_service.request import TIERS, Finished, Prepared, TokenDelta
from router_service.tracing import FASTAPI_TELEMETRY, TracingMiddleware
from router_service.visibility import visible_models


MAX_BODY_BYTES = 4_000_000


def _error(exc: RouterError, headers: dict | None = None) -> JSONResponse:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return JSONResponse(exc.openai(), status_code=exc.http_status, headers=headers)


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 401: "unauthenticated", 403: "permission_denied",
               413: "too_large"}


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


def create_app(router: Router) -> FastAPI:
    app = FastAPI(title="LLM fleet router", version="0.1.0", telemetry=FASTAPI_TELEMETRY)
    app.add_middleware(TracingMiddleware)  # spans, caller trace context, access log (router_service.tracing)

    @app.exception_handler(RouterError)
    async def _router_error(_req: Request, exc: RouterError):
        headers = {"Retry-After": str(max(1, exc.retry_after_ms // 1000))} if exc.retry_after_ms else None
        return _error(exc, headers)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_req: Request, exc: RequestValidationError):
        return _error(_validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(req: Request, exc: StarletteHTTPException):
        """Unknown routes and methods answer in OpenAI's error shape too (not FastAPI's {"detail": ...})."""
        code = _HTTP_CODES.get(exc.status_code, "invalid_argument" if exc.status_code < 500 else "internal")
        message = (f"no route {req.method} {req.url.path}" if exc.status_code == 404 else
                   f"method {req.method} is not allowed on {req.url.path}" if exc.status_code == 405 else str(exc.detail))
        err = RouterError(code, message)
        return JSONResponse(err.openai(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

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

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        caller = router.authenticate(_bearer(request))
        snap = router.registry.snapshot
        versions = visible_models(snap, caller).get(model_id)
        if versions is None:  # the same answer for a model that does not exist and one the caller may not see
            raise RouterError("not_found", f"model: {model_id[:128]!r} does not exist", param="model")
        return {"id": model_id, "object": "model", "owned_by": "fleet", "versions": sorted(versions),
                "max_context": max(v.max_context for v in snap.models[model_id].values())}

    async def run(request: Request, schema: type[CompletionBody] | type[ChatBody], chat: bool):
        caller = router.authenticate(_bearer(request))
        body = await _parse(request, schema)
        req = body.request()
        req.client_id = _client_id(request)
        prepared = await router.prepare(caller, req)
        headers = {"x-request-id": req.client_id or req.request_id, "x-fleet-request-id": req.request_id}
        if body.stream:
            # The first item is awaited before the status line, so a refusal (engine, replicas) is a 4xx/5xx
            # with its message; after that, errors travel in-band. The background task frees the slot if the
            # caller left before streaming began.
            stream = router.stream(prepared)
            try:
                first = await _until_disconnected(request, anext(stream))
            except BaseException:
                await stream.aclose()
                router.release_unstarted(prepared)
                raise
            if first is None:
                await stream.aclose()
                return Response(status_code=499)
            return StreamingResponse(_sse(router, first, stream, prepared, chat, body.include_usage),
                                     media_type="text/event-stream",
                                     headers={**headers, **warning_headers(prepared)},
                                     background=BackgroundTask(router.release_unstarted, prepared))
        try:
            items = await _until_disconnected(request, _collect(router.stream(prepared)))
        finally:
            router.release_unstarted(prepared)
        if items is None:  # the caller left: generation was stopped; nobody reads this answer
            return Response(status_code=499)
        text = "".join(i.text for i in items if isinstance(i, TokenDelta))
        final = next(i for i in items if isinstance(i, Finished))
        lps = _logprobs(router, prepared, [i for i in items if isinstance(i, TokenDelta)], chat)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lps,
                   "finish_reason": final.finish_reason}
                  if chat else {"index": 0, "text": text, "finish_reason": final.finish_reason, "logprobs": lps})
        return JSONResponse({"id": prepared.req.request_id, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": prepared.model.name,
                             "system_fingerprint": prepared.model.version, "choices": [choice],
                             "usage": _usage(final), **warning_fields(prepared)}, headers=headers)

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


def _loc(err: dict) -> str:
    return ".".join(str(p) for p in err["loc"] if p != "body") or "body"


def _validation_error(errors) -> RouterError:
    """One 400 listing every problem; `param` is the first field at fault."""
    message = "; ".join(f"{_loc(err)}: {err['msg']}" for err in errors)
    return RouterError("invalid_argument", message, param=_loc(errors[0]) if errors else None)


def _client_id(request: Request) -> str:
    """The caller's own `x-request-id` (or OpenAI's `x-client-request-id`), echoed back for correlation only."""
    value = request.headers.get("x-request-id") or request.headers.get("x-client-request-id") or ""
    if value and not CLIENT_ID_RE.match(value):
        raise invalid("x-request-id", f"the header may have {CLIENT_ID_RULE}")
    return value


async def _parse(request: Request, schema):
    """Parse the JSON body ourselves so every problem names its field (any Content-Type is accepted)."""
    data = parse_json(await read_body(request, MAX_BODY_BYTES))
    if not isinstance(data, dict):
        raise RouterError("invalid_argument", "body: must be a JSON object")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc.errors()) from exc


async def _collect(stream) -> list:
    return [item async for item in stream]


async def _until_disconnected(request: Request, awaitable):
    """`awaitable`'s result, or None once the caller disconnects (the work is cancelled, so the replica
    stops generating for nobody)."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(awaitable), asyncio.create_task(disconnected())
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


def _logprobs(router: Router, p: Prepared, deltas: list[TokenDelta], chat: bool) -> dict | None:
    """OpenAI's logprobs object of these deltas (chat: `content` entries; completions: the legacy lists).
    Each token's text is the id decoded alone."""
    if not (p.req.logprobs or p.req.top_logprobs):
        return None
    tok = router.tokenizers.get(p.model.weights_uri)
    pairs = [(i, lp) for d in deltas for i, lp in zip(d.token_ids, d.logprobs or [])]

    def text(token_id: int) -> str:
        return tok.decode([token_id])
    if chat:
        def entry(t: int, lp: float) -> dict:
            s = text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]} for t, (lp, top) in pairs]}
    offsets, at = [], 0
    for t, _ in pairs:
        offsets.append(at)
        at += len(text(t))
    return {"tokens": [text(t) for t, _ in pairs], "token_logprobs": [lp for _, (lp, _) in pairs],
            "top_logprobs": [{text(i): v for i, v in top} for _, (_, top) in pairs], "text_offset": offsets}


def _chunk(item: TokenDelta | Finished, chat: bool, first: bool, logprobs: dict | None = None) -> dict:
    """The one choice of a streamed chunk."""
    if isinstance(item, TokenDelta):
        if chat:
            delta = {"role": "assistant", "content": item.text} if first else {"content": item.text}
            return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": None}
        return {"index": 0, "text": item.text, "logprobs": logprobs, "finish_reason": None}
    if chat:
        return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": item.finish_reason}
    return {"index": 0, "text": "", "logprobs": None, "finish_reason": item.finish_reason}


async def _sse(router: Router, first_item: TokenDelta | Finished, stream, prepared: Prepared, chat: bool,
               include_usage: bool):
    """Server-sent events as OpenAI streams them. With `stream_options.include_usage` every chunk carries
    `usage: null` and one last chunk has `choices: []` and the usage; without it the finishing chunk carries
    the usage (an extension the SDKs ignore). Usage is metered either way."""
    req, created = prepared.req, int(time.time())
    base = {"id": req.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": prepared.model.name, "system_fingerprint": prepared.model.version}
    if include_usage:
        base["usage"] = None
    first = True

    async def items():
        yield first_item
        async for item in stream:
            yield item
    try:
        async for item in items():
            lps = _logprobs(router, prepared, [item], chat) if isinstance(item, TokenDelta) else None
            chunk = {**base, "choices": [_chunk(item, chat, first, lps)]}
            if isinstance(item, TokenDelta):
                first = False
            elif not include_usage:
                chunk["usage"] = _usage(item)
            yield f"data: {json.dumps(chunk)}\n\n"
            if isinstance(item, Finished) and include_usage:
                yield f"data: {json.dumps({**base, 'choices': [], 'usage': _usage(item)})}\n\n"
    except RouterError as exc:  # after the stream started, errors travel in-band, in OpenAI's error shape
        yield f"data: {json.dumps(exc.openai())}\n\n"
    finally:
        await stream.aclose()
    yield "data: [DONE]\n\n"
