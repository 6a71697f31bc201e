"""Prometheus metrics of the router, served at HTTP /metrics. Every metric is documented (name, type, labels,
meaning) in docs/observability.md; alert and recording rules and dashboards (deploy/monitoring) query them."""
from __future__ import annotations

from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)
RATE_BUCKETS = (1, 2, 5, 10, 20, 40, 60, 100, 200, 500)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
LENGTH_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

# the outcome only: why a stream ended is fleet_router_finished_total's finish_reason (one family per question)
REQUESTS = Counter("fleet_router_requests_total", "Requests finished, by model, tier, outcome (ok, error, "
                   "cancelled)", ["model", "tier", "status"])
REJECTED = Counter("fleet_router_rejected_total", "Requests refused before routing, by error code", ["code"])
TTFT = Histogram("fleet_router_ttft_seconds", "Time from request arrival to first streamed token",
                 ["model", "tier"], buckets=LATENCY_BUCKETS)
QUEUE_WAIT = Histogram("fleet_router_queue_wait_seconds", "Time a request waited in the admission queue for a "
                       "replica slot", ["model", "tier"], buckets=LATENCY_BUCKETS)
DISPATCH = Histogram("fleet_router_dispatch_seconds", "Router time from request arrival to the upstream call "
                     "(auth, tokenisation, quota, admission queue, replica choice)", ["model", "tier"],
                     buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5))
QUEUE_DEPTH = Gauge("fleet_router_queue_depth", "Requests waiting in the admission queue", ["model", "tier"])
STREAM_TOKENS_PER_S = Histogram("fleet_router_stream_tokens_per_second", "Decode rate of each finished stream "
                                "(completion tokens after the first / time since the first token)",
                                ["model", "tier"], buckets=RATE_BUCKETS)
TOKENS = Counter("fleet_router_completion_tokens_total", "Completion tokens streamed to callers", ["model", "tier"])
# Both prompt counters count a request's prompt once, as billing does (usage events): the n choices of an `n`
# request share one prompt (GenerateRequest.bill_prompt), so choices 2..n add nothing here.
PROMPT_TOKENS = Counter("fleet_router_prompt_tokens_total", "Prompt tokens routed (once per request; the n "
                        "choices of a request share its prompt, as billed)", ["model", "tier"])
CACHED_PROMPT_TOKENS = Counter("fleet_router_cached_prompt_tokens_total", "Prompt tokens the replica served from "
                               "its prefix cache (as the replica reported; once per request, as billed)",
                               ["model", "tier"])
SHED = Counter("fleet_router_shed_total", "Requests refused or dropped by admission (queue_full; deadline: the "
               "caller's deadline_ms or total deadline passed while queued; stream_deadline: the tier's total stream "
               "deadline passed while queued; stopping: the router is stopping)", ["model", "tier", "reason"])
INFLIGHT = Gauge("fleet_router_inflight_requests", "Streams in flight per replica", ["replica"])
PLACEMENTS = Counter("fleet_router_placements_total", "Replica choices by policy (cost, round_robin) and region "
                     "(home, overflow)", ["model", "policy", "region"])
RETRIES = Counter("fleet_router_retries_total", "Attempts on another replica after a replica failure", ["model"])
RESUMES = Counter("fleet_router_resumes_total", "Streams resumed on another replica after tokens were emitted",
                  ["model"])
CORDONS = Counter("fleet_router_cordons_total", "Replicas cordoned by the router after a failure", ["replica"])
CANCELS = Counter("fleet_router_cancels_total", "Requests cancelled (disconnect, stream cancel, cancel by id)",
                  ["model", "how"])
PREEMPTIONS = Counter("fleet_router_preemptions_total", "Batch streams paused for interactive work and re-queued "
                      "(FLEET_ROUTER_BATCH_YIELD=preempt)", ["model"])
REPORTS_REFUSED = Counter("fleet_router_state_reports_refused_total", "Replica state reports refused on the internal "
                          "listener (unauthenticated, not_found, invalid_argument, ...)", ["code"])
LORA_WEIGHT_SENDS = Counter("fleet_router_lora_weight_sends_total", "Requests on which the router asked a replica "
                            "to attach LoRA weights: first use there, or resent after the backend's not-cached "
                            "answer", ["replica", "reason"])
