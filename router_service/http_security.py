"""What the callers' HTTP port checks before a handler runs: admin routes are authenticated from the headers
before a byte of their body is read, and the published API schema leaves the admin surface out
(docs/security.md, "The callers' port").

- `/admin/*`: the bearer token must be a named admin token (registry/admin_tokens.py); a write (any method but
  GET/HEAD) needs the `operator` role. A caller without one gets 401 (403 for a viewer writing) at once,
  whatever body it declares or sends, so an anonymous caller can make the router neither wait for nor
  buffer a body, and never learns what the body should look like (401 before 400). Then the body is read
  here with a cap (MAX_ADMIN_BODY_BYTES) and checked as JSON (http_body.parse_json: nesting, lone
  surrogates) before the handler sees it.
- `/openapi.json` (and `/docs`, `/redoc`, which load it) describe the public `/v1/*` API only.
"""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.datastructures import Headers

from registry.admin_tokens import AdminIdentity, match_admin_token
from router_service.errors import RouterError
from router_service.http_body import parse_json

ADMIN_PREFIX = "/admin"
MAX_ADMIN_BODY_BYTES = 256_000  # the largest admin body (a rollback rule, a split) is well under 1 kB
READ_METHODS = ("GET", "HEAD")


def bearer_token(headers: Mapping[str, str]) -> str:
    auth = headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else ""


def admin_identity(identities: tuple[AdminIdentity, ...], headers: Mapping[str, str], need: str) -> AdminIdentity:
    """The admin token's identity, or RouterError 401 (none / unknown) or 403 (a viewer where `need` is operator)."""
    token = bearer_token(headers)
    who = match_admin_token(identities, token) if token else None
    if who is None:
        raise RouterError("unauthenticated", "admin endpoints need 'authorization: Bearer <admin or viewer token>'")
    if need == "operator" and who.role != "operator":
        raise RouterError("permission_denied", f"{who.name!r} is a {who.role}; changing the fleet needs an "
                                               f"operator token")
    return who


class AdminGate:
    """ASGI middleware: authenticate /admin/* from the headers, then read and check a bounded body."""

    def __init__(self, app, identities: Callable[[], tuple[AdminIdentity, ...]]) -> None:
        self.app = app
        self.identities = identities

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(ADMIN_PREFIX):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        method = scope["method"].upper()
        try:
            admin_identity(self.identities(), headers, "viewer" if method in READ_METHODS else "operator")
            body = b"" if method in READ_METHODS else await _read_capped(headers, receive)
            if body.strip():
                parse_json(body)
        except RouterError as exc:
            await _refuse(send, exc)
            return
        await self.app(scope, _replay(body, receive) if method not in READ_METHODS else receive, send)


async def _read_capped(headers: Headers, receive) -> bytes:
    declared = headers.get("content-length")
    if declared is not None and not (declared.isascii() and declared.isdigit()):
        raise RouterError("invalid_argument", f"content-length: {declared[:32]!r} is not a byte count")
    if declared is not None and int(declared) > MAX_ADMIN_BODY_BYTES:
        raise RouterError("too_large", f"body: {declared} bytes is over the admin limit of {MAX_ADMIN_BODY_BYTES}")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_ADMIN_BODY_BYTES:
            raise RouterError("too_large", f"body: more than the admin limit of {MAX_ADMIN_BODY_BYTES} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive) -> Callable[[], Awaitable[dict]]:
    sent = False

    async def again() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # then the real channel: a disconnect
    return again


async def _refuse(send, exc: RouterError) -> None:
    payload = json.dumps({"error": {"message": exc.message, "type": exc.code, "code": exc.code}}).encode()
    await send({"type": "http.response.start", "status": exc.http_status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload})


def install(app: FastAPI, identities: Callable[[], tuple[AdminIdentity, ...]]) -> None:
    """Gate the admin routes and publish the public API's schema only."""
    app.add_middleware(AdminGate, identities=identities)

    def public_schema() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = public_only(get_openapi(title=app.title, version=app.version, routes=app.routes))
        return app.openapi_schema
    app.openapi = public_schema


def public_only(schema: dict) -> dict:
    """The schema without the admin paths and without the component schemas only they used."""
    paths = {p: v for p, v in schema.get("paths", {}).items() if not p.startswith(ADMIN_PREFIX)}
    components = schema.get("components", {}).get("schemas", {})
    keep: set[str] = set()
    todo = [paths]
    while todo:  # every component reachable from a public path, through $refs
        node = todo.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
                name = ref.rsplit("/", 1)[1]
                if name not in keep and name in components:
                    keep.add(name)
                    todo.append(components[name])
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    out = {**schema, "paths": paths}
    if "components" in schema:
        out["components"] = {**schema["components"], "schemas": {k: v for k, v in components.items() if k in keep}}
    return out
