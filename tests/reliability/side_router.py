"""A second real router process in front of a RouterStack's replicas (the same registry), on its own ports and
with its own router settings: for tests that stop a router, or need a small admission capacity, without
restarting the stack's router. It gets no replica state reports (the replicas report to the stack's router),
so it places round-robin and counts only its own streams against FLEET_ROUTER_REPLICA_CONCURRENCY."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
from tritonclient.grpc import InferRequestedOutput
from tritonclient.utils import InferenceServerException

from common import processes
from common.settings import REPO_ROOT
from tests.integration.platform import router_fleet
from tests.integration.router_client import CHATML, build_inputs, stream_once
from tests.integration.router_stack import RouterStack

MODEL = "smollm2-135m"


@dataclass
class SideRouter:
    proc: subprocess.Popen
    http_url: str
    grpc_url: str
    http_port: int
    log: Path
    admin_token: str

    @classmethod
    def start(cls, stack: RouterStack, log: Path, **router_env: str) -> "SideRouter":
        http_port, grpc_port, internal_port = processes.free_port(), processes.free_port(), processes.free_port()
        proc = processes.spawn([sys.executable, "-m", "router_service", "--no-usage", "--http-port", str(http_port),
                                "--grpc-port", str(grpc_port), "--internal-port", str(internal_port)],
                               log, env={**stack.env, **router_env}, cwd=REPO_ROOT)
        side = cls(proc, f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", http_port, log, stack.admin_token)
        try:
            processes.wait_until(lambda: httpx.get(f"{side.http_url}/health", timeout=1).status_code == 200, 60,
                                 "second router", proc, log)
        except BaseException:
            side.stop()
            raise
        return side

    def fleet(self) -> dict:
        return router_fleet(self.http_url, self.admin_token)

    def waiting(self) -> int:
        return sum(q["waiting"] for q in self.fleet()["queues"].values())

    def inflight(self) -> int:
        return sum(r["inflight"] for r in self.fleet()["replicas"])

    def serving(self) -> int:
        return sum(r["state"] == "serving" for r in self.fleet()["replicas"])

    def stop(self) -> None:
        processes.stop_pid(self.proc.pid)


LONG_PROMPT = CHATML.format(q="Describe the city of Rome in detail, street by street.")


async def until(check, timeout_s: float = 30) -> None:
    """Poll a blocking check (a router's /admin/fleet) off the event loop until it holds."""
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, f"{check} did not hold within {timeout_s} s"
        await asyncio.sleep(0.1)


async def http_completion(url: str, api_key: str, tier: str) -> tuple[int, dict, dict, float]:
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(f"{url}/v1/completions", headers={"authorization": f"Bearer {api_key}"},
                            json={"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 20, "priority": tier})
    return r.status_code, dict(r.headers), r.json(), time.monotonic() - started


async def timed(coro) -> tuple[object, float]:
    started = time.monotonic()
    out = await coro
    return out, time.monotonic() - started


async def fill_slots(side: SideRouter, client, api_key: str, on_token=None) -> list[asyncio.Task]:
    """One long interactive stream per slot (one per serving replica), each running once this returns; a first
    short request loads the router's tokenizer (seconds here), so the fillers are placed as they arrive."""
    warm = await stream_once(client, MODEL, LONG_PROMPT, 1, api_key, tier="interactive")
    assert warm.error is None, warm
    slots = await asyncio.to_thread(side.serving)
    fillers = [asyncio.create_task(stream_once(client, MODEL, LONG_PROMPT, 2000, api_key, on_token=on_token,
                                               tier="interactive")) for _ in range(slots)]
    await until(lambda: side.inflight() == slots)
    return fillers


async def idle_stream(client, api_key: str, answered: asyncio.Event) -> tuple[str, float]:
    """A ModelStreamInfer stream whose one request is answered and which then stays open, sending nothing;
    returns how it ended (status and message) and when."""
    never = asyncio.Event()

    async def requests():
        yield {"model_name": MODEL, "inputs": build_inputs(LONG_PROMPT, 1), "request_id": "idle",
               "outputs": [InferRequestedOutput(n) for n in ("output_ids", "finish_reason")]}
        await never.wait()
    try:
        async for result, error in client.stream_infer(requests(), headers={"authorization": f"Bearer {api_key}"}):
            if error is not None:
                return str(error), time.monotonic()
            if result.as_numpy("finish_reason").reshape(-1)[0]:
                answered.set()
    except InferenceServerException as exc:
        return f"{exc.status()}: {exc.message()}", time.monotonic()
    except grpc.aio.AioRpcError as exc:
        return f"{exc.code().name}: {exc.details()}", time.monotonic()
    return "ended", time.monotonic()


def accepts(side: SideRouter) -> bool:
    try:
        httpx.get(f"{side.http_url}/health", timeout=0.5)
    except httpx.TransportError:
        return False
    return True
