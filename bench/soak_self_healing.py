"""Bounded self-healing soak (issue 34, item 4): steady streaming traffic through a real router (usage metered
to a real tansu broker, loaded into DuckDB) in front of three real Triton replicas, while

- replica r0 is slow all along (`FLEET_ENGINE_TEST_STEP_SLEEP_S`: every engine step sleeps longer than the
  standard tier's inter-token timeout, which is set to 1 s here), and a real CPU hog (busy processes, one per
  core) runs for 15 s;
- replica r1 is frozen (SIGSTOP) for 20 s and resumed (SIGCONT): the router's probes put it back;
- replica r2 is killed (SIGKILL); the local actuator's `heal` (called every 2 s, as the autoscaler does)
  restarts it once it has stayed cordoned for 30 s.

At the end: every request either finished or failed with a clear error, every model serves again with no
operator, every streamed token is billed exactly once. Prints and writes a JSON summary
(bench/results/soak_self_healing.json). About 3-4 minutes here; not part of the test suite (too long for
its budget): `.venv/bin/python bench/soak_self_healing.py`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import tritonclient.grpc.aio as grpcaio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoscale.actuators import PoolSpec  # noqa: E402
from autoscale.actuators.local import LocalActuator  # noqa: E402
from common.processes import free_port, stop_pid  # noqa: E402
from common.services import start_tansu  # noqa: E402
from common.settings import load_settings  # noqa: E402
from fleet.seed import DEFAULT_MODEL, DEFAULT_VERSION  # noqa: E402
from tests.integration.router_client import CHATML, stream_once  # noqa: E402
from tests.integration.router_stack import RouterStack  # noqa: E402
from tests.reliability.test_chaos import _billed  # noqa: E402
from usage.loader import UsageLoader  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "soak_self_healing.json"


def _hog(stop_at: float) -> None:
    while time.monotonic() < stop_at:
        pass


def _signal(stack: RouterStack, rid: str, sig: int) -> None:
    try:
        os.killpg(stack.replica_pid(rid), sig)
    except (ProcessLookupError, FileNotFoundError):
        pass


async def _traffic(stack: RouterStack, workers: int, run_s: float, deadline_s: float) -> list[dict]:
    client = grpcaio.InferenceServerClient(stack.grpc_url)
    stop_at = time.monotonic() + run_s
    results: list[dict] = []

    async def worker(w: int) -> None:
        n = 0
        while time.monotonic() < stop_at:
            n += 1
            started = time.monotonic()
            out = await stream_once(client, DEFAULT_MODEL, CHATML.format(q=f"Tell story {w}-{n} about a river."), 32,
                                    stack.api_key, deadline_ms=int((time.time() + deadline_s) * 1000))
            results.append({"id": out.response_id, "tokens": len(out.ids), "finish": out.finish_reason,
                            "ttft_s": None if out.ttft_s is None else round(out.ttft_s, 2),
                            "error": out.error, "message": out.error_message[:300],
                            "took_s": round(time.monotonic() - started, 2)})
            if out.error is not None:
                await asyncio.sleep(0.5)
    await asyncio.gather(*(worker(w) for w in range(workers)))
    await client.close()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-s", type=float, default=110.0, help="seconds of traffic")
    ap.add_argument("--workers", type=int, default=4, help="concurrent streams")
    ap.add_argument("--step-sleep-s", type=float, default=1.2, help="r0's sleep after every engine step")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="soak-healing-"))
    port = free_port()
    broker = start_tansu(load_settings(), port, root / "tansu.log")
    stack = None
    hogs: list[multiprocessing.Process] = []
    summary: dict = {"load_avg_before": os.getloadavg()}
    try:
        stack = RouterStack.start(root / "data", replicas=0, router_args=(),
                                  router_env={"KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{port}",
                                              "FLEET_ROUTER_INTER_TOKEN_TIMEOUT_S": "interactive=1,standard=1,batch=2",
                                              "FLEET_ROUTER_RATE_LIMIT_RPS": "1000"})
        stack.add_replicas([0], {"FLEET_ENGINE_TEST_STEP_SLEEP_S": str(args.step_sleep_s)})
        stack.add_replicas([1, 2])
        r0, r1, r2 = stack.replica_ids
        loader = UsageLoader(f"127.0.0.1:{port}", root / "usage.duckdb", topic=stack.settings.usage_topic,
                             group_id="soak-loader", dlq_topic=stack.settings.usage_dlq_topic)
        stop_loader = threading.Event()
        threading.Thread(target=loader.run, args=(stop_loader, 0.5), daemon=True).start()
        pool = PoolSpec(DEFAULT_MODEL, DEFAULT_VERSION)
        actuator = LocalActuator(stack.settings, router_urls=[stack.http_url], admin_token=stack.admin_token,
                                 cpu_budget=False, restart_cordoned_after_s=30.0)
        actuator.adopt(pool)
        restarted: list[str] = []
        events: list[tuple[float, str]] = []
        t0 = time.monotonic()

        def chaos() -> None:
            def at(t: float) -> None:
                time.sleep(max(0.0, t0 + t - time.monotonic()))
            at(10)
            events.append((time.monotonic() - t0, "cpu hog on (15 s)"))
            for _ in range(os.cpu_count() or 2):
                p = multiprocessing.Process(target=_hog, args=(time.monotonic() + 15,), daemon=True)
                p.start()
                hogs.append(p)
            at(30)
            events.append((time.monotonic() - t0, f"SIGSTOP {r1}"))
            _signal(stack, r1, signal.SIGSTOP)
            at(50)
            events.append((time.monotonic() - t0, f"SIGCONT {r1}"))
            _signal(stack, r1, signal.SIGCONT)
            at(60)
            events.append((time.monotonic() - t0, f"SIGKILL {r2}"))
            _signal(stack, r2, signal.SIGKILL)

        def healer() -> None:  # what the autoscaler's controller does every tick
            while time.monotonic() - t0 < args.run_s + 60:
                restarted.extend(actuator.heal(pool))
                time.sleep(2.0)
        threading.Thread(target=chaos, daemon=True).start()
        threading.Thread(target=healer, daemon=True).start()
        results = asyncio.run(_traffic(stack, args.workers, args.run_s, 60.0))
        traffic_end = time.monotonic()
        # every model serves again, no operator: a request succeeds, and the frozen replica is back in service
        serves_again_s, after = None, []
        while time.monotonic() - traffic_end < 60:
            out = asyncio.run(_traffic(stack, 1, 0.1, 30.0))[0]
            after.append(out)
            if out["error"] is None:  # its first token came ttft_s after the request was sent
                serves_again_s = round(time.monotonic() - traffic_end - out["took_s"] + out["ttft_s"], 1)
                break
            time.sleep(1)
        actuator.wait_idle(120)
        states = {r["replica_id"]: r["state"] for r in stack.fleet()["replicas"]}
        received = {r["id"]: r["tokens"] for r in results if r["id"]}
        billed = _billed(root / "usage.duckdb", set(received), 90)
        mismatches = {rid: (billed.get(rid), n) for rid, n in received.items()
                      if billed.get(rid) is None or billed[rid] != (1, n)}
        unclear = [r for r in results if r["error"] is not None and not r["message"]]
        metrics = stack.metrics()

        def metric(name: str) -> float:
            return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                       if line.startswith(name + "{") or line.startswith(name + " "))
        summary.update({
            "run_s": args.run_s, "workers": args.workers, "events": events, "requests": len(results),
            "finished": sum(r["error"] is None for r in results),
            "finish_reasons": dict(Counter(r["finish"] for r in results if r["error"] is None)),
            "errors": dict(Counter(f"{r['error']}: {r['message'][:80]}" for r in results if r["error"] is not None)),
            "errors_without_message": len(unclear), "requests_without_id": sum(not r["id"] for r in results),
            "max_request_s": max((r["took_s"] for r in results), default=0),
            "serves_again_after_traffic_s": serves_again_s, "requests_after_traffic": after,
            "replica_states_at_end": states,
            "restarted_by_actuator": restarted, "billing_mismatches": len(mismatches),
            "billing_mismatch_examples": dict(list(mismatches.items())[:5]),
            "tokens_received": sum(received.values()),
            "router_metrics": {k: metric(k) for k in (
                "fleet_router_cordons_total", "fleet_router_uncordons_total", "fleet_router_slow_replica_waits_total",
                "fleet_router_replica_suspects_total", "fleet_router_stream_timeouts_total",
                "fleet_router_resumes_total", "fleet_router_retries_total", "fleet_router_replica_probes_total")},
            "load_avg_after": os.getloadavg()})
        stop_loader.set()
    finally:
        for p in hogs:
            p.kill()
        if stack is not None:
            for rid in stack.replica_ids:
                _signal(stack, rid, signal.SIGCONT)
            stack.stop()
        stop_pid(broker.pid, grace_s=3)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    ok = (summary.get("serves_again_after_traffic_s") is not None and summary.get("billing_mismatches") == 0
          and summary.get("errors_without_message") == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
