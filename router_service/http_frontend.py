"""HTTP frontend on the callers' port: OpenAI-compatible `/v1/*` with SSE streaming, admin endpoints, /metrics.

Who may call it: callers with an API key (`/v1/*`), operators and viewers with a named admin token
(`/admin/*`); `/health` and `/metrics` are open. Replica state reports are not here: they go to the internal
listener (internal_api.py)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
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
from router_service.openai_response import choice, sse, usage
from router_service.openai_schema import ChatBody, CompletionBody
from router_service.request import MAX_N, TIERS, Finished, GenerateRequest, Prepared
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
        arrived = time.monotonic()  # the request's total deadline counts from here (body upload included)
        caller = router.authenticate(_bearer(request))
        body = await _parse(request, schema)
        req = body.request()
        req.client_id = _client_id(request)
        plan = body.tool_plan() if chat else None
        prepared: list[Prepared] = []
        try:   # `n` choices are n requests sharing the prompt (the choices' own seeds; the prompt billed once)
            for r in [req] + [fork(req, i) for i in range(1, body.n)]:
                prepared.append(await router.prepare(caller, r, arrived))
        except BaseException:
            for p in prepared:
                router.release_unstarted(p)
            raise
        headers = {"x-request-id": req.client_id or req.request_id, "x-fleet-request-id": req.request_id}
        if body.stream:
            # The first items are awaited before the status line, so a refusal (engine, replicas) is a 4xx/5xx
            # with its message; after that, errors travel in-band. Choice 0 goes first: once it has a token its
            # prompt's blocks are in the replica's prefix cache, which the other choices then reuse. The
            # background task frees the slots of choices whose stream never ran.
            streams = [router.stream(p) for p in prepared]
            try:
                firsts = [await _until_disconnected(request, anext(streams[0]))]
                if firsts[0] is not None and len(streams) > 1:
                    rest = await _until_disconnected(request, _first_items(streams[1:]))
                    firsts = None if rest is None else firsts + list(rest)
            except BaseException:
                await _close_all(router, streams, prepared)
                raise
            if firsts is None or firsts[0] is None:
                await _close_all(router, streams, prepared)
                return Response(status_code=499)
            sources = [_source(f, s) for f, s in zip(firsts, streams)]
            return StreamingResponse(sse(router, sources, prepared, chat, body.include_usage, plan),
                                     media_type="text/event-stream",
                                     headers={**headers, **warning_headers(prepared[0])},
                                     background=BackgroundTask(_release_all, router, prepared))
        try:
            collected = await _until_disconnected(request, _collect_all(router, prepared))
        finally:
            _release_all(router, prepared)
        if collected is None:  # the caller left: generation was stopped; nobody reads this answer
            return Response(status_code=499)
        choices = [choice(router, i, p, items, chat, plan) for i, (p, items) in enumerate(zip(prepared, collected))]
        finals = [next(i for i in items if isinstance(i, Finished)) for items in collected]
        return JSONResponse({"id": req.request_id, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": prepared[0].model.name,
                             "system_fingerprint": prepared[0].model.version, "choices": choices,
                             "usage": usage(finals), **warning_fields(prepared[0])}, headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, CompletionBody, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, ChatBody, chat=True)

    @app.post("/v1/requests/{request_id}/cancel")
    async def cancel_request(request_id: str, request: Request):
        """Cancel one of the caller's own in-flight requests by id (the `id` of its completion), with all its
        `n` choices (router ids `<id>-<i>`, see fork)."""
        caller = router.authenticate(_bearer(request))
        router.cancel(request_id, caller)
        for i in range(1, MAX_N):
            with contextlib.suppress(RouterError):   # choices already finished, or an n smaller than i
                router.cancel(f"{request_id}-{i}", caller)
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


def fork(req: GenerateRequest, i: int) -> GenerateRequest:
    """Choice i (> 0) of an `n` request: id `<id>-<i>` (its usage event's key), its own seed (seed + i when the
    caller set one), no prompt billing."""
    seed = (req.seed + i) % 2**64 if req.seed is not None else None
    return dataclasses.replace(req, request_id=f"{req.request_id}-{i}", seed=seed, bill_prompt=False)


async def _source(first, stream):
    try:
        yield first
        async for item in stream:
            yield item
    finally:
        await stream.aclose()


async def _collect_all(router: Router, prepared: list[Prepared]) -> list[list]:
    """Every choice's items; choice 0 alone until its first token (its prompt blocks then serve the rest)."""
    streams = [router.stream(p) for p in prepared]
    tasks: list[asyncio.Future] = []
    try:
        first = await anext(streams[0])
        tasks = [asyncio.ensure_future(_collect(s)) for s in streams[1:]]
        head = await _collect(streams[0])
        return [[first] + head] + [await t for t in tasks]
    finally:
        await _stop(tasks)
        for s in streams:
            await s.aclose()


async def _first_items(streams: list) -> list:
    tasks = [asyncio.ensure_future(anext(s)) for s in streams]
    try:
        return [await t for t in tasks]
    finally:
        await _stop(tasks)


async def _stop(tasks: list[asyncio.Future]) -> None:
    """Cancel and await `tasks` (a stream must not be closed while a task still iterates it)."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _close_all(router: Router, streams: list, prepared: list[Prepared]) -> None:
    for s in streams:
        await s.aclose()
    _release_all(router, prepared)


def _release_all(router: Router, prepared: list[Prepared]) -> None:
    for p in prepared:
        router.release_unstarted(p)
