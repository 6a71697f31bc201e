"""What the controller reads, per model pool: queue wait (router), KV use and running/waiting
(replica reports), TTFT p95 against the tier SLO. Read from every router's `GET /admin/fleet`: the router
URL's name is resolved to every address (in Kubernetes a headless Service, one address per router pod) and
the views are merged (`merge_fleets`): each router queues and streams its own share of the traffic, so one
router's view would see only part of the load.

Utilisation percentages are deliberately not used for scaling decisions: a GPU running any decode
batch reports ~100 % "utilisation" whatever the batch size, and CPU % says nothing about queues.
`gpu_util` is carried only so the simulator can show what a policy on it would do.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import httpx

from common.endpoints import every_address

log = logging.getLogger(__name__)


@dataclass
class ReplicaSignals:
    """One replica's soft state, as its engine last reported it to the router."""

    replica_id: str
    model: str
    version: str = ""
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    running: int = 0
    waiting: int = 0
    inflight: int = 0
    ttft_ms_p95: float = 0.0
    queue_wait_ms_p95: float = 0.0
    tokens_per_s: float = 0.0
    draining: bool = False

    @property
    def kv_utilisation(self) -> float:
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass
class Signals:
    """Aggregated signals for one model pool at one instant."""

    model: str
    serving: int = 0  # replicas admitting traffic
    kv_utilisation: float = 0.0  # mean over serving replicas, 0..1
    running: float = 0.0  # sequences in the continuous batches, summed over replicas
    waiting: float = 0.0  # sequences queued inside replicas + the router's admission queue
    ttft_p95_s: float = 0.0
    queue_wait_p95_s: float = 0.0  # router admission queue wait p95
    requests_per_s: float = 0.0  # arrivals (interactive + standard)
    load: float = 0.0  # engine busy fraction: tokens/s over the calibrated tokens/s capacity, 0..1
    gpu_util: float = 0.0  # what nvidia-smi would say (for the comparison only)
    slo_ttft_s: float = 0.5
    batch_waiting: float = 0.0  # batch requests in the router's admission queues (the batch demand)
    batch_deadline_s: float | None = None  # seconds until the earliest queued batch deadline
    replicas: list[ReplicaSignals] = field(default_factory=list)

    @property
    def ttft_ratio(self) -> float:
        """TTFT p95 as a fraction of the tier SLO (> 1 means the SLO is being missed)."""
        return self.ttft_p95_s / self.slo_ttft_s if self.slo_ttft_s else 0.0


def aggregate(model: str, replicas: list[ReplicaSignals], pool: dict, slo_ttft_s: float,
              capacity_tokens_per_s: float | None = None) -> Signals:
    """Combine replica reports and the router's per-model queue stats into one Signals."""
    serving = [r for r in replicas if r.model == model and not r.draining]
    n = len(serving)
    tokens = sum(r.tokens_per_s for r in serving)
    load = tokens / (capacity_tokens_per_s * n) if capacity_tokens_per_s and n else 0.0
    return Signals(
        model=model, serving=n,
        kv_utilisation=sum(r.kv_utilisation for r in serving) / n if n else 0.0,
        running=float(sum(r.running for r in serving)),
        waiting=float(sum(r.waiting for r in serving) + pool.get("queued", pool.get("waiting", 0))),
        ttft_p95_s=max([r.ttft_ms_p95 for r in serving] + [pool.get("ttft_ms_p95", 0.0)]) / 1000.0,
        queue_wait_p95_s=max([r.queue_wait_ms_p95 for r in serving] + [pool.get("queue_wait_ms_p95", 0.0)]) / 1000.0,
        requests_per_s=float(pool.get("requests_per_s", 0.0)),
        load=min(load, 1.0), slo_ttft_s=slo_ttft_s, replicas=serving,
        batch_waiting=float(pool.get("batch_waiting", 0)),
        batch_deadline_s=(pool["batch_deadline_ms"] / 1000.0 - time.time()) if pool.get("batch_deadline_ms") else None,
    )


def parse_fleet(payload: dict, model: str, slo_ttft_s: float,
                capacity_tokens_per_s: float | None = None, version: str | None = None) -> Signals:
    """Parse the router's `/admin/fleet` JSON (replicas[] with soft state; models{} or pools{} queue stats).
    With `version`, only that version's replicas and admission queue count (one pool per model version)."""
    replicas = []
    for raw in payload.get("replicas", []):
        if version is not None and str(raw.get("version", "")) != version:
            continue
        state = raw.get("state") or {}
        merged = {**raw, **state} if isinstance(state, dict) else dict(raw)
        replicas.append(ReplicaSignals(
            replica_id=str(merged.get("replica_id", "")), model=str(merged.get("model", "")),
            version=str(merged.get("version", "")),
            kv_blocks_total=int(merged.get("kv_blocks_total") or 0), kv_blocks_free=int(merged.get("kv_blocks_free") or 0),
            running=int(merged.get("running") or 0), waiting=int(merged.get("waiting") or 0),
            inflight=int(merged.get("inflight") or 0),
            ttft_ms_p95=float(merged.get("ttft_ms_p95") or 0.0),
            queue_wait_ms_p95=float(merged.get("queue_wait_ms_p95") or 0.0),
            tokens_per_s=float(merged.get("tokens_per_s") or 0.0),
            draining=bool(merged.get("draining") or merged.get("state") in ("draining", "cordoned"))))
    pools = payload.get("models") or payload.get("pools") or payload.get("queues") or {}
    if isinstance(pools, dict):  # keyed by model, or by "model:version" (the router's admission queues)
        pool = dict(pools.get(model) or {})
        for key, stats in pools.items():
            if key.startswith(f"{model}:") and isinstance(stats, dict) and version in (None, key[len(model) + 1:]):
                pool["waiting"] = pool.get("waiting", 0) + stats.get("waiting", 0)
                pool["queue_wait_ms_p95"] = max(pool.get("queue_wait_ms_p95", 0.0), stats.get("queue_wait_ms_p95", 0.0))
                pool["batch_waiting"] = pool.get("batch_waiting", 0) + (stats.get("by_tier") or {}).get("batch", 0)
                if stats.get("batch_deadline_ms"):
                    pool["batch_deadline_ms"] = min(pool.get("batch_deadline_ms") or math.inf, stats["batch_deadline_ms"])
    else:
        pool = next((p for p in pools if p.get("model") == model), {})
    return aggregate(model, replicas, pool, slo_ttft_s, capacity_tokens_per_s)


