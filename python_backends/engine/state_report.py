"""The replica state report (docs/architecture.md, State reports), pushed to every router about every 200 ms.

The engine loop thread builds each report (`build`, on its own thread, so engine state is read consistently)
and hands it to `StateReporter.publish`; a separate sender thread POSTs the latest one, signed with this
replica's key (`FLEET_REPORT_KEY`, see common/report_channel.py), to each router's internal listener
(`FLEET_ROUTER_URLS`) with a short timeout, fire-and-forget, so a slow or dead router never
blocks the engine. Prefix hashes go as deltas (added/removed since the last report), with a full snapshot
on start and every ~10 s so a router that missed deltas resyncs.

Every router, not one: a router URL whose host is a name (Kubernetes: the headless `llm-router-internal`) is
re-resolved every few seconds and each of its addresses gets every report (a router that got none would route
blind to this replica). Draining: once the pod's preStop hook (`python -m python_backends.trtllm_state drain`,
another process) leaves its marker file, every report says `draining`, so no router goes back to routing new
requests here while it drains, nor after (the marker stays until the pod is gone; a replica that starts clears a
stale one: `clear_stale_drain`).
"""
from __future__ import annotations

import logging
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.endpoints import every_address
from common.replica_report import ReplicaReport
from common.report_channel import post_report
from common.report_key_exchange import fetch_report_key
from common.settings import load_from_env

log = logging.getLogger(__name__)
RESOLVE_EVERY_S = 5.0  # routers come and go (rolling update): re-resolve a router name this often


def drain_marker(replica_id: str) -> Path:
    """Left by the preStop drain (another process of the container, same /tmp) while the replica drains."""
    return Path(tempfile.gettempdir()) / f"fleet-draining-{replica_id.replace('/', '_')}"


def clear_stale_drain(replica_id: str) -> None:
    """At a replica's start: a marker left by an earlier drain of the same id (a restarted container) is old news."""
    drain_marker(replica_id).unlink(missing_ok=True)


class ReplicaSettings(BaseSettings):
    """Who this replica is and where its reports go (FLEET_REPLICA_ID, FLEET_MODEL, FLEET_VERSION,
    FLEET_REGION, FLEET_ROUTER_URLS, FLEET_REPORT_KEY), set by whoever starts the replica
    (autoscale/actuators/replicas.py)."""
    model_config = SettingsConfigDict(env_prefix="FLEET_", extra="ignore", frozen=True)

    replica_id: str = "local-0"
    model: str = ""
    version: str = ""
    region: str = "local"
    router_urls: str = ""  # comma separated base URLs of the routers' internal listeners
    router_admin_urls: str = ""  # the routers' admin API (callers' port), for a preStop drain; default router_urls
    report_key: str = ""  # this replica's report signing key (common/report_channel.py)
    # Kubernetes: no key is handed out (the pod name is known only once the pod exists); the pod's projected
    # ServiceAccount token is traded for this replica's key at a router (common/report_key_exchange.py)
    report_token_file: str = ""

    def identity(self) -> dict[str, Any]:
        routers = _urls(self.router_urls)
        return {"replica_id": self.replica_id, "model": self.model, "version": self.version, "region": self.region,
                "routers": routers, "admin_routers": _urls(self.router_admin_urls or self.router_urls),
                "report_key": self.report_key or (self._exchanged_key(routers) if self.report_token_file else "")}

    def _exchanged_key(self, routers: list[str], attempts: int = 30, pause_s: float = 2.0) -> str:
        """This pod's key from the first router that answers (routers may still be starting: retried)."""
        error: Exception | None = None
        for _ in range(attempts):
            for router in routers:
                try:
                    replica_id, key = fetch_report_key(router, Path(self.report_token_file))
                except (OSError, ValueError, KeyError) as exc:
                    error = exc
                    continue
                if replica_id != self.replica_id:  # FLEET_REPLICA_ID must be the pod name the token is bound to
                    raise ValueError(f"FLEET_REPLICA_ID: {self.replica_id!r}, but the token is pod {replica_id!r}")
                return key
            time.sleep(pause_s)
        raise RuntimeError(f"FLEET_REPORT_TOKEN_FILE: no router in {routers} issued a report key: {error}")


def _urls(csv: str) -> list[str]:
    return [u.strip().rstrip("/") for u in csv.split(",") if u.strip()]


def identity_from_env() -> dict[str, Any]:
    """The replica's identity, read once at start by the Triton shim (a bad value exits naming it)."""
    return load_from_env(ReplicaSettings).identity()


