"""State reporter beside a GPU replica (TensorRT-LLM under Triton): the replica state report the CPU engine
sends from inside (python_backends/engine/state_report.py), built here from the replica's Prometheus metrics.

Run next to each GPU replica (a second container in the pod): `python -m python_backends.trtllm_state`.
`... trtllm_state drain` is the pod's preStop hook: it tells every router, by a signed state report with
`draining: true` (the replica's own report key; no operator token in the pod), to stop admitting to this
replica (and through the admin API too when FLEET_ADMIN_TOKEN is set, as local runs do), then waits until the
backend's active-request metric and Triton's pending count of the ensemble are both 0
(`nv_inference_pending_request_count` alone excludes executing requests, so it would stop streams mid-way).
Every interval it reads Triton's metrics endpoint and publishes, through the same sender as the CPU engine:
- `kv_blocks_total` / `kv_blocks_free` / `block_size` from nv_trt_llm_kv_cache_block_metrics
  {kv_cache_block_type="max"|"free"|"tokens_per"};
- `running` from nv_trt_llm_request_metrics{request_type="active"} (requests the executor holds, executing
  or queued inside it); `waiting` from Triton's nv_inference_pending_request_count of the ensemble;
- no prefix hashes: tensorrtllm_backend 0.17 does not expose TensorRT-LLM's KV-cache events, so the report
  says `prefix_hashes_reported: false` and the router keeps its own history of the prefixes it routed there.
Reports go to every router: a URL in FLEET_ROUTER_URLS whose host name resolves to several addresses (in
Kubernetes the headless Service `llm-router-internal`) is fanned out to one URL per address, re-resolved every
few seconds, so each router gets each report (a ClusterIP would hand each report to one router only).
A backend metric is used only once it has been seen to change: under Triton the backend's metrics can read 0
for ever (tensorrtllm_backend issue 49), and a constant 0 "active" would make a busy replica look idle. Until a
metric moves, its fields are left out and the router relies on its own in-flight counts.
"""
from __future__ import annotations

import argparse
import logging
import time
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from common.endpoints import every_address as expand_routers
from common.settings import load_settings
from python_backends.engine.state_report import RESOLVE_EVERY_S, StateReporter, drain_marker, identity_from_env

log = logging.getLogger("trtllm_state")
KV = "nv_trt_llm_kv_cache_block_metrics"
REQ = "nv_trt_llm_request_metrics"
PENDING = "nv_inference_pending_request_count"
# the CPU engine (model_repository/engine, python_backends/engine/metrics.py) has no TensorRT-LLM metrics: its
# own gauges say what it holds (without them a drain would see 0 requests and let an in-flight stream be cut)
CPU_RUNNING, CPU_WAITING = "fleet_engine_running", "fleet_engine_waiting"


def parse(text: str, engine_model: str = "tensorrt_llm", ensemble: str = "llm") -> dict[str, float]:
    """The values this reporter uses, keyed `kv.max`, `kv.free`, `kv.tokens_per`, `req.active`, `pending`."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            model = s.labels.get("model", engine_model)
            if s.name == KV and model == engine_model:
                out[f"kv.{s.labels.get('kv_cache_block_type')}"] = s.value
            elif s.name == REQ and model == engine_model:
                out[f"req.{s.labels.get('request_type')}"] = s.value
            elif s.name == PENDING and model == ensemble:
                out["pending"] = out.get("pending", 0.0) + s.value
            elif s.name in (CPU_RUNNING, CPU_WAITING):  # the replica's only engine: every model label counts
                key = "req.active" if s.name == CPU_RUNNING else "pending"
                out[key] = out.get(key, 0.0) + s.value
    return out


class MovedMetrics:
    """Remembers the first value of each metric and whether it has changed since."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.moved: set[str] = set()

    def observe(self, values: dict[str, float]) -> None:
        for key, value in values.items():
            if key not in self.first:
                self.first[key] = value
            elif value != self.first[key]:
                if key not in self.moved:
                    log.info("metric %s moved (%g -> %g): now trusted", key, self.first[key], value)
                self.moved.add(key)

    def trusted(self, key: str) -> bool:
        return key in self.moved


def build_report(identity: dict[str, Any], values: dict[str, float], seen: MovedMetrics,
                 draining: bool = False) -> dict[str, Any]:
    """One state report from one metrics scrape (`seen` must already have observed `values`)."""
    report: dict[str, Any] = dict(identity, ts=time.time(), full_snapshot=True, prefix_hashes=[],
                                  prefix_hashes_added=[], prefix_hashes_removed=[], prefix_hashes_reported=False,
                                  adapters_loaded=[], draining=draining, waiting=int(values.get("pending", 0)))
    if values.get("kv.tokens_per", 0) > 0:
        report["block_size"] = int(values["kv.tokens_per"])
    if seen.trusted("kv.free") and values.get("kv.max", 0) > 0:
        report["kv_blocks_total"], report["kv_blocks_free"] = int(values["kv.max"]), int(values["kv.free"])
    if seen.trusted("req.active"):
        report["running"] = int(values["req.active"])
    return report


