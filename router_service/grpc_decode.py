"""Requests whose protobuf bytes do not parse get INVALID_ARGUMENT naming the problem, never UNKNOWN.

grpc runs the request deserializer before any servicer code; a proto `string` field that is not UTF-8
(e.g. `model_name`) makes protobuf raise DecodeError there, which grpc reports as `UNKNOWN Unexpected
DecodeError`. `DecodeGuard` (a server interceptor) wraps each method's deserializer: an undecodable request
becomes an `Undecodable` naming the first bad field (found by walking the wire format against the message's
descriptor); a unary call is aborted with INVALID_ARGUMENT, and on a stream the servicer answers that one
request in-band (grpc_frontend.KServeServicer._run) while the others go on.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError


@dataclass
class Undecodable:
    """Stands in for a request that did not parse; empty ids so in-band errors can still be addressed."""
    message: str
    id: str = ""
    model_name: str = ""
    model_version: str = ""


def explain(raw: bytes, descriptor: Descriptor) -> str:
    where = _bad_string(raw, descriptor, "")
    if where:
        return (f"{where}: not valid UTF-8; protobuf string fields must be UTF-8 text (send raw bytes in a "
                f"BYTES tensor)")
    return f"the request is not a valid {descriptor.full_name} message"


def _varint(raw: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(raw) or shift > 63:
            raise ValueError("truncated varint")
        b = raw[i]
        value |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            return value, i
        shift += 7


def _bad_string(raw: bytes, descriptor: Descriptor, path: str, depth: int = 0) -> str | None:
    """The path of the first string field holding invalid UTF-8, or None (also on malformed wire data)."""
    if depth > 32:
        return None
    counts: dict[int, int] = {}
    i = 0
    try:
        while i < len(raw):
            key, i = _varint(raw, i)
            number, wire = key >> 3, key & 7
            if wire == 0:
                _, i = _varint(raw, i)
            elif wire == 1:
                i += 8
            elif wire == 5:
                i += 4
            elif wire == 2:
                size, i = _varint(raw, i)
                chunk, i = raw[i:i + size], i + size
                field = descriptor.fields_by_number.get(number)
                if field is None:
                    continue
                index = counts.get(number, 0)
                counts[number] = index + 1
                name = f"{path}.{field.name}" if path else field.name
                if field.is_repeated and not (field.message_type and field.message_type.GetOptions().map_entry):
                    name += f"[{index}]"
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    found = _bad_string(chunk, field.message_type, name, depth + 1)
                    if found:
                        return found
            else:
                return None
    except ValueError:
        return None
    return None


def _guarded(deserialize: Callable[[bytes], object], descriptor: Descriptor | None) -> Callable[[bytes], object]:
    def parse(raw: bytes) -> object:
        try:
            return deserialize(raw)
        except DecodeError:
            return Undecodable(explain(raw, descriptor) if descriptor is not None else "the request does not parse")
    return parse


class DecodeGuard(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        owner = getattr(handler.request_deserializer, "__self__", None)
        descriptor = getattr(owner, "DESCRIPTOR", None)
        parse = _guarded(handler.request_deserializer, descriptor)
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                if isinstance(request, Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                return await inner(request, context)
            return grpc.unary_unary_rpc_method_handler(unary, parse, handler.response_serializer)
        return handler._replace(request_deserializer=parse)  # streams: the servicer answers in-band
