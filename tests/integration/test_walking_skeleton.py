"""Walking skeleton: `fleet up` on a fresh data dir, a streamed completion through every real part
(router -> Triton ensemble on the real SmolLM2 -> usage through Kafka into DuckDB), bad input that
gets clear errors while the platform keeps serving, and `fleet down` leaving no process behind."""
from __future__ import annotations

import json
import queue
import re
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from fleet.processes import pid_alive
from tests.integration.platform import Platform, platform_env

pytestmark = pytest.mark.integration
QUESTION = "What is the capital of France?"
CHATML = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("platform")
    p = Platform(platform_env(data_dir), data_dir)
    up = p.fleet("up")
    assert up.returncode == 0, f"fleet up failed:\n{up.stdout}\n{up.stderr}"
    assert "API key" in up.stdout and p.api_key in up.stdout
    pids = [json.loads(f.read_text())["pid"] for f in (data_dir / "run").glob("*.json")]
    assert len(pids) >= 5, "expected broker, loader, replica, router and UI processes"
    yield p
    down = p.fleet("down")
    assert down.returncode == 0, down.stderr
    time.sleep(1)
    assert not [pid for pid in pids if pid_alive(pid)], "fleet down left processes behind"


def _stream(p: Platform, text: str, model: str = "smollm2-135m", max_tokens: int = 24, key: str | None = None,
            **params) -> list:
    inputs = [grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("max_tokens", [1], "INT32"),
              grpcclient.InferInput("temperature", [1], "FP32")]
    inputs[0].set_data_from_numpy(np.array([text.encode()], dtype=object))
    inputs[1].set_data_from_numpy(np.array([max_tokens], dtype=np.int32))
    inputs[2].set_data_from_numpy(np.array([0.0], dtype=np.float32))
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(p.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)),
                        headers={"authorization": f"Bearer {key if key is not None else p.api_key}"})
    client.async_stream_infer(model, inputs, request_id=f"skeleton-{time.time_ns()}", parameters=params)
    out = []
    try:
        while True:
            result, error = results.get(timeout=120)
            if error is not None:
                raise error
            out.append(result)
            if result.as_numpy("finish_reason")[0]:
                return out
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def test_tritonclient_streams_paris(platform):
    responses = _stream(platform, CHATML, tier="interactive")
    text = "".join(r.as_numpy("text_output")[0].decode() for r in responses)
    assert len(responses) > 3, "expected one streamed response per token"
    assert "Paris" in text
    prompt_tokens, cached, completion = responses[-1].as_numpy("usage").tolist()
    assert prompt_tokens > 10 and completion > 0


def test_openai_client_streams_paris_and_usage_lands_in_duckdb(platform):
    from openai import OpenAI

    from usage.store import connect

    client = OpenAI(base_url=f"{platform.http_url}/v1", api_key=platform.api_key)
    chunks = list(client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": QUESTION}], stream=True, max_tokens=24,
        temperature=0))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text and len(chunks) > 3
    request_id = chunks[0].id
    deadline = time.monotonic() + 5
    row = None
    while time.monotonic() < deadline and row is None:
        with connect(platform.data_dir / "usage.duckdb", read_only=True) as con:
            row = con.execute("SELECT prompt_tokens, completion_tokens, caller, finish_reason FROM usage_events "
                              "WHERE request_id = ?", [request_id]).fetchone()
        time.sleep(0.2)
    assert row is not None, "usage row did not reach DuckDB within 5 s"
    assert row[0] > 10 and row[1] > 0 and row[2] == "dev"


def _grpc_error(p: Platform, **kwargs) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        _stream(p, CHATML, **kwargs)
    return info.value


def test_bad_input_gets_clear_errors_and_the_platform_keeps_serving(platform):
    err = _grpc_error(platform, model="gpt-17")
    assert "NOT_FOUND" in str(err.status()) and "smollm2-135m" in err.message()
    err = _grpc_error(platform, key="wrong")
    assert "UNAUTHENTICATED" in str(err.status())
    err = _grpc_error(platform, max_tokens=0)
    assert "INVALID_ARGUMENT" in str(err.status()) and "max_tokens" in err.message()
    err = _grpc_error(platform, max_tokens=10**6)
    assert "INVALID_ARGUMENT" in str(err.status()) and "max_tokens" in err.message()
    long_prompt = "hello " * 5000
    with pytest.raises(InferenceServerException) as info:
        _stream(platform, long_prompt)
    assert "INVALID_ARGUMENT" in str(info.value.status())
    assert re.search(r"prompt: has \d{4} tokens.*context of 2048", info.value.message())

    import httpx
    headers = {"authorization": f"Bearer {platform.api_key}"}
    r = httpx.post(f"{platform.http_url}/v1/completions", headers=headers,
                   json={"model": "smollm2-135m", "prompt": "hi", "temperature": 9})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    r = httpx.post(f"{platform.http_url}/v1/completions", headers=headers, json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and "smollm2-135m" in r.json()["error"]["message"]
    r = httpx.post(f"{platform.http_url}/v1/completions", json={"model": "smollm2-135m", "prompt": "hi"})
    assert r.status_code == 401
    # still serving after all of that
    text = "".join(r.as_numpy("text_output")[0].decode() for r in _stream(platform, CHATML))
    assert "Paris" in text
