"""Prometheus metrics of the router, served at HTTP /metrics."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)

REQUESTS = Counter("fleet_router_requests_total", "Requests finished, by model, tier and outcome",
                   ["model", "tier", "status"])
REJECTED = Counter("fleet_router_rejected_total", "Requests refused before routing, by error code", ["code"])
TTFT = Histogram("fleet_router_ttft_seconds", "Time from request arrival to first streamed token",
                 ["model", "tier"], buckets=LATENCY_BUCKETS)
QUEUE_WAIT = Histogram("fleet_router_queue_wait_seconds", "Time a request waited for a replica",
                       ["model", "tier"], buckets=LATENCY_BUCKETS)
TOKENS = Counter("fleet_router_completion_tokens_total", "Completion tokens streamed to callers", ["model", "tier"])
PROMPT_TOKENS = Counter("fleet_router_prompt_tokens_total", "Prompt tokens routed", ["model", "tier"])
INFLIGHT = Gauge("fleet_router_inflight_requests", "Streams in flight per replica", ["replica"])
RESUMES = Counter("fleet_router_resumes_total", "Streams resumed on another replica after a failure", ["model"])
