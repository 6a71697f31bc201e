"""Live autoscaler benchmark: real router + real Triton replicas (SmolLM2 CPU engine), local actuator.

    python bench/autoscale/live_step.py    # -> bench/results/autoscale-live.json + docs/img/autoscale-live-step.png

A closed-loop load of `base` concurrent streams (1x) steps to 4x, holds, then drops back to 1x.
Measured: when the controller starts the second replica vs when queue wait (client-side TTFT over the
1x baseline, p95 over a sliding window) first breaches its threshold; whether the scale-down drain
loses any stream (every request must end with a finish_reason and no error).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from autoscale.actuators import PoolSpec  # noqa: E402
from autoscale.actuators.local import LocalActuator  # noqa: E402
from autoscale.controller import Controller, PoolConfig  # noqa: E402
from common.logs import setup_logging  # noqa: E402
from fleet.seed import DEFAULT_MODEL, DEFAULT_VERSION  # noqa: E402

PROMPTS = ["Explain what a GPU is in one sentence.", "Name three colours of the rainbow.",
           "What is the capital of France?", "Write a haiku about autumn.", "Why is the sky blue?"]


async def stream_chat(http: "httpx.AsyncClient", api_key: str, prompt: str, max_tokens: int) -> dict:
    """One streamed OpenAI chat completion through the router; TTFT = first content delta."""
    started = time.monotonic()
    out = {"ttft_s": None, "finish_reason": "", "error": "", "tokens": 0}
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "temperature": 0, "priority": "interactive"}
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body,
                               headers={"authorization": f"Bearer {api_key}"}) as resp:
            if resp.status_code != 200:
                out["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return out
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out["error"] = str(chunk["error"])[:200]
                    break
                choice = (chunk.get("choices") or [{}])[0]
                if choice.get("delta", {}).get("content"):
                    out["tokens"] += 1
                    if out["ttft_s"] is None:
                        out["ttft_s"] = time.monotonic() - started
                if choice.get("finish_reason"):
                    out["finish_reason"] = choice["finish_reason"]
            if not done and not out["error"]:
                out["error"] = "stream ended without [DONE]"
    except Exception as exc:  # a broken stream is a failed stream
        out["error"] = f"{type(exc).__name__}: {exc}"[:200]
    if out["ttft_s"] is None and not out["error"]:
        out["ttft_s"] = time.monotonic() - started
    return out


async def client_loop(http_url: str, api_key: str, active: dict, my_index: int, results: list, stop: asyncio.Event,
                      max_tokens: int) -> None:
    import httpx

    n = 0
    async with httpx.AsyncClient(base_url=http_url, timeout=httpx.Timeout(120.0)) as http:
        while not stop.is_set():
            if my_index >= active["clients"]:
                await asyncio.sleep(0.2)
                continue
            started = time.time()
            r = await stream_chat(http, api_key, PROMPTS[(my_index + n) % len(PROMPTS)], max_tokens)
            results.append({"start": started, "end": time.time(), "client": my_index, **r})
            n += 1


async def drive(http_url: str, api_key: str, schedule: list[tuple[float, int]], max_clients: int, results: list,
                timeline: list, max_tokens: int) -> None:
    active = {"clients": 0}
    stop = asyncio.Event()
    tasks = [asyncio.create_task(client_loop(http_url, api_key, active, i, results, stop, max_tokens))
             for i in range(max_clients)]
    import logging

    log = logging.getLogger("autoscale-live")
    for duration, clients in schedule:
        active["clients"] = clients
        timeline.append({"t": time.time(), "clients": clients})
        log.info("load: %d concurrent streams for %.0f s", clients, duration)
        end = time.time() + duration
        while time.time() < end:
            await asyncio.sleep(min(10.0, max(0.0, end - time.time())))
            errors = sum(1 for r in results if r["error"])
            log.info("  %d requests done, %d errors%s", len(results), errors,
                     f" (last: {next(r['error'] for r in reversed(results) if r['error'])[:200]})" if errors else "")
    stop.set()
    await asyncio.gather(*tasks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-clients", type=int, default=2)
    parser.add_argument("--phase-s", type=float, nargs=3, default=[40, 120, 200], help="1x, 4x, 1x durations")
    parser.add_argument("--replica-concurrency", type=int, default=4, help="router cap of streams per replica")
    parser.add_argument("--queue-wait-threshold-s", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--no-cpu-budget", action="store_true",
                        help="let the second replica start even when replicas x engine threads would exceed the "
                             "cores (on a 2-core machine: to see the scale-up and drain mechanics)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "autoscale-live.json")
    parser.add_argument("--img", type=Path, default=ROOT / "docs" / "img" / "autoscale-live-step.png")
    args = parser.parse_args()
    log = setup_logging("autoscale-live")
    from tests.integration.router_stack import RouterStack

    data_dir = Path(tempfile.mkdtemp(prefix="autoscale-live-"))
    log.info("starting router + 1 replica in %s", data_dir)
    t_stack = time.time()
    stack = RouterStack.start(data_dir, replicas=1,
                              router_env={"FLEET_ROUTER_REPLICA_CONCURRENCY": str(args.replica_concurrency)})
    os.environ.update(stack.env)
    log.info("stack up in %.0f s", time.time() - t_stack)
    pool = PoolConfig(PoolSpec(DEFAULT_MODEL, DEFAULT_VERSION, stack.settings.region, 1), min_replicas=1, max_replicas=2,
                      slo_ttft_s=5.0, max_running_per_replica=args.replica_concurrency, target_load=0.7,
                      default_cold_start_s=30.0)
    actuator = LocalActuator(stack.settings, [stack.http_url], admin_token=stack.admin_token, drain_timeout_s=120,
                             cpu_budget=not args.no_cpu_budget)
    actuator.adopt(pool.spec)
    controller = Controller([pool], actuator, stack.http_url, interval_s=1.0, admin_token=stack.admin_token,
                            guard_overrides={"down_cooldown_s": 60.0, "down_window_s": 30.0})
    import signal

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    ctl_thread = threading.Thread(target=controller.run, daemon=True)
    results: list[dict] = []
    timeline: list[dict] = []
    t0 = time.time()
    ctl_thread.start()
    b = args.base_clients
    schedule = [(args.phase_s[0], b), (args.phase_s[1], 4 * b), (args.phase_s[2], b)]
    try:
        asyncio.run(drive(stack.http_url, stack.api_key, schedule, 4 * b, results, timeline, args.max_tokens))
        deadline = time.time() + 120
        while time.time() < deadline and actuator.counts(pool.spec).total + actuator.counts(pool.spec).draining > 1:
            time.sleep(1)
        actuator.wait_idle(60)
    finally:
        controller.stop()
        ctl_thread.join(10)
        stack.stop()
    summary = analyse(results, timeline, controller, actuator, args, t0)
    payload = {"benchmark": "autoscale-live-step", "config": vars(args) | {"out": str(args.out), "img": str(args.img)},
               "summary": summary, "events": actuator.events, "decisions": [d.__dict__ for d in controller.history],
               "requests": results, "load_timeline": timeline, "t0": t0}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2, default=str))
    plot(payload, args.img)
    log.info("summary: %s", json.dumps(summary))
    return 0


def analyse(results: list[dict], timeline: list[dict], controller, actuator, args, t0: float) -> dict:
    step_at = timeline[1]["t"]
    base = [r["ttft_s"] for r in results if r["ttft_s"] is not None and r["start"] < step_at and r["start"] > t0 + 5]
    base_p95 = sorted(base)[int(0.95 * (len(base) - 1))] if base else 0.0
    threshold = base_p95 + args.queue_wait_threshold_s
    breach_at = None
    done = sorted((r for r in results if r["ttft_s"] is not None and r["start"] >= step_at), key=lambda r: r["start"] + r["ttft_s"])
    for i, r in enumerate(done):
        window = [x["ttft_s"] for x in done[max(0, i - 7):i + 1]]
        if len(window) >= 4 and sorted(window)[int(0.95 * (len(window) - 1))] > threshold:
            breach_at = r["start"] + r["ttft_s"]
            break
    starts = [e for e in actuator.events if e["event"] == "start"]
    serving = [e for e in actuator.events if e["event"] == "serving"]
    stops = [e for e in actuator.events if e["event"] == "stopped"]
    failed = [r for r in results if r["error"] or not r["finish_reason"]]
    drain_window = [r for r in results if stops and any(s["t"] - s.get("drain_s", 0) <= r["end"] and r["start"] <= s["t"] for s in stops)]
    return {
        "requests": len(results), "failed_streams": len(failed), "failed_examples": failed[:3],
        "baseline_ttft_p95_s": base_p95, "queue_wait_threshold_s": args.queue_wait_threshold_s,
        "load_step_at_s": step_at - t0,
        "scale_up_started_at_s": starts[0]["t"] - t0 if starts else None,
        "second_replica_serving_at_s": serving[0]["t"] - t0 if serving else None,
        "cold_start_s": serving[0].get("cold_start_s") if serving else None,
        "queue_wait_breach_at_s": breach_at - t0 if breach_at else None,
        "scale_up_before_breach": bool(starts) and (breach_at is None or starts[0]["t"] < breach_at),
        "scale_down_drained_at_s": stops[0]["t"] - t0 if stops else None,
        "drain_s": stops[0].get("drain_s") if stops else None,
        "inflight_at_drain_start": stops[0].get("inflight_at_drain") if stops else None,
        "requests_overlapping_drain": len(drain_window),
        "failed_streams_overlapping_drain": sum(1 for r in drain_window if r in failed),
        "forced_stops": actuator.forced_stops,
    }


def plot(payload: dict, img: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0, s = payload["t0"], payload["summary"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    reqs = [r for r in payload["requests"] if r["ttft_s"] is not None]
    ax1.scatter([r["start"] - t0 for r in reqs], [r["ttft_s"] for r in reqs], s=6, label="TTFT per request")
    ax1.axhline(s["baseline_ttft_p95_s"] + s["queue_wait_threshold_s"], color="red", ls="--", lw=1,
                label="queue-wait threshold (1x TTFT p95 + threshold)")
    ax1.set_ylabel("TTFT, s")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    tl = payload["load_timeline"]
    end = max(r["end"] for r in payload["requests"]) - t0
    ax2.step([x["t"] - t0 for x in tl] + [end], [x["clients"] for x in tl] + [tl[-1]["clients"]], where="post",
             label="concurrent clients (load)")
    events = sorted(payload["events"], key=lambda e: e["t"])
    count, times, curve = 1, [0.0], [1]
    for e in events:
        count += {"serving": 1, "draining": -1}.get(e["event"], 0)
        times.append(e["t"] - t0)
        curve.append(count)
    times.append(end)
    curve.append(count)
    ax2.step(times, curve, where="post", color="green", lw=2, label="serving replicas")
    top = max(x["clients"] for x in tl) + 1
    for e in events:
        ax2.axvline(e["t"] - t0, color="grey", lw=0.6, ls=":")
        ax2.text(e["t"] - t0, top * 0.6, f" {e['event']} {e['replica_id'].rsplit('-', 1)[-1]}", rotation=90, fontsize=7)
    ax1.axvline(s["load_step_at_s"], color="black", lw=0.8)
    if s.get("scale_up_started_at_s"):
        ax1.axvline(s["scale_up_started_at_s"], color="green", lw=0.8, ls="--", label="controller starts replica 2")
        ax1.legend(fontsize=8)
    ax2.set_xlabel("seconds since start")
    ax2.set_ylabel("clients / replicas")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.suptitle("Live load step 1x -> 4x -> 1x: local actuator, real replicas")
    fig.tight_layout()
    img.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(img, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
