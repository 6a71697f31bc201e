"""HTTP frontend: OpenAI-compatible `/v1/*` with SSE streaming, admin endpoints, state reports, /metrics."""
from __future__ import annotations

import json
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from router_service.admin_api import admin_router
from router_service.core import Router
from router_service.errors import RouterError
from router_service.metrics import refresh_replica_gauges
from router_service.openai_schema import ChatBody, CompletionBody
from router_service.request import TIERS, Finished, Prepared, TokenDelta


MAX_BODY_BYTES = 4_000_000


def _error(status: int, code: str, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": code, "code": code}}, status_code=status,
                        headers=headers)


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


def create_app(router: Router, admin_tokens: dict[str, str]) -> FastAPI:
    """admin_tokens: token -> role (`operator` or `viewer`)."""
    app = FastAPI(title="LLM fleet router", version="0.1.0")

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

    @app.get("/metrics")
    async def prometheus():
        refresh_replica_gauges(router)
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        router.authenticate(_bearer(request))
        snap = router.registry.snapshot
        data = [{"id": name, "object": "model", "owned_by": "fleet", "versions": sorted(versions),
                 "routes": snap.routes.get(name, {}), "tiers": list(TIERS),
                 "status": {v: info.status for v, info in sorted(versions.items())},
                 "max_context": max(v.max_context for v in versions.values())}
                for name, versions in sorted(snap.models.items())]
        return {"object": "list", "data": data}

    async def run(request: Request, schema: type[CompletionBody] | type[ChatBody], chat: bool):
        caller = router.authenticate(_bearer(request))
        body = await _parse(request, schema)
        prepared = await router.prepare(caller, body.request())
        if body.stream:  # the background task frees the slot if the caller left before streaming began
            return StreamingResponse(_sse(router, prepared, chat), media_type="text/event-stream",
                                     headers={"x-request-id": prepared.req.request_id},
                                     background=BackgroundTask(router.release_unstarted, prepared))
        try:
            items = [item async for item in router.stream(prepared)]
        finally:
            router.release_unstarted(prepared)
        text = "".join(i.text for i in items if isinstance(i, TokenDelta))
        final = next(i for i in items if isinstance(i, Finished))
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": final.finish_reason}
                  if chat else {"index": 0, "text": text, "finish_reason": final.finish_reason, "logprobs": None})
        return {"id": prepared.req.request_id, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": prepared.model.name, "system_fingerprint": prepared.model.version,
                "choices": [choice], "usage": _usage(final)}

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

    @app.post("/internal/replica-state")
    async def replica_state(report: dict):
        try:
            router.replica_state.apply(report)
        except ValueError as exc:
            raise RouterError("invalid_argument", str(exc)) from exc
        return {"ok": True}

    app.include_router(admin_router(router, admin_tokens))
    return app


def _describe(errors) -> str:
    problems = []
    for err in errors:
        loc = ".".join(str(p) for p in err["loc"] if p != "body") or "body"
        problems.append(f"{loc}: {err['msg']}")
    return "; ".join(problems)


async def _parse(request: Request, schema):
    """Parse the JSON body ourselves so every problem names its field (any Content-Type is accepted)."""
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise RouterError("invalid_argument", f"body: {len(raw)} bytes is over the limit of {MAX_BODY_BYTES} bytes")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RouterError("invalid_argument", f"body: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise RouterError("invalid_argument", "body: must be a JSON object")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise RouterError("invalid_argument", _describe(exc.errors())) from exc


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
