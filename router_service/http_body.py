"""Reading an HTTP request body: a size cap enforced before and while reading it, and JSON parsing that
turns every malformed body into a clear 400 naming the field (never a 500).

A declared Content-Length over the cap is refused without reading a byte; a chunked or lying body is cut
off as soon as the bytes received pass the cap, so no caller can make the router buffer more than `limit`.
JSON: nesting deeper than MAX_JSON_DEPTH is refused (Python's parser would hit its recursion limit: a 500),
and so is a string holding a lone UTF-16 surrogate (`"\\ud800"` is a valid JSON escape but not text: the
tokenizer, the usage event and the replica cannot take it).
"""
from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from router_service.errors import RouterError, invalid

MAX_JSON_DEPTH = 32  # the deepest legitimate body (chat messages with content parts) is 5 levels
_SCALARS = {int, float, bool, type(None)}


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


def parse_json(raw: bytes, what: str = "body") -> Any:
    """The JSON value of `raw`, or a RouterError (400) naming the problem and where it is."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid(what, f"not valid JSON ({exc})") from exc
    except RecursionError:
        raise invalid(what, f"JSON nested too deeply; at most {MAX_JSON_DEPTH} levels are allowed") from None
    check_json(data, what)
    return data


def check_json(data: Any, what: str = "body") -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH and strings (keys too) that are not valid Unicode text."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:  # iterative: a deep value must not exhaust the interpreter's stack here either
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise invalid(path or what, f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, str):
            _check_text(value, path or what)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, f"{path}.{key!r}" if path else repr(key))
                stack.append((item, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(value, list) and not set(map(type, value)) <= _SCALARS:  # (token ids: nothing to check)
            stack.extend((item, f"{path}[{i}]" if path else f"[{i}]", depth + 1) for i, item in enumerate(value)
                         if isinstance(item, (str, list, dict)))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise invalid(where, f"contains a lone UTF-16 surrogate (\\u{ord(bad):04x}) at character {exc.start}, which is "
                             f"not text; send valid Unicode (a surrogate pair escapes one character)") from None
