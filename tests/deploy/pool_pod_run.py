"""The pool pod's life, driven inside the test's network namespace (as root), for tests/deploy/test_pool_pod.py:
this process plays the kubelet (starts the init container, then `triton`, marks the pod Ready from its readiness
probe, runs the preStop hook, sends SIGTERM) and the API server's pod list (tests/deploy/kube_api_standin.py, TLS,
bearer token); the registrar is the autoscaler's own (`KubernetesActuator.sync_replicas`, ticking as the
autoscaler does) against that API. Every container runs as the plan says (tests/deploy/pod_harness.py).

    python -m tests.deploy.pool_pod_run PLAN.json     # writes what it saw to <work>/seen.json

Each step's outcome goes into `seen` (the test asserts on it); a step that cannot go on stops the run."""
from __future__ import annotations

import datetime
import json
import math
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import httpx

from tests.deploy import kube_api_standin

seen: dict[str, Any] = {}


def wait(what: str, check: Callable[[], Any], timeout_s: float, every_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            got = check()
            if got:
                return got
        except (OSError, ValueError, KeyError, httpx.HTTPError):
            pass
        time.sleep(every_s)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def fleet(router: str, token: str) -> dict[str, Any]:
    """The router's view of the pod (`GET /admin/fleet`): its row and what its reports said."""
    got = httpx.get(f"http://{router}:8030/admin/fleet", headers={"authorization": f"Bearer {token}"}, timeout=5)
    got.raise_for_status()
    return {r["replica_id"]: r for r in got.json()["replicas"]}


def stream(router: str, api_key: str, model: str, max_tokens: int, on_first: Callable[[], None] | None = None
           ) -> dict[str, Any]:
    """One streamed completion through a router: its status, chunks and finish reason."""
    body = {"model": model, "prompt": "The pool pod says", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    out: dict[str, Any] = {"status": 0, "chunks": 0, "finish": None, "error": "", "decode_s": 0.0}
    with httpx.stream("POST", f"http://{router}:8030/v1/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {api_key}"}) as resp:
        out["status"] = resp.status_code
        if resp.status_code != 200:
            out["error"] = resp.read().decode()[:500]
            return out
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            out["chunks"] += 1
            out["finish"] = choice.get("finish_reason") or out["finish"]
            if out["chunks"] == 1:
                first_at = time.monotonic()
                if on_first is not None:
                    on_first()
            out["decode_s"] = time.monotonic() - first_at  # first chunk to last: the pod's decode speed
    return out


def generated(pod_ip: str) -> float:
    """Tokens the pod's engine generated so far (its Triton metrics): which replica served a request."""
    text = urllib.request.urlopen(f"http://{pod_ip}:8002/metrics", timeout=2).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(r"^fleet_engine_generated_tokens_total\{[^}]*\} (\S+)$",
                                                       text, re.M))


def registrar(plan: dict[str, Any], stop: threading.Event) -> None:
    """The autoscaler's registrar, ticking against the API stand-in (what `counts` does every tick)."""
    from kubernetes import client

    from autoscale.actuators import PoolSpec
    from autoscale.actuators.kubernetes import KubernetesActuator

    config = client.Configuration(host="https://127.0.0.1:6443",
                                  api_key={"authorization": f"Bearer {plan['sa_token']}"})
    config.ssl_ca_cert = plan["ca"]
    actuator = KubernetesActuator("llm", api_client=client.ApiClient(config), db_url=plan["db_url"])
    pool = PoolSpec(plan["model"], plan["version"])
    while not stop.is_set():
        try:
            states = actuator.sync_replicas(pool)
            if states != (seen.get("registrar_states") or [None])[-1]:  # changes only
                seen.setdefault("registrar_states", []).append(states)
        except Exception as exc:  # noqa: BLE001 - recorded for the test, the tick goes on as the autoscaler's does
            seen.setdefault("registrar_errors", []).append(repr(exc))
        stop.wait(0.5)


def registry_row(plan: dict[str, Any]) -> dict[str, str] | None:
    from registry import queries
    from registry.db import session_scope

    with session_scope(plan["db_url"]) as s:
        row = next((r for r in queries.list_replicas(s, plan["model"]) if r.replica_id == plan["pod_name"]), None)
        return {"state": row.state, "grpc_url": row.grpc_url} if row else None


def exited(proc: subprocess.Popen, what: str) -> bool:
    """False while it runs; raises once it has exited (nothing left to wait for)."""
    if proc.poll() is not None:
        raise RuntimeError(f"{what} exited with {proc.returncode}")
    return False


