"""A hung or broken replica never hangs a caller, on a real router in front of three real Triton replicas
(SmolLM2 fp32, so greedy and seeded runs are exact): first-token / inter-token timeouts resume the stream
elsewhere and cordon the hung replica; resumed text is exact inside a multi-byte character; a seeded
sampled stream continues its random stream; a request that took two replicas down is not tried on a
third; a stream past its tier's total stream deadline ends in band (finish_reason `stream_deadline`); one bad request on a gRPC stream is answered in-band; a non-streamed HTTP request whose caller left
stops generating. Replicas are hung with SIGSTOP and given back with SIGCONT + uncordon after each test.
On a second router with one slot per replica: the total deadline counts from arrival (queue wait included), and
a router stopping (SIGTERM) refuses its queued requests at once while its running streams finish."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import InferInput, InferRequestedOutput

from common.text import REPLACEMENT_CHAR, load_tokenizer
from tests.integration.router_client import CHATML, build_inputs, stream_once
from tests.observability.otlp_receiver import check_resumed_trace
from tests.reliability.conftest import INTER_TOKEN_S, start_fault_stack
from tests.reliability.side_router import (LONG_PROMPT, SideRouter, accepts, fill_slots, http_completion, idle_stream,
                                           timed, until)

pytestmark = pytest.mark.integration
MODEL = "smollm2-135m"
SLOW_READER_S = 3.0
BATCH_STREAM_DEADLINE_S = 2.0  # batch streams only: the interactive tests keep the default (300 s)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, otlp_receiver):
    s = start_fault_stack(tmp_path_factory.mktemp("reliability"), FLEET_ROUTER_FIRST_TOKEN_TIMEOUT_S="20",
                          FLEET_ROUTER_STREAM_QUEUE="8", FLEET_ROUTER_SLOW_READER_TIMEOUT_S=str(SLOW_READER_S),
                          FLEET_ROUTER_STREAM_DEADLINE_S=f"batch={BATCH_STREAM_DEADLINE_S}",
                          FLEET_OTLP_ENDPOINT=otlp_receiver.endpoint,  # traces: the resume's two attempts
                          replica_env={"FLEET_OTLP_ENDPOINT": otlp_receiver.endpoint})
    yield s
    for rid in s.replica_ids:  # never leave a stopped process behind
        _cont(s, rid)
    s.stop()


@pytest.fixture(scope="module")
def tokenizer(stack):
    from fleet.seed import DEFAULT_MODEL  # noqa: F401 (the stack built the weights)
    path = next(stack.settings.data_dir.rglob("tokenizer.json"))
    return load_tokenizer(path.parent)


def _cont(stack, rid: str) -> None:
    try:
        os.killpg(stack.replica_pid(rid), signal.SIGCONT)
    except (ProcessLookupError, FileNotFoundError):
        pass


def _restore(stack, stopped: list[str]) -> None:
    """SIGCONT the hung replicas and put them back in service (as an operator would after a look)."""
    for rid in stopped:
        _cont(stack, rid)
        r = httpx.post(f"{stack.http_url}/admin/replicas/{rid}/uncordon",
                       headers={"authorization": f"Bearer {stack.admin_token}"}, timeout=10)
        assert r.status_code == 200, r.text
    stack.wait_serving(stack.replica_ids)


def _busy(stack, exclude: list[str]) -> list[str]:
    return [r["replica_id"] for r in stack.fleet()["replicas"] if r["inflight"] > 0 and r["replica_id"] not in exclude]


def _metric(stack, name: str) -> float:
    total = 0.0
    for line in stack.metrics().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _stream(stack, prompt, max_tokens, on_token=None, **kw):
    client = grpcaio.InferenceServerClient(stack.grpc_url)
    try:
        # bounded: before the timeouts existed, a hung replica held this call forever
        return await asyncio.wait_for(stream_once(client, MODEL, prompt, max_tokens, stack.api_key, on_token=on_token,
                                                  tier="interactive", **kw), 90)
    finally:
        await client.close()


def _hang_mid_stream(stack, prompt, max_tokens, when, stopped: list[str], **kw):
    """Stream; once `when(result_so_far)` is true, SIGSTOP the replica serving it (once)."""
    async def on_token(so_far):
        if stopped or not when(so_far):
            return
        busy = _busy(stack, stopped)
        assert len(busy) == 1, busy
        os.killpg(stack.replica_pid(busy[0]), signal.SIGSTOP)
        stopped.append(busy[0])
    started = time.monotonic()
    out = asyncio.run(_stream(stack, prompt, max_tokens, on_token, **kw))
    return out, time.monotonic() - started


def test_one_bad_request_on_a_grpc_stream_is_answered_in_band(stack):
    async def main():
        client = grpcaio.InferenceServerClient(stack.grpc_url)
        outputs = [InferRequestedOutput(n) for n in ("text_output", "output_ids", "finish_reason", "usage")]

        async def requests():
            for rid, max_tokens in (("good-1", 8), ("bad-1", -5), ("good-2", 8)):
                yield {"model_name": MODEL, "inputs": build_inputs(CHATML.format(q="Say hi."), max_tokens),
                       "outputs": outputs, "request_id": rid}
        finished, errors = set(), []
        async for result, error in client.stream_infer(requests(), headers={"authorization": f"Bearer {stack.api_key}"}):
            if error is not None:
                errors.append(str(error))
                continue
            if result.as_numpy("finish_reason").reshape(-1)[0]:
                finished.add(result.get_response().id)
        await client.close()
        return finished, errors
    finished, errors = asyncio.run(asyncio.wait_for(main(), 60))
    assert finished == {"good-1", "good-2"}, (finished, errors)
    assert len(errors) == 1 and "bad-1" in errors[0] and "max_tokens" in errors[0], errors


def test_non_streamed_http_request_stops_generating_when_the_caller_leaves(stack):
    before = _metric(stack, "fleet_router_cancels_total")
    body = {"model": MODEL, "prompt": CHATML.format(q="Write a very long story about the sea."), "max_tokens": 400,
            "temperature": 0, "stream": False}
    with pytest.raises(httpx.ReadTimeout):  # the caller gives up after 2 s and closes the connection
        httpx.post(f"{stack.http_url}/v1/completions", json=body, timeout=2.0,
                   headers={"authorization": f"Bearer {stack.api_key}"})
    deadline = time.monotonic() + 10  # 400 tokens would take far longer on these CPUs
    while time.monotonic() < deadline and (any(r["inflight"] for r in stack.fleet()["replicas"])
                                           or _metric(stack, "fleet_router_cancels_total") <= before):
        time.sleep(0.1)
    assert all(r["inflight"] == 0 for r in stack.fleet()["replicas"])
    assert _metric(stack, "fleet_router_cancels_total") == before + 1


def test_hung_replica_is_timed_out_cordoned_and_the_stream_resumes_exactly(stack, otlp_receiver):
    prompt = CHATML.format(q="Describe the city of Rome in detail.")
    reference = asyncio.run(_stream(stack, prompt, 48))
    assert reference.error is None and len(reference.ids) >= 24
    stopped: list[str] = []
    try:
        out, took = _hang_mid_stream(stack, prompt, 48, lambda so_far: len(so_far.ids) >= 8, stopped)
        assert stopped, "the stream finished before a replica could be hung"
        assert out.error is None, out.error_message
        assert out.ids == reference.ids and out.text == reference.text
        # the caller waited one inter-token timeout, not forever
        assert took < reference.duration_s + INTER_TOKEN_S + 20, took
        fleet = {r["replica_id"]: r for r in stack.fleet()["replicas"]}
        assert fleet[stopped[0]]["state"] == "cordoned"
        assert _metric(stack, "fleet_router_stream_timeouts_total") >= 1
        again = asyncio.run(_stream(stack, CHATML.format(q="Say hello."), 8))  # routed around the hung one
        assert again.error is None and again.ids
        check_resumed_trace(otlp_receiver, out.response_id, stopped[0])
    finally:
        _restore(stack, stopped)


def test_resume_inside_a_multibyte_character_keeps_the_text_exact(stack, tokenizer):
    prompt = CHATML.format(q="Reply with twenty party emojis like 🎉🎊🥳 and nothing else.")
    reference = asyncio.run(_stream(stack, prompt, 40))
    assert reference.error is None
    cuts = [k for k in range(1, len(reference.ids)) if tokenizer.decode(reference.ids[:k]).endswith(REPLACEMENT_CHAR)]
    assert cuts, "the reference output has no token boundary inside a character; pick another prompt"
    inside = False
    for _ in range(3):  # the replica stops a token or two after the caller saw the cut: retry until inside
        stopped: list[str] = []
        try:
            # hang the replica right after a token that ends inside a character
            out, _ = _hang_mid_stream(stack, prompt, 40, lambda so_far: len(so_far.ids) in cuts, stopped)
            assert stopped and out.error is None, out.error_message
            assert out.ids == reference.ids
            assert out.text == reference.text
            assert REPLACEMENT_CHAR not in out.text.rstrip(REPLACEMENT_CHAR)  # (max_tokens may end inside the last)
        finally:
            _restore(stack, stopped)
        resumed_at = _resume_point(stack, out.response_id)
        if resumed_at in cuts:
            inside = True
            break
    assert inside, "no resume fell inside a character in three tries"


def _resume_point(stack, request_id: str) -> int | None:
    """How many tokens the router had when it resumed this request (from its log)."""
    log = (stack.settings.logs_dir / "router.log").read_text()
    found = re.findall(rf"resuming {re.escape(request_id)} on another replica from prompt \+ (\d+) emitted", log)
    return int(found[-1]) if found else None


def test_seeded_sampled_stream_resumes_the_same_random_stream(stack):
    prompt = CHATML.format(q="Write a long, detailed story about a new fruit and its taste.")
    for seed in range(1, 6):  # a seed whose sample does not stop early
        reference = asyncio.run(_stream(stack, prompt, 40, temperature=1.0, seed=seed))
        if len(reference.ids) >= 20:
            break
    other = asyncio.run(_stream(stack, prompt, 40, temperature=1.0, seed=seed + 1000))
    assert reference.error is None and len(reference.ids) >= 20 and other.ids != reference.ids
    stopped: list[str] = []
    try:
        out, _ = _hang_mid_stream(stack, prompt, 40, lambda so_far: len(so_far.ids) >= 6, stopped,
                                  temperature=1.0, seed=seed)
        assert stopped and out.error is None, out.error_message
        assert out.ids == reference.ids and out.text == reference.text
    finally:
        _restore(stack, stopped)


def test_a_reader_that_stops_reading_is_bounded_and_frees_its_replica_slot(stack):
    # A tiny HTTP/2 receive window (no BDP growth): the router's sends block after a few responses.
    args = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]

    async def main():
        client = grpcaio.InferenceServerClient(stack.grpc_url, channel_args=args)
        release = asyncio.Event()

        async def requests():
            yield {"model_name": MODEL, "inputs": build_inputs(CHATML.format(q="Write a very long story."), 400),
                   "outputs": [InferRequestedOutput(n) for n in ("text_output", "output_ids", "finish_reason", "usage")],
                   "request_id": "slow-reader"}
            await release.wait()
        stream = client.stream_infer(requests(), headers={"authorization": f"Bearer {stack.api_key}"})
        first, error = await anext(stream)  # the call is running; from now on this caller reads nothing
        assert error is None
        stalled_at = time.monotonic()
        while time.monotonic() - stalled_at < 60 and any(r["inflight"] for r in stack.fleet()["replicas"]):
            await asyncio.sleep(0.2)
        freed_after = time.monotonic() - stalled_at
        busy = [r["replica_id"] for r in stack.fleet()["replicas"] if r["inflight"]]
        tokens, errors = 0, []
        async for result, error in stream:  # read on: what was queued, then the request's in-band error
            if error is not None:
                errors.append(str(error))
                break
            tokens += len(result.as_numpy("output_ids").reshape(-1))
        release.set()
        await client.close()
        return freed_after, busy, tokens, errors
    freed_after, busy, tokens, errors = asyncio.run(asyncio.wait_for(main(), 90))
    assert not busy and freed_after < 40, (busy, freed_after)  # the slot was freed while the caller slept
    assert errors and "RESOURCE_EXHAUSTED" in errors[0] and "read no response" in errors[0], errors
    assert tokens < 200  # generation stopped early: what was queued, not the whole answer


def test_a_request_that_took_two_replicas_down_is_not_tried_on_a_third(stack):
    prompt = CHATML.format(q="Tell me a long story about a lighthouse keeper.")
    retries_before = _metric(stack, "fleet_router_retries_total")
    stopped: list[str] = []

    async def on_token(so_far):
        # hang whichever replica serves the stream: after 4 tokens, then again 4 tokens after the resume
        if len(so_far.ids) >= 4 * (len(stopped) + 1) and len(stopped) < 2:
            busy = _busy(stack, stopped)
            if len(busy) == 1:
                os.killpg(stack.replica_pid(busy[0]), signal.SIGSTOP)
                stopped.append(busy[0])
    try:
        started = time.monotonic()
        out = asyncio.run(_stream(stack, prompt, 200, on_token))
        took = time.monotonic() - started
        assert len(stopped) == 2, stopped
        assert out.error is not None and "ABORTED" in out.error_message and "not tried on a third" in out.error_message, \
            (out.error, out.error_message)
        assert took < 2 * INTER_TOKEN_S + 30, took
        assert _metric(stack, "fleet_router_retries_total") == retries_before + 1  # one resume, no third try
        assert _metric(stack, "fleet_router_poison_requests_total") == 1
    finally:
        _restore(stack, stopped)


def test_a_stream_past_its_tiers_total_deadline_ends_in_band_with_what_it_streamed(stack):
    async def main():
        client = grpcaio.InferenceServerClient(stack.grpc_url)
        try:  # 2000 tokens of SmolLM2 on CPU take far longer than the batch tier's 2 s deadline
            return await asyncio.wait_for(stream_once(client, MODEL, CHATML.format(q="Describe the city of Rome in "
                                                      "detail, street by street."), 2000, stack.api_key,
                                                      tier="batch"), 90)
        finally:
            await client.close()
    started = time.monotonic()
    out = asyncio.run(main())
    took = time.monotonic() - started
    assert out.error is None, out.error_message  # in band: a finish reason, not an error status
    assert out.finish_reason == "stream_deadline", (out.finish_reason, len(out.ids))
    assert out.usage and out.usage[2] == len(out.ids) < 2000  # what was streamed is what is billed
    assert took < BATCH_STREAM_DEADLINE_S + 10, took
    fleet = stack.fleet()["replicas"]
    assert all(r["state"] == "serving" for r in fleet)  # the deadline is the request's, not a replica fault


# --- a second router with one slot per replica: total deadlines while queued, stopping (tests take ~10 s each)
SIDE_DEADLINE_S = 6.0  # the stop test's total deadline for every tier, so its stop grace too
QUEUED_DEADLINE_S = {"interactive": 8.0, "batch": 2.0}  # the total deadline test's


def test_a_queued_requests_total_deadline_counts_from_its_arrival(stack, tmp_path):
    """Queued behind busy slots: a batch request (2 s total) is refused once its deadline passes while it waits,
    over HTTP (504, OpenAI error) and in-band on gRPC, saying which deadline and how long it waited; an
    interactive one (8 s) admitted after ~7 s of waiting streams only for what is left (not 8 s more)."""
    interactive_s, batch_s = QUEUED_DEADLINE_S["interactive"], QUEUED_DEADLINE_S["batch"]
    side = SideRouter.start(stack, tmp_path / "side.log", FLEET_ROUTER_REPLICA_CONCURRENCY="1",
                            FLEET_ROUTER_STREAM_DEADLINE_S=f"interactive={interactive_s},batch={batch_s}")

    async def main():
        client = grpcaio.InferenceServerClient(side.grpc_url)
        try:
            fillers = await fill_slots(side, client, stack.api_key)
            http = asyncio.create_task(http_completion(side.http_url, stack.api_key, "batch"))
            grpc_batch = asyncio.create_task(timed(stream_once(client, MODEL, LONG_PROMPT, 20, stack.api_key,
                                                               tier="batch")))
            late = asyncio.create_task(timed(stream_once(client, MODEL, LONG_PROMPT, 2000, stack.api_key,
                                                         tier="interactive")))
            await until(lambda: side.fleet()["queues"]["smollm2-135m:1"]["by_tier"]["interactive"] == 1)
            return await http, await grpc_batch, await late, await asyncio.gather(*fillers)
        finally:
            await client.close()
    try:
        (status, headers, body, http_took), (batch, batch_took), (late, late_took), fillers = \
            asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        side.stop()
    assert status == 504 and body["error"]["code"] == "deadline_exceeded", (status, body)
    message = body["error"]["message"]
    assert f"total stream deadline of tier 'batch' ({batch_s:g} s from arrival" in message, message
    assert re.search(r"passed after \d+\.\d+ s in the admission queue of smollm2-135m:1", message), message
    assert batch_s <= http_took < batch_s + 1.5, http_took
    assert batch.error == "DEADLINE_EXCEEDED" and "tier 'batch'" in batch.error_message, batch
    assert batch_s <= batch_took < batch_s + 1.5, batch_took
    assert late.error is None and late.finish_reason == "stream_deadline", late
    assert late_took < interactive_s + 1.5, late_took  # from its arrival: admitted after ~7 s, it ended ~1 s later
    assert all(f.finish_reason == "stream_deadline" for f in fillers), fillers


def test_a_stopping_router_refuses_queued_requests_at_once_and_lets_running_streams_finish(stack, tmp_path):
    """SIGTERM with every slot busy and requests queued: the queued ones get UNAVAILABLE / 503 with a retry
    at once, an idle open gRPC stream ends UNAVAILABLE at once, the listener refuses new connections, the
    running streams go on streaming up to their deadline (= the stop grace), and the process then exits."""
    grace_s = SIDE_DEADLINE_S
    side = SideRouter.start(stack, tmp_path / "side.log", FLEET_ROUTER_REPLICA_CONCURRENCY="1",
                            FLEET_ROUTER_STREAM_DEADLINE_S=str(grace_s))
    token_times: list[float] = []

    async def on_token(_so_far):
        token_times.append(time.monotonic())

    async def main():
        client = grpcaio.InferenceServerClient(side.grpc_url)
        try:
            answered = asyncio.Event()
            idle = asyncio.create_task(idle_stream(client, stack.api_key, answered))
            await asyncio.wait_for(answered.wait(), 30)
            fillers = await fill_slots(side, client, stack.api_key, on_token)
            queued_grpc = asyncio.create_task(stream_once(client, MODEL, LONG_PROMPT, 20, stack.api_key,
                                                          tier="interactive"))
            queued_http = asyncio.create_task(http_completion(side.http_url, stack.api_key, "interactive"))
            await until(lambda: side.waiting() == 2, timeout_s=3)
            stopped_at = time.monotonic()
            os.kill(side.proc.pid, signal.SIGTERM)
            refused = await asyncio.wait_for(asyncio.gather(queued_grpc, queued_http, idle), 2)
            refused_after = time.monotonic() - stopped_at
            await until(lambda: not accepts(side), timeout_s=1)
            ended = await asyncio.gather(*fillers)
            last_stream_end = time.monotonic()
            await until(lambda: side.proc.poll() is not None, timeout_s=grace_s + 15)
            return refused, refused_after, ended, stopped_at, last_stream_end, time.monotonic()
        finally:
            await client.close()
    try:
        (grpc_out, http_out, idle_end), refused_after, ended, stopped_at, last_end, exited_at = \
            asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        side.stop()
    assert refused_after < 1.0, refused_after
    assert grpc_out.error == "UNAVAILABLE" and "router is stopping" in grpc_out.error_message, grpc_out
    assert grpc_out.retry_after_ms is not None and "retry elsewhere" in grpc_out.error_message, grpc_out
    status, headers, body, _ = http_out
    assert status == 503 and body["error"]["code"] == "unavailable" and headers.get("retry-after") == "1", http_out
    assert "router is stopping" in body["error"]["message"] and "admission queue" in body["error"]["message"], body
    assert "UNAVAILABLE" in idle_end[0] and "router is stopping" in idle_end[0], idle_end
    assert idle_end[1] - stopped_at < 1.0, idle_end[1] - stopped_at
    assert all(e.error is None and e.finish_reason == "stream_deadline" for e in ended), ended  # not cut: in band
    assert any(t > stopped_at for t in token_times), "no token streamed after SIGTERM"
    assert side.proc.returncode == 0, side.log.read_text()[-2000:]
    assert exited_at - last_end < 3.0, exited_at - last_end  # exits once its last stream ended (~1 s of it Python's)
    assert exited_at - stopped_at < grace_s + 3.0, exited_at - stopped_at