class StateReporter:
    def __init__(self, identity: dict[str, Any], full_snapshot_s: float = 10.0, timeout_s: float = 0.5):
        self.identity = {k: v for k, v in identity.items() if k not in ("routers", "admin_routers", "report_key")}
        self._configured: list[str] = list(identity.get("routers", []))
        self.routers: list[str] = every_address(self._configured)  # one URL per router behind a name
        self._resolved = time.monotonic()
        self._marker = drain_marker(str(identity.get("replica_id", "")))
        self.report_key: str = identity.get("report_key", "")
        self.full_snapshot_s, self.timeout_s = full_snapshot_s, timeout_s
        self.draining = False
        self._last_full = 0.0
        self._pending_added: list[int] = []
        self._pending_removed: list[int] = []
        self._latest: dict[str, Any] | None = None
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine-state-report", daemon=True)
        self.sent = 0

    def start(self) -> "StateReporter":
        if self.routers:
            self._thread.start()
        return self

    def join(self, timeout_s: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def stop(self) -> None:
        """The sender sends what is pending (a drain's last `draining` report must not be lost), then ends."""
        with self._cv:
            self._stop = True
            self._cv.notify()

    def build(self, engine: Any) -> dict[str, Any] | None:
        """Called on the engine loop thread: a consistent report from the engine's current state, checked
        against `ReplicaReport` (the router's schema); None, and a full snapshot next time, if it does not fit."""
        pool = engine.kv.pool
        added, removed = pool.drain_events()
        now = time.time()
        full = now - self._last_full >= self.full_snapshot_s
        report = dict(self.identity, ts=now, kv_blocks_total=pool.num_usable, kv_blocks_free=pool.num_free,
                      block_size=engine.config.block_size, running=len(engine.scheduler.running),
                      waiting=len(engine.scheduler.waiting), queue_wait_ms_p95=engine.stats.queue_wait_ms_p95(),
                      ttft_ms_p95=engine.stats.ttft_ms_p95(), tokens_per_s=engine.stats.tokens_per_s(),
                      steps=int(getattr(engine, "steps", 0)),
                      adapters_loaded=engine.lora.loaded() if engine.lora else [],
                      full_snapshot=full, draining=self.draining or self._marker.exists())
        if full:
            self._last_full = now
            report["prefix_hashes"] = pool.cached_hashes()
            report["prefix_hashes_added"], report["prefix_hashes_removed"] = [], []
        else:
            report["prefix_hashes_added"], report["prefix_hashes_removed"] = added, removed
        try:
            return ReplicaReport.model_validate(report).model_dump(exclude_none=True)  # deltas carry no full list
        except ValidationError as exc:  # a bug here must not reach the engine loop (it would fail every request)
            log.error("state report does not fit the ReplicaReport schema, not sent: %s", exc)
            self._last_full = 0.0
            return None

    def publish(self, report: dict[str, Any] | None) -> None:
        """Queue a report for sending; unsent deltas are merged so none is lost if the sender lags."""
        if report is None:
            return
        with self._cv:
            if self._latest is not None and not report["full_snapshot"]:
                if self._latest.get("full_snapshot"):
                    # a pending full snapshot absorbs the deltas
                    hashes = set(self._latest["prefix_hashes"]) - set(report["prefix_hashes_removed"])
                    report = dict(report, full_snapshot=True,
                                  prefix_hashes=list(hashes | set(report["prefix_hashes_added"])),
                                  prefix_hashes_added=[], prefix_hashes_removed=[])
                else:
                    report = dict(report,
                                  prefix_hashes_added=self._latest["prefix_hashes_added"] + report["prefix_hashes_added"],
                                  prefix_hashes_removed=self._latest["prefix_hashes_removed"] + report["prefix_hashes_removed"])
            self._latest = report
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._latest is None and not self._stop:
                    self._cv.wait(1.0)
                if self._latest is None:
                    return  # stopped, nothing pending
                report, self._latest = self._latest, None
            if time.monotonic() - self._resolved >= RESOLVE_EVERY_S:
                self.routers, self._resolved = every_address(self._configured), time.monotonic()
            for router in self.routers:
                try:
                    post_report(router, report, self.report_key, self.timeout_s)
                    self.sent += 1
                except Exception as exc:   # soft state: a lost report costs a few routing decisions
                    log.debug("state report to %s failed: %s", router, exc)