def spawn(cmd: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen(["bash", "-c", cmd], stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def run(plan: dict[str, Any]) -> None:
    work, pod_ip, name = Path(plan["work"]), plan["pod_ip"], plan["pod_name"]
    kube_api_standin.TOKENS[plan["pod_token"]] = {"username": "system:serviceaccount:llm:llm-replica", "pod": name,
                                                  "audiences": ["llm-fleet-report"]}
    api = kube_api_standin.server(6443, plan["ca"], plan["tls_key"], plan["sa_token"], str(work / "api.jsonl"))
    threading.Thread(target=api.serve_forever, daemon=True).start()
    routers = [spawn(r["cmd"], work / f"router-{i}.log") for i, r in enumerate(plan["routers"])]
    ips = [r["ip"] for r in plan["routers"]]
    for ip in ips:
        wait(f"router {ip}", lambda: httpx.get(f"http://{ip}:8030/health", timeout=1).status_code == 200, 60)
    started = time.monotonic()
    stage = subprocess.run(["bash", "-c", plan["stage"]], capture_output=True, text=True, timeout=120)
    seen["stage"] = {"rc": stage.returncode, "out": stage.stdout[-500:], "err": stage.stderr[-1500:],
                     "s": round(time.monotonic() - started, 1)}
    if stage.returncode != 0:
        return
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": dict(plan["pod_meta"], name=name, namespace="llm",
                                                               creationTimestamp=now_iso()),
           "status": {"phase": "Pending", "podIP": pod_ip, "conditions": []}}
    kube_api_standin.PODS[name] = pod
    stop = threading.Event()
    threading.Thread(target=registrar, args=(plan, stop), daemon=True).start()
    triton = spawn(plan["triton"], work / "triton.log")
    try:
        wait("triton ready", lambda: exited(triton, "triton") or urllib.request.urlopen(
            f"http://{pod_ip}:8000/v2/health/ready", timeout=1).status == 200, 120)
        seen["ready_s"] = round(time.monotonic() - started, 1)
        pod["status"] = {"phase": "Running", "podIP": pod_ip, "conditions": [
            {"type": "Ready", "status": "True", "lastTransitionTime": now_iso()}]}  # the readiness probe passed
        seen["registered"] = wait("registered serving", lambda: (registry_row(plan) or {}).get("state") == "serving"
                                  and registry_row(plan), 30)
        seen["reports"] = {ip: wait(f"reports at {ip}", lambda: fleet(ip, plan["viewer"]).get(name, {})
                                    .get("reporting") and fleet(ip, plan["viewer"])[name], 30) for ip in ips}
        seen["served"] = {}
        for ip in ips:
            before = generated(pod_ip)
            got = stream(ip, plan["api_key"], plan["model"], 8)
            seen["served"][ip] = dict(got, generated=generated(pod_ip) - before)
        drain(plan, pod, triton, ips)
    finally:
        stop.set()
        time.sleep(0.6)
        for proc in [triton, *routers]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [triton, *routers]:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        api.shutdown()


def drain(plan: dict[str, Any], pod: dict[str, Any], triton: subprocess.Popen, ips: list[str]) -> None:
    """Termination: a long stream in flight through the first router; the API server marks the pod deleted and
    the kubelet runs preStop; then SIGTERM; then the pod is gone from the API."""
    name, pod_ip = plan["pod_name"], plan["pod_ip"]
    first = threading.Event()
    inflight: dict[str, Any] = {}
    # the in-flight stream must outlast preStop's start, both routers seeing `draining` and a refused request
    # (~3 s): about 5 s at this machine's decode speed, measured on the streams served before
    s_per_token = max(got["decode_s"] / max(1, got["chunks"] - 1) for got in seen["served"].values())
    long_tokens = min(1024, max(plan["long_tokens"], math.ceil(4.5 / max(s_per_token, 1e-3))))
    seen["long_tokens"] = long_tokens

    def read() -> None:
        inflight.update(stream(ips[0], plan["api_key"], plan["model"], long_tokens, first.set))
        inflight["done_at"] = time.monotonic()

    reader = threading.Thread(target=read)
    reader.start()
    first.wait(30)
    pod["metadata"]["deletionTimestamp"] = now_iso()  # `kubectl delete pod`: the kubelet starts termination
    prestop = spawn(plan["prestop"], Path(plan["work"]) / "prestop.log")
    t0 = time.monotonic()
    seen["draining_seen"] = {ip: wait(f"draining at {ip}", lambda: fleet(ip, plan["viewer"]).get(name, {})
                                      .get("draining"), 15) and round(time.monotonic() - t0, 2) for ip in ips}
    seen["registry_while_draining"] = registry_row(plan)
    seen["new_while_draining"] = stream(ips[1], plan["api_key"], plan["model"], 4)
    seen["inflight_running_at_new"] = reader.is_alive()
    seen["prestop_rc"] = prestop.wait(120)
    seen["prestop_s"] = round(time.monotonic() - t0, 1)
    prestop_done = time.monotonic()
    seen["prestop_log"] = (Path(plan["work"]) / "prestop.log").read_text()[-1500:]
    reader.join(60)
    seen["inflight"] = inflight
    seen["stream_done_before_prestop"] = inflight.pop("done_at", prestop_done + 1) <= prestop_done
    triton.send_signal(signal.SIGTERM)  # after preStop, as the kubelet does
    seen["triton_rc"] = triton.wait(60)
    del kube_api_standin.PODS[name]  # the pod object is removed once its containers are gone
    seen["deregistered"] = wait("deregistered", lambda: registry_row(plan) is None, 15)
    seen["after"] = {ip: wait(f"{ip} forgets the pod", lambda: name not in fleet(ip, plan["viewer"]), 15)
                     and stream(ip, plan["api_key"], plan["model"], 4) for ip in ips}


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    try:
        run(plan)
    except Exception as exc:  # noqa: BLE001 - what stopped the run, for the test's message
        seen["failed"] = repr(exc)
    finally:
        Path(plan["work"], "seen.json").write_text(json.dumps(seen, indent=1, default=str))


if __name__ == "__main__":
    main()
