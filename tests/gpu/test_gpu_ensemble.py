"""The GPU ensemble end to end on CPU, behind the real router: real tritonserver, the real GPU preprocessing and
postprocessing models, and the stand-in `tensorrt_llm` (tests/gpu/standin/model.py: NOT TensorRT-LLM; it follows
the backend's documented contract). Streams finish, usage counts are right, cached tokens reach chargeback,
LoRA weights cross into the backend once per replica and again only after the backend's not-cached answer."""
from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from tests.gpu.gpu_stack import GpuStack, wait_for
from usage.chargeback import usage_summary
from usage.loader import UsageLoader

pytestmark = pytest.mark.integration
LONG_PROMPT = ("You are a support assistant for a bicycle shop. Answer in one short sentence, politely, and never "
               "invent prices. The shop opens at nine, closes at six, repairs flats in one hour, sells helmets, "
               "lights, locks and spare tubes, and is closed on Sundays. Question: ")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm2_dir):
    s = GpuStack.start(tmp_path_factory.mktemp("gpu-stack"), smollm2_dir.resolve(), replicas=2, lora_cache_tasks=1)
    yield s
    s.stop()


def test_replicas_report_state_and_untrusted_metrics_stay_out(stack):
    def reporting():
        reps = {r["replica_id"]: r for r in stack.fleet()["replicas"]}
        return all(reps.get(rid, {}).get("reporting") for rid in stack.replica_ids) and reps
    reps = wait_for(reporting, 30, "GPU replicas never reported to the router")
    for rid in stack.replica_ids:
        assert reps[rid]["block_size"] == 16  # nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per"}
        assert reps[rid]["kv_blocks_free"] is None, "a KV metric that never moved must not be trusted"
        assert reps[rid]["running"] is None
    for _ in range(4):  # some traffic on both replicas makes the backend metrics move
        stack.complete("Name a colour.", 4)
    time.sleep(0.6)
    moved = [r for r in stack.fleet()["replicas"] if r["kv_blocks_free"] is not None]
    assert moved and all(0 < r["kv_blocks_free"] <= r["kv_blocks_total"] == 512 for r in moved)


def test_streams_end_on_the_final_response_and_router_counts_tokens(stack):
    out = stack.complete("The capital of France is", 6)
    choice, usage = out["choices"][0], out["usage"]
    assert choice["finish_reason"] == "length" and usage["completion_tokens"] == 6
    assert usage["prompt_tokens"] > 0 and choice["text"]
    # end id produced: the backend omits it, the stream still ends, finish_reason is the router's "stop"
    chat = httpx.post(f"{stack.http_url}/v1/chat/completions", timeout=120,
                      headers={"authorization": f"Bearer {stack.api_key}"},
                      json={"model": "smollm2-135m", "max_tokens": 96, "temperature": 0,
                            "messages": [{"role": "user", "content": "Reply with exactly one word: yes or no?"}]}).json()
    assert chat["choices"][0]["finish_reason"] == "stop", chat
    assert 0 < chat["usage"]["completion_tokens"] < 96
    assert "<|im_end|>" not in chat["choices"][0]["message"]["content"]
    # streamed (SSE): the last chunk carries the finish reason, then [DONE]
    with httpx.stream("POST", f"{stack.http_url}/v1/completions", timeout=120,
                      headers={"authorization": f"Bearer {stack.api_key}"},
                      json={"model": "smollm2-135m", "prompt": "Once upon a time", "max_tokens": 5, "stream": True,
                            "temperature": 0}) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in lines[-2].replace(" ", "") or any(
        '"finish_reason":"length"' in line.replace(" ", "") for line in lines)


def test_cached_prompt_tokens_reach_chargeback(stack, tmp_path):
    first = stack.complete(LONG_PROMPT + "when do you open?", 3)
    second = stack.complete(LONG_PROMPT + "do you sell locks?", 3)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 16 * 3 and cached % 16 == 0 and cached < second["usage"]["prompt_tokens"]
    store = tmp_path / "usage.duckdb"
    loader = UsageLoader(stack.kafka, store, group_id="gpu-test")
    ids = {first["id"], second["id"]}

    def loaded():
        loader.run_once(1.0)
        try:  # the lake beside `store` (the control file itself may not exist yet)
            df = usage_summary(store, group_by=("model",))
        except Exception:  # nothing loaded yet
            return False
        return not df.empty and int(df["cached_tokens"].sum()) >= cached
    wait_for(loaded, 60, f"usage events {ids} never reached the usage store")
    loader.close()
    df = usage_summary(store, group_by=("model",))
    assert int(df["cached_tokens"].sum()) >= cached  # chargeback prices these at the cached rate


def test_lora_weights_cross_once_per_replica_and_again_after_eviction(stack):
    uploads = lambda: [stack.replica_metric(i, "standin_lora_weight_uploads_total") for i in range(2)]  # noqa: E731
    sends = lambda reason: stack.router_metric("fleet_router_lora_weight_sends_total", reason=reason)  # noqa: E731
    before = uploads()
    for _ in range(4):
        assert stack.complete("Say hello.", 3, adapter="french")["usage"]["completion_tokens"] == 3
    after = uploads()
    assert all(a - b <= 1 for a, b in zip(after, before)), f"weights sent more than once per replica: {after}"
    assert sum(after) - sum(before) == sends("first") >= 1
    # the stand-in caches one task: alternating adapters on one replica evicts; the backend answers "not found in
    # cache", the router resends with the weights, the caller never sees the error. Placement may also keep each
    # adapter on its own replica (then nothing is evicted); either way every upload is one the router counted.
    for adapter in ("terse-json", "french", "terse-json", "french"):
        assert stack.complete("Say hello.", 3, adapter=adapter)["choices"][0]["finish_reason"] == "length"
    assert sum(uploads()) == sends("first") + sends("not_cached")