# per-router counts add up over routers; latency percentiles: the worst router's (a p95 cannot be averaged)
_SUMMED = ("inflight", "load_tokens", "waiting")
_WORST = ("ttft_ms_p95", "queue_wait_ms_p95", "retry_after_ms")
_STOPPED = ("draining", "cordoned")


def _merge_row(into: dict, row: dict) -> None:
    for key in _SUMMED:
        if key in row:
            into[key] = (into.get(key) or 0) + (row.get(key) or 0)
    for key in _WORST:
        if row.get(key) is not None:
            into[key] = max(into.get(key) or 0, row[key])


def merge_fleets(payloads: list[dict]) -> dict:
    """One fleet view from several routers' `/admin/fleet` answers. A replica's reported state is the same at
    every router (reports fan out to all); what each router counts itself (streams in flight, queued requests,
    by tier) is summed; latency percentiles are the worst router's; the earliest batch deadline counts; a
    replica any router has draining or cordoned is not admitting."""
    if len(payloads) == 1:
        return payloads[0]
    replicas: dict[str, dict] = {}
    queues: dict[str, dict] = {}
    for payload in payloads:
        for raw in payload.get("replicas", []):
            rid = str(raw.get("replica_id"))
            if rid not in replicas:
                replicas[rid] = dict(raw)
                continue
            _merge_row(replicas[rid], raw)
            if raw.get("state") in _STOPPED:
                replicas[rid]["state"] = raw["state"]
        for name, stats in (payload.get("queues") or {}).items():
            if name not in queues:
                queues[name] = dict(stats, by_tier=dict(stats.get("by_tier") or {}))
                continue
            merged = queues[name]
            _merge_row(merged, stats)
            for tier, n in (stats.get("by_tier") or {}).items():
                merged["by_tier"][tier] = merged["by_tier"].get(tier, 0) + n
            deadlines = [d for d in (merged.get("batch_deadline_ms"), stats.get("batch_deadline_ms")) if d]
            merged["batch_deadline_ms"] = min(deadlines) if deadlines else None
    return dict(payloads[0], replicas=list(replicas.values()), queues=queues, routers=len(payloads))


def read_fleet(router_url: str, admin_token: str | None = None, timeout_s: float = 2.0) -> dict:
    """Every router's `/admin/fleet` behind `router_url`, merged. Routers that do not answer (one restarting)
    are left out with a warning; HTTPError only when none answers."""
    headers = {"authorization": f"Bearer {admin_token}"} if admin_token else {}
    payloads, errors = [], []
    for url in every_address([router_url.rstrip("/")]):
        try:
            resp = httpx.get(f"{url}/admin/fleet", headers=headers, timeout=timeout_s)
            resp.raise_for_status()
            payloads.append(resp.json())
        except (httpx.HTTPError, ValueError) as exc:
            errors.append(f"{url}: {exc}")
    if not payloads:
        raise httpx.HTTPError("no router answered /admin/fleet: " + "; ".join(errors))
    if errors:
        log.warning("signals from %d router(s); not answering: %s", len(payloads), "; ".join(errors))
    return merge_fleets(payloads)


def read_signals(router_url: str, model: str, slo_ttft_s: float, capacity_tokens_per_s: float | None = None,
                 admin_token: str | None = None, timeout_s: float = 2.0, version: str | None = None) -> Signals:
    """Every router's `/admin/fleet`, merged, aggregated for one model pool (one version of it when given)."""
    return parse_fleet(read_fleet(router_url, admin_token, timeout_s), model, slo_ttft_s, capacity_tokens_per_s,
                       version)


def _fleet_rows(router_url: str, admin_token: str | None = None) -> dict[str, dict] | None:
    """replica id -> the routers' merged `/admin/fleet` row; None if no router can be read."""
    try:
        payload = read_fleet(router_url, admin_token)
    except httpx.HTTPError:
        return None
    return {str(raw.get("replica_id")): raw for raw in payload.get("replicas", [])}


def replica_inflight(router_url: str, replica_id: str, admin_token: str | None = None) -> int | None:
    """In-flight streams the router has open to one replica; None if the router does not say."""
    raw = (_fleet_rows(router_url, admin_token) or {}).get(replica_id)
    if raw is None:
        return None
    value = raw.get("inflight", (raw.get("state") or {}).get("inflight") if isinstance(raw.get("state"), dict) else None)
    return int(value) if value is not None else None


def router_admits(router_url: str, replica_id: str, admin_token: str | None = None) -> bool | None:
    """Whether the router still has the replica `serving` in its registry snapshot (so it may admit new
    streams there); None if the router cannot be read."""
    rows = _fleet_rows(router_url, admin_token)
    if rows is None:
        return None
    return replica_id in rows and rows[replica_id].get("state") == "serving"
