"""Self-healing on a real router in front of two real Triton replicas (SmolLM2): a slow replica is not a dead
one, the last serving replica of a model is never cordoned on timeouts alone, and a cordon heals by probing,
with no operator (docs/reliability.md, Self-healing; issue 34).

"Only one replica" is made by an operator cordon of the other one (admin API), undone after the test.
The interactive tier's inter-token timeout is 20 ms here, shorter than any real decode step on these CPUs:
every gap between tokens passes it, so those streams run on a replica that is "slower than the timeout"
while it keeps reporting its engine's steps. The standard tier's is 3 s, for the hung (SIGSTOP) cases.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
import tritonclient.grpc.aio as grpcaio

from tests.integration.router_client import CHATML, stream_once
from tests.integration.router_stack import RouterStack

pytestmark = pytest.mark.integration
MODEL = "smollm2-135m"
PROBE_MAX_INTERVAL_S, PROBE_TIMEOUT_S = 2.0, 2.0
# the stated time: a replica back from a freeze serves again within one probe interval + one probe timeout
# (+ the registry reload, 0.5 s); with the defaults (8 s + 5 s) that is about 14 s
HEAL_WITHIN_S = PROBE_MAX_INTERVAL_S + PROBE_TIMEOUT_S + 3.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = RouterStack.start(tmp_path_factory.mktemp("healing"), replicas=2, engine_env={"FLEET_ENGINE_DTYPE": "fp32"},
                          router_env={"FLEET_ROUTER_INTER_TOKEN_TIMEOUT_S": "interactive=0.02,standard=3,batch=3",
                                      "FLEET_ROUTER_FIRST_TOKEN_TIMEOUT_S": "20",
                                      "FLEET_ROUTER_PROBE_FIRST_S": "0.5",
                                      "FLEET_ROUTER_PROBE_MAX_INTERVAL_S": str(PROBE_MAX_INTERVAL_S),
                                      "FLEET_ROUTER_PROBE_TIMEOUT_S": str(PROBE_TIMEOUT_S)})
    yield s
    for rid in s.replica_ids:
        _signal(s, rid, signal.SIGCONT)
    s.stop()


def _signal(stack, rid: str, sig: int) -> None:
    try:
        os.killpg(stack.replica_pid(rid), sig)
    except (ProcessLookupError, FileNotFoundError):
        pass


def _admin(stack, rid: str, action: str) -> None:
    r = httpx.post(f"{stack.http_url}/admin/replicas/{rid}/{action}",
                   headers={"authorization": f"Bearer {stack.admin_token}"}, timeout=10)
    assert r.status_code == 200, r.text


def _states(stack) -> dict[str, str]:
    return {r["replica_id"]: r["state"] for r in stack.fleet()["replicas"]}


def _metric(stack, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in stack.metrics().splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


async def _stream(stack, prompt: str, max_tokens: int, tier: str, on_token=None):
    client = grpcaio.InferenceServerClient(stack.grpc_url)
    try:
        return await asyncio.wait_for(stream_once(client, MODEL, prompt, max_tokens, stack.api_key, on_token=on_token,
                                                  tier=tier), 90)
    finally:
        await client.close()


def _only(stack):
    """Operator-cordon the second replica: the first is the only one serving."""
    only, other = stack.replica_ids
    _admin(stack, other, "cordon")
    deadline = time.monotonic() + 10
    while _states(stack)[other] != "cordoned" and time.monotonic() < deadline:
        time.sleep(0.1)
    return only, other


def test_a_replica_slower_than_the_inter_token_timeout_that_keeps_reporting_is_not_cordoned(stack):
    only, other = _only(stack)
    try:
        slow_before = _metric(stack, "fleet_router_slow_replica_waits_total")

        async def main():
            first = asyncio.create_task(_stream(stack, CHATML.format(q="Describe Rome."), 24, "interactive"))
            await asyncio.sleep(0.5)  # the second arrives while the replica is held back (overloaded)
            second = asyncio.create_task(_stream(stack, CHATML.format(q="Describe Paris."), 8, "interactive"))
            return await first, await second
        first, second = asyncio.run(main())
        for out in (first, second):  # both finish: the second waited at the router, nothing was cut
            assert out.error is None, out.error_message
            assert out.finish_reason in ("length", "stop") and out.ids
        assert len(first.ids) == 24 or first.finish_reason == "stop"
        assert _metric(stack, "fleet_router_slow_replica_waits_total") > slow_before  # the timeout did pass
        assert _states(stack)[only] == "serving"  # ... and the replica was judged slow, not dead
        assert _metric(stack, "fleet_router_cordons_total") == 0
    finally:
        _admin(stack, other, "uncordon")
        stack.wait_serving(stack.replica_ids)


def test_the_last_replica_frozen_and_resumed_finishes_its_stream_and_serves_again(stack):
    only, other = _only(stack)
    frozen: list[float] = []
    try:
        async def freeze_after_8(so_far):
            if not frozen and len(so_far.ids) >= 8:
                _signal(stack, only, signal.SIGSTOP)
                frozen.append(time.monotonic())

        async def main():
            stream = asyncio.create_task(_stream(stack, CHATML.format(q="Write a long story about the sea."), 64,
                                                 "standard", freeze_after_8))
            while not frozen:
                await asyncio.sleep(0.05)
            await asyncio.sleep(5.0)  # past the 3 s inter-token timeout; no state reports meanwhile
            during = asyncio.create_task(_stream(stack, CHATML.format(q="Say hello."), 4, "standard"))
            await asyncio.sleep(3.0)
            assert _states(stack)[only] == "serving", "the last serving replica was cordoned on a timeout"
            _signal(stack, only, signal.SIGCONT)
            resumed = time.monotonic()
            out, late = await stream, await during
            after = await _stream(stack, CHATML.format(q="Say bye."), 4, "standard")
            return out, late, after, time.monotonic() - resumed
        out, late, after, took = asyncio.run(main())
        # the stream went on where it was (same upstream call): no error, every token
        assert out.error is None, out.error_message
        assert len(out.ids) == 64 or out.finish_reason == "stop"
        assert late.error is None and late.ids, late.error_message  # a request sent during the freeze waited
        assert after.error is None and after.ids, after.error_message  # the model serves again at once
        assert took < 30, took
        assert _metric(stack, "fleet_router_replica_suspects_total") >= 1
    finally:
        _signal(stack, only, signal.SIGCONT)
        _admin(stack, other, "uncordon")
        stack.wait_serving(stack.replica_ids)


def test_a_cordoned_replica_is_probed_and_serves_again_after_it_resumes(stack):
    stopped: list[str] = []

    async def hang_busy(so_far):
        if stopped or len(so_far.ids) < 6:
            return
        busy = [r["replica_id"] for r in stack.fleet()["replicas"] if r["inflight"] > 0]
        assert len(busy) == 1, busy
        _signal(stack, busy[0], signal.SIGSTOP)
        stopped.append(busy[0])
    try:
        out = asyncio.run(_stream(stack, CHATML.format(q="Describe the city of Rome in detail."), 32, "standard",
                                  hang_busy))
        assert stopped and out.error is None, out.error_message  # resumed on the other replica
        assert _states(stack)[stopped[0]] == "cordoned"
        _signal(stack, stopped[0], signal.SIGCONT)
        resumed = time.monotonic()
        while _states(stack)[stopped[0]] != "serving" and time.monotonic() - resumed < HEAL_WITHIN_S + 10:
            time.sleep(0.2)
        healed = time.monotonic() - resumed
        assert _states(stack)[stopped[0]] == "serving", "no probe put the replica back"
        assert healed < HEAL_WITHIN_S, healed
        assert _metric(stack, "fleet_router_uncordons_total") >= 1
        stack.wait_serving(stack.replica_ids)  # in the registry as well (the router wrote `serving` back)
    finally:
        for rid in stopped:
            _signal(stack, rid, signal.SIGCONT)


def test_a_replica_that_keeps_failing_its_probe_is_restarted_by_the_local_actuator(stack):
    from autoscale.actuators import PoolSpec
    from autoscale.actuators.local import LocalActuator
    from fleet.seed import DEFAULT_VERSION

    pool = PoolSpec(MODEL, DEFAULT_VERSION)
    actuator = LocalActuator(stack.settings, router_urls=[stack.http_url], admin_token=stack.admin_token,
                             cpu_budget=False, restart_cordoned_after_s=2.0)
    actuator.adopt(pool)
    assert sorted(actuator.replicas) == stack.replica_ids
    stopped: list[str] = []

    async def hang_busy(so_far):
        if not stopped and len(so_far.ids) >= 6:
            busy = [r["replica_id"] for r in stack.fleet()["replicas"] if r["inflight"] > 0]
            _signal(stack, busy[0], signal.SIGSTOP)
            stopped.append(busy[0])
    try:
        out = asyncio.run(_stream(stack, CHATML.format(q="Describe the city of Rome in detail."), 32, "standard",
                                  hang_busy))
        assert stopped and out.error is None, out.error_message
        rid, old_pid = stopped[0], stack.replica_pid(stopped[0])
        time.sleep(1.0)  # the router's cordon reaches the registry
        counts = actuator.counts(pool)
        assert (counts.serving, counts.cordoned) == (1, 1), counts  # missing capacity, not serving
        assert actuator.heal(pool) == []  # not yet: the router's probes get their chance first
        time.sleep(2.5)  # it stays frozen: every probe fails, the actuator sees it cordoned all along
        assert actuator.heal(pool) == [rid]
        actuator.wait_idle(120)
        assert stack.replica_pid(rid) != old_pid
        stack.wait_serving([rid])  # the router took the restarted replica back (a new pid lifts its cordon)
        assert _states(stack)[rid] == "serving"
        assert actuator.counts(pool).serving == 2
    finally:
        for rid in stopped:
            _signal(stack, rid, signal.SIGCONT)