def _chat(stack, content: str, **extra) -> httpx.Response:
    return httpx.post(f"{stack.http_url}/v1/chat/completions", timeout=120,
                      headers={"authorization": f"Bearer {stack.api_key}"},
                      json={"model": "smollm2-135m", "temperature": 0, **extra,
                            "messages": [{"role": "user", "content": content}]})


def test_guided_decoding_logprobs_and_ignore_eos_reach_tensorrt_llm(stack):
    """response_format -> guided_decoding_guide_type/guide (the stand-in enforces them with xgrammar, as the
    backend does); logprobs -> return_log_probs -> output_log_probs -> the SSE/JSON logprobs; ignore_eos ->
    end_id -1. Each through the real router, tritonserver and the GPU pre/post-processing."""
    schema = {"type": "object", "additionalProperties": False, "required": ["colour", "ripe"],
              "properties": {"colour": {"type": "string", "enum": ["red", "green", "yellow"]},
                             "ripe": {"type": "boolean"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "fruit", "schema": schema, "strict": True}}
    generated = lambda: sum(stack.replica_metric(i, "fleet_engine_generated_tokens_total") for i in range(2))  # noqa: E731
    prompted = lambda: sum(stack.replica_metric(i, "fleet_engine_prefix_cache_queried_tokens_total")  # noqa: E731
                           for i in range(2))
    before = generated(), prompted()
    resp = _chat(stack, "Describe a banana.", max_tokens=40, response_format=fmt, logprobs=True)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    parsed = json.loads(choice["message"]["content"])           # valid JSON, and the schema's shape
    assert set(parsed) == {"colour", "ripe"} and parsed["colour"] in ("red", "green", "yellow")
    assert choice["finish_reason"] == "stop"                    # the grammar ended it, not max_tokens
    content = choice["logprobs"]["content"]
    assert len(content) == resp.json()["usage"]["completion_tokens"]
    assert all(t["logprob"] <= 0 for t in content) and sum(t["logprob"] for t in content) < 0
    regex = _chat(stack, "Pick a number.", max_tokens=8, response_format={"type": "regex", "pattern": "[0-9]{3}"})
    assert regex.status_code == 200 and re.fullmatch(r"[0-9]{3}", regex.json()["choices"][0]["message"]["content"])
    # what TensorRT-LLM cannot do is refused before any token, naming the field
    refused = _chat(stack, "Hi", max_tokens=4, logprobs=True, top_logprobs=2)
    assert refused.status_code >= 400 and "top_logprobs" in refused.text
    # ignore_eos: the one-word answer that ends early without it runs to max_tokens with it
    short = _chat(stack, "Reply with exactly one word: yes or no?", max_tokens=48).json()
    assert short["usage"]["completion_tokens"] < 48
    full = _chat(stack, "Reply with exactly one word: yes or no?", max_tokens=48, ignore_eos=True).json()
    assert full["usage"]["completion_tokens"] == 48 and full["choices"][0]["finish_reason"] == "length"
    # the GPU replica's own fleet_engine_* counters (python_backends/gpu_metrics.py) saw these tokens
    wait_for(lambda: generated() - before[0] >= 48 + short["usage"]["completion_tokens"], 10,
             "fleet_engine_generated_tokens_total did not count the streamed tokens")
    assert prompted() - before[1] >= full["usage"]["prompt_tokens"] * 2


def test_prestop_drain_waits_for_the_backends_active_requests(stack):
    """Last: it drains a replica. The wait ends only when the executor's active-request metric is 0 (Triton's
    pending count is 0 as soon as the request is executing)."""
    import threading

    from python_backends.trtllm_state import drain

    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(stack.complete("Count from one to fifty:", 40)))
    worker.start()
    index = wait_for(lambda: _busy_replica(stack), 30, "the request never became active")
    pending = stack.replica_metric(index - 1, "nv_inference_pending_request_count")
    assert pending == 0  # executing: the old drain signal would have let the pod stop here
    identity = {"replica_id": stack.replica_ids[index - 1], "routers": [stack.http_url]}
    assert drain(stack.metrics_url(index - 1), identity, stack.admin_token, timeout_s=60, poll_s=0.2)
    worker.join(10)
    assert result["usage"]["completion_tokens"] == 40 and result["choices"][0]["finish_reason"] == "length"
    states = {r["replica_id"]: r["state"] for r in stack.fleet()["replicas"]}
    assert states[identity["replica_id"]] == "draining"


def _busy_replica(stack) -> int:
    """1 + the index of a replica whose executor holds a request (0 = none yet)."""
    for i in range(2):
        text = httpx.get(stack.metrics_url(i), timeout=5).text
        if any(line.startswith("nv_trt_llm_request_metrics") and 'request_type="active"' in line
               and float(line.rsplit(" ", 1)[1]) >= 1 for line in text.splitlines()):
            return i + 1
    return 0