def scrape(url: str, timeout_s: float = 1.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return resp.read().decode()


# `drain_marker` (python_backends/engine/state_report.py): set by `drain` (the preStop hook, another process of
# the same container); the report loop (this module's or the CPU engine's own) then says `draining` too, so the
# routers never get a non-draining report from this replica during its drain



def run(metrics_url: str, interval_s: float, identity: dict[str, Any], stop_after: float | None = None) -> None:
    configured = list(identity.get("routers", []))
    reporter = StateReporter(dict(identity, routers=expand_routers(configured))).start()
    seen = MovedMetrics()
    started = resolved = time.monotonic()
    log.info("reporting replica %s from %s to %s every %.2f s", identity.get("replica_id"), metrics_url,
             ", ".join(reporter.routers) or "no router", interval_s)
    while stop_after is None or time.monotonic() - started < stop_after:
        if time.monotonic() - resolved >= RESOLVE_EVERY_S:
            reporter.routers, resolved = expand_routers(configured), time.monotonic()  # one assignment: atomic
        reporter.draining = reporter.draining or drain_marker(str(identity.get("replica_id"))).exists()
        try:
            values = parse(scrape(metrics_url))
            seen.observe(values)
            reporter.publish(build_report(reporter.identity, values, seen, draining=reporter.draining))
        except OSError as exc:  # the replica is starting or gone: report nothing (stale reports age out)
            log.debug("metrics at %s unreadable: %s", metrics_url, exc)
        time.sleep(interval_s)
    reporter.stop()


def busy(values: dict[str, float]) -> int:
    """Requests the replica still holds: the executor's active ones, plus any Triton has not handed over yet."""
    return int(values.get("req.active", 0) + values.get("pending", 0))


def drain(metrics_url: str, identity: dict[str, Any], admin_token: str | None, timeout_s: float,
          poll_s: float = 1.0, announce: bool = True) -> bool:
    """Stop admission at every router, then wait for the replica to hold no request; False on timeout.

    Every poll sends a signed `draining` report to every router (a router that starts during the drain hears it
    too); with an operator token the routers' admin API is asked as well."""
    routers = expand_routers(identity.get("routers", [])) if announce else []
    reporter = StateReporter(dict(identity, routers=routers)).start()  # no routers: publishes go nowhere
    reporter.draining = True
    marker = drain_marker(str(identity.get("replica_id")))
    if announce:
        marker.touch()
    else:
        admin_token = None
        time.sleep(min(2.0, timeout_s))  # let the sidecar's draining report reach the routers first
    try:  # the marker stays: the pod is terminating, no router may route here again (the replica's start clears it)
        return _drain_wait(metrics_url, identity, admin_token, timeout_s, poll_s, reporter)
    finally:
        reporter.stop()
        reporter.join(2.0)  # its last `draining` report is out before the kubelet sends SIGTERM


def _drain_wait(metrics_url: str, identity: dict[str, Any], admin_token: str | None, timeout_s: float,
                poll_s: float, reporter: StateReporter) -> bool:
    seen = MovedMetrics()
    for router in (identity.get("admin_routers") or identity.get("routers", [])) if admin_token else []:
        req = urllib.request.Request(f"{router}/admin/replicas/{identity['replica_id']}/drain", data=b"{}",
                                     method="POST", headers={"authorization": f"Bearer {admin_token}",
                                                             "content-type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=5).close()
            log.info("router %s drains %s", router, identity["replica_id"])
        except OSError as exc:  # keep going: the other routers and the wait still matter
            log.warning("router %s did not accept the drain of %s: %s", router, identity["replica_id"], exc)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            values = parse(scrape(metrics_url))
            seen.observe(values)
            reporter.publish(build_report(reporter.identity, values, seen, draining=True))
            left = busy(values)
        except OSError:
            return True  # Triton is gone: nothing left to wait for
        if left == 0:
            log.info("replica %s drained", identity["replica_id"])
            return True
        log.info("replica %s still holds %d request(s)", identity["replica_id"], left)
        time.sleep(poll_s)
    log.warning("replica %s not drained after %.0f s", identity["replica_id"], timeout_s)
    return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m python_backends.trtllm_state", description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", nargs="?", choices=("report", "drain"), default="report",
                    help="report: publish state reports (default); drain: the preStop hook")
    ap.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics",
                    help="the replica's Triton metrics endpoint (default %(default)s)")
    ap.add_argument("--interval", type=float, default=0.2, help="seconds between reports (default %(default)s)")
    ap.add_argument("--timeout", type=float, default=110.0,
                    help="drain: give up after this many seconds (keep it under the pod's grace period)")
    ap.add_argument("--no-announce", action="store_true",
                    help="drain: only wait (another container of the pod sends the draining reports)")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    identity = identity_from_env()
    if not identity["routers"]:
        ap.error("FLEET_ROUTER_URLS is empty: set the routers' internal URLs (comma-separated)")
    if args.mode == "drain":  # the signed draining report needs no operator token; the admin API call does
        token = None if args.no_announce else load_settings().operator_token()
        return 0 if drain(args.metrics_url, identity, token, args.timeout, announce=not args.no_announce) else 1
    run(args.metrics_url, args.interval, identity)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
