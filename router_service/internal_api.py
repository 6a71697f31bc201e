"""The router's internal listener: replica state reports, never on the callers' port.

Who may call it: registered replicas only. It listens on its own address (`--internal-host`, loopback by
default; a pod-network address plus a NetworkPolicy in Kubernetes) and every report must carry a fresh
signature by the reporting replica's own key (common/report_channel.py). The signed head (replica, time,
body length) is checked from the headers before any byte of the body is read, and then only that many
bytes are read (at most MAX_REPORT_BYTES): a peer without the key makes the router hold no body. A report
is refused (401/403/404) when unsigned, signed by another key, stale, or from a replica the registry does
not know; it is refused
(400) when it does not fit the `ReplicaReport` schema. Reports feed routing hints only: they can never lift
a cordon (see `Router.serving_replicas`).

`POST /internal/report-key` (only with a `TokenReviewer`, i.e. in Kubernetes): a replica pod trades its
pod-bound ServiceAccount token for its own report key (common/report_key_exchange.py); 401 for any token the
API server does not vouch for as a replica pod's.

`GET /metrics` is this router's own Prometheus page (the same as on the callers' port): behind a port shared
by several routers (SO_REUSEPORT) the metrics scraper reads each router here.
"""
from __future__ import annotations

import asyncio
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from common.report_channel import (REPLICA_HEADER, REPORT_PATH, SIGNATURE_HEADER, ReportAuthError, replica_key,
                                   verify_report, verify_report_head)
from common.report_key_exchange import KEY_PATH, MAX_TOKEN_BYTES, KeyExchangeError, TokenReviewer
from router_service import metrics
from router_service.core import Router
from router_service.errors import RouterError
from router_service.http_body import read_body
from router_service.metrics import prometheus_page
from router_service.tracing import FASTAPI_TELEMETRY
from common.replica_report import ReplicaReport

log = logging.getLogger(__name__)
MAX_REPORT_BYTES = 32_000_000  # a full snapshot of 1M prefix hashes


def _describe(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'report'}: {e['msg']}" for e in exc.errors()[:5])


def create_internal_app(router: Router, secret: bytes, reviewer: TokenReviewer | None = None) -> FastAPI:
    app = FastAPI(title="LLM fleet router (internal)", version="0.1.0", docs_url=None, redoc_url=None,
                  openapi_url=None, telemetry=FASTAPI_TELEMETRY)  # state reports are not traced

    @app.exception_handler(RouterError)
    async def _router_error(_req: Request, exc: RouterError):
        metrics.REPORTS_REFUSED.labels(exc.code).inc()
        return JSONResponse({"error": {"message": exc.message, "code": exc.code}}, status_code=exc.http_status)

    @app.post(REPORT_PATH)
    async def replica_state(request: Request):
        replica_id = request.headers.get(REPLICA_HEADER, "")
        if not replica_id:
            raise RouterError("unauthenticated", f"{REPLICA_HEADER}: missing; say which replica reports")
        if replica_id not in {r.replica_id for r in router.registry.snapshot.replicas}:
            raise RouterError("not_found", f"{REPLICA_HEADER}: replica {replica_id[:128]!r} is not registered")
        header = request.headers.get(SIGNATURE_HEADER)
        try:
            # what the headers prove comes first: without the replica's key a peer makes us read no body
            length = verify_report_head(secret, replica_id, header)
        except ReportAuthError as exc:
            log.warning("refused a state report for %s: %s", replica_id, exc)
            raise RouterError("unauthenticated", str(exc)) from exc
        if length > MAX_REPORT_BYTES:
            raise RouterError("too_large", f"report: {length} bytes is over the limit of {MAX_REPORT_BYTES} bytes")
        body = await read_body(request, length)
        try:
            if len(body) != length:
                raise ReportAuthError(f"body: {len(body)} bytes, but {length} were signed for")
            verify_report(secret, replica_id, body, header)
        except ReportAuthError as exc:
            log.warning("refused a state report for %s: %s", replica_id, exc)
            raise RouterError("unauthenticated", str(exc)) from exc
        try:
            report = ReplicaReport.model_validate(json.loads(body))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RouterError("invalid_argument", f"report: not valid JSON ({exc})") from exc
        except ValidationError as exc:
            raise RouterError("invalid_argument", _describe(exc)) from exc
        if report.replica_id != replica_id:
            raise RouterError("permission_denied", f"replica_id: {report.replica_id!r} does not match the signing "
                                                   f"replica {replica_id!r}")
        router.replica_state.apply(report)
        return {"ok": True}

    if reviewer is not None:
        @app.post(KEY_PATH)
        async def report_key(request: Request):
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not token or len(token) > MAX_TOKEN_BYTES:
                raise RouterError("unauthenticated", "authorization: expected 'Bearer <the pod's projected "
                                                     f"ServiceAccount token for {reviewer.audience!r}>'")
            try:
                pod = await asyncio.to_thread(reviewer.pod_of, token)
            except KeyExchangeError as exc:
                log.warning("refused a report key: %s", exc)
                raise RouterError("unauthenticated", str(exc)) from exc
            except OSError as exc:  # the API server is unreachable: the sidecar retries
                raise RouterError("unavailable", f"token review: the Kubernetes API did not answer ({exc})") from exc
            log.info("issued the report key of replica pod %s", pod)
            return {"replica_id": pod, "report_key": replica_key(secret, pod)}

    app.add_api_route("/metrics", prometheus_page(router), methods=["GET"])

    return app