REPLICA_KV = Gauge("fleet_router_replica_kv_utilisation", "Share of a replica's KV-cache blocks in use (0..1), from "
                   "its latest fresh state report", ["replica", "model", "version"])
REPLICA_WAITING = Gauge("fleet_router_replica_waiting", "Requests waiting inside a replica's engine, from its "
                        "latest fresh state report", ["replica", "model", "version"])

REQUEST_DURATION = Histogram("fleet_router_request_duration_seconds", "Time from request arrival to the end of its "
                             "stream (end to end, as the router saw it), by outcome", ["model", "version", "tier",
                                                                                      "status"],
                             buckets=DURATION_BUCKETS)
PROMPT_LENGTH = Histogram("fleet_router_prompt_length_tokens", "Prompt length of each request routed (tokens)",
                          ["model", "version", "tier"], buckets=LENGTH_BUCKETS)
COMPLETION_LENGTH = Histogram("fleet_router_completion_length_tokens", "Completion length of each finished "
                              "request (tokens streamed)", ["model", "version", "tier"], buckets=LENGTH_BUCKETS)
FINISHED = Counter("fleet_router_finished_total", "Requests finished, by why their stream ended (stop, length, "
                   "deadline, cancelled, error)", ["model", "version", "tier", "finish_reason"])
USAGE_SPOOL_PENDING = Gauge("fleet_router_usage_spool_pending", "Usage events spooled by this router and not yet "
                            "acknowledged by Kafka (the first leg of the usage pipeline's lag)")

def refresh_replica_gauges(router) -> None:
    """Set the per-replica gauges from the fresh state reports (called at each /metrics scrape), dropping
    replicas that stopped reporting so a dead replica does not show its last KV use forever."""
    for gauge in (REPLICA_KV, REPLICA_WAITING):
        gauge.clear()
    if router.usage is not None:
        USAGE_SPOOL_PENDING.set(router.usage.pending())
    for r in router.registry.snapshot.replicas:
        state = router.replica_state.fresh(r.replica_id)
        if state is None:
            continue
        total, free = state.report.get("kv_blocks_total"), state.report.get("kv_blocks_free")
        if total and free is not None:
            REPLICA_KV.labels(r.replica_id, r.model, r.version).set(1.0 - free / total)
        if state.report.get("waiting") is not None:
            REPLICA_WAITING.labels(r.replica_id, r.model, r.version).set(state.report["waiting"])
STREAM_TIMEOUTS = Counter("fleet_router_stream_timeouts_total", "Upstream streams given up because the replica sent "
                          "nothing within the first-token or inter-token timeout (hung replica)", ["replica"])
POISONED = Counter("fleet_router_poison_requests_total", "Requests stopped with an error, not retried, after the "
                   "replicas serving them died or hung twice", ["model"])
USAGE_EMIT_ERRORS = Counter("fleet_router_usage_emit_errors_total", "Usage events that could not be spooled "
                            "(e.g. ENOSPC); their tokens stay in the in-flight ledger", ["error"])
USAGE_LEDGER_FULL = Counter("fleet_router_usage_ledger_full_total", "Streams that found no free slot in the "
                            "in-flight usage ledger (billed only when they end)")

SLOW_WAITS = Counter("fleet_router_slow_replica_waits_total", "Stream timeouts judged 'slow, not dead': the replica "
                     "kept reporting engine progress, so the stream kept waiting and new work was held back",
                     ["replica"])
SUSPECTS = Counter("fleet_router_replica_suspects_total", "Stream timeouts on the last serving replica of a model "
                   "that had stopped reporting: not cordoned, held from new work and probed", ["replica"])
PROBES = Counter("fleet_router_replica_probes_total", "Probes of cordoned or suspect replicas by outcome",
                 ["replica", "outcome"])
UNCORDONS = Counter("fleet_router_uncordons_total", "Replicas put back in service by the router after a probe "
                    "answered", ["replica"])


def prometheus_page(router):
    """The /metrics handler (callers' port and internal listener): replica gauges refreshed, then every metric."""
    async def prometheus():
        refresh_replica_gauges(router)
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
    return prometheus
