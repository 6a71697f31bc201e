"""Errors the router returns to callers, with their gRPC status and HTTP code in one place."""
from __future__ import annotations

from dataclasses import dataclass

import grpc

_CODES = {
    "invalid_argument": (grpc.StatusCode.INVALID_ARGUMENT, 400),
    "too_large": (grpc.StatusCode.INVALID_ARGUMENT, 413),
    "unauthenticated": (grpc.StatusCode.UNAUTHENTICATED, 401),
    "permission_denied": (grpc.StatusCode.PERMISSION_DENIED, 403),
    "not_found": (grpc.StatusCode.NOT_FOUND, 404),
    "resource_exhausted": (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    "deadline_exceeded": (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    "unavailable": (grpc.StatusCode.UNAVAILABLE, 503),
    "internal": (grpc.StatusCode.INTERNAL, 500),
    "cancelled": (grpc.StatusCode.CANCELLED, 499),
    # the replicas serving the request died or hung while streaming it (see core.MAX_REPLICA_KILLS)
    "replica_failure": (grpc.StatusCode.ABORTED, 502),
}


@dataclass
class RouterError(Exception):
    code: str
    message: str
    retry_after_ms: int | None = None

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


def invalid(field: str, why: str) -> RouterError:
    return RouterError("invalid_argument", f"{field}: {why}")
