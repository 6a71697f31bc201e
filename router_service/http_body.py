"""Reading an HTTP request body with a size cap enforced before and while reading it.

A declared Content-Length over the cap is refused without reading a byte; a chunked or lying body is cut
off as soon as the bytes received pass the cap, so no caller can make the router buffer more than `limit`.
"""
from __future__ import annotations

from fastapi import Request

from router_service.errors import RouterError, invalid


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise invalid("content-length", f"{declared[:32]!r} is not a byte count")
        if int(declared) > limit:
            raise RouterError("too_large", f"body: {declared} bytes is over the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RouterError("too_large", f"body: more than {limit} bytes; the limit is {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
