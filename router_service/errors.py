"""Errors the router returns to callers, with their gRPC status, HTTP code and OpenAI error type in one place.

Every error names the request field it is about (`param`, None when no one field is to blame), so the HTTP
frontend can answer OpenAI's error object `{"message", "type", "param", "code"}` and gRPC callers get the same
message with the matching status code."""
from __future__ import annotations

from dataclasses import dataclass

import grpc

# code -> (gRPC status, HTTP status, OpenAI error type)
_CODES = {
    "invalid_argument": (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    # prompt + max_tokens over the model's context (OpenAI's own code for it, so SDK users can match on it)
    "context_length_exceeded": (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    "too_large": (grpc.StatusCode.INVALID_ARGUMENT, 413, "invalid_request_error"),
    "unauthenticated": (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
    "permission_denied": (grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error"),
    "not_found": (grpc.StatusCode.NOT_FOUND, 404, "not_found_error"),
    "method_not_allowed": (grpc.StatusCode.UNIMPLEMENTED, 405, "invalid_request_error"),
    "resource_exhausted": (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    "deadline_exceeded": (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error"),
    "unavailable": (grpc.StatusCode.UNAVAILABLE, 503, "server_error"),
    "internal": (grpc.StatusCode.INTERNAL, 500, "server_error"),
    "cancelled": (grpc.StatusCode.CANCELLED, 499, "cancelled"),
    # the replicas serving the request died or hung while streaming it (see stream_proxy.MAX_REPLICA_KILLS)
    "replica_failure": (grpc.StatusCode.ABORTED, 502, "server_error"),
    # the replica's engine refused the request before generating (its message is passed on)
    "engine_refused": (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
}


@dataclass
class RouterError(Exception):
    code: str
    message: str
    retry_after_ms: int | None = None
    param: str | None = None   # the request field at fault (OpenAI's `param`)

    def __post_init__(self) -> None:
        super().__init__(self.message)
        if self.code not in _CODES:
            raise ValueError(f"unknown router error code {self.code!r}")

    @property
    def grpc_status(self) -> grpc.StatusCode:
        return _CODES[self.code][0]

    @property
    def http_status(self) -> int:
        return _CODES[self.code][1]

    @property
    def error_type(self) -> str:
        """OpenAI's error `type` for this code."""
        return _CODES[self.code][2]

    def openai(self) -> dict:
        """The OpenAI error object (HTTP bodies and in-band stream errors)."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


# a stopping router's refusals: retry at once, elsewhere (this router's listeners are closed, so a new connection
# reaches another router); HTTP rounds it up to `Retry-After: 1`
STOPPING_RETRY_AFTER_MS = 100


def router_stopping(request_id: str, queued_s: float | None = None) -> RouterError:
    """UNAVAILABLE for a request a stopping router will not start (docs/router.md, Stopping)."""
    where = "arrived" if queued_s is None else f"waited {queued_s:.2f} s in the admission queue"
    return RouterError("unavailable", f"router is stopping: request {request_id} {where} and was not started; "
                                      f"retry elsewhere (a new connection reaches another router)",
                       STOPPING_RETRY_AFTER_MS)


def invalid(field: str, why: str, code: str = "invalid_argument") -> RouterError:
    return RouterError(code, f"{field}: {why}", param=field)
