"""Walking skeleton: `fleet up` on a fresh data dir, a streamed completion through every real part
(router -> Triton ensemble on the real SmolLM2 -> usage through Kafka into DuckDB), bad input that
gets clear errors while the platform keeps serving, and `fleet down` leaving no process behind."""
from __future__ import annotations

import re

import pytest
from tritonclient.utils import InferenceServerException

from common.processes import wait_until
from tests.integration.platform import Platform

pytestmark = pytest.mark.integration
QUESTION = "What is the capital of France?"
CHATML = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"


def test_tritonclient_streams_paris(platform):
    responses = platform.stream(CHATML, tier="interactive")
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

    def usage_row():
        with connect(platform.data_dir / "usage.duckdb", read_only=True) as con:
            return con.execute("SELECT prompt_tokens, completion_tokens, caller, finish_reason FROM usage_events "
                               "WHERE request_id = ?", [request_id]).fetchone()
    row = wait_until(usage_row, 120, "the usage row in DuckDB (router -> Kafka -> loader)")
    assert row[0] > 10 and row[1] > 0 and row[2] == "dev"


def _grpc_error(p: Platform, text: str = CHATML, **kwargs) -> str:
    """The error of one streamed request: a stream-level status (bad key) or an in-band per-request error
    ("request <id>: <STATUS>: <message>"), as '<status> <message>'."""
    with pytest.raises(InferenceServerException) as info:
        p.stream(text, **kwargs)
    return f"{info.value.status()} {info.value.message()}"


def test_bad_input_gets_clear_errors_and_the_platform_keeps_serving(platform):
    err = _grpc_error(platform, model="gpt-17")
    assert "NOT_FOUND" in err and "smollm2-135m" in err
    err = _grpc_error(platform, key="wrong")
    assert err.startswith("StatusCode.UNAUTHENTICATED")
    err = _grpc_error(platform, max_tokens=0)
    assert "INVALID_ARGUMENT" in err and "max_tokens" in err
    err = _grpc_error(platform, max_tokens=10**6)
    assert "INVALID_ARGUMENT" in err and "max_tokens" in err
    long_prompt = "hello " * 5000
    with pytest.raises(InferenceServerException) as info:
        platform.stream(long_prompt)
    assert "INVALID_ARGUMENT" in info.value.message()
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
    text = "".join(r.as_numpy("text_output")[0].decode() for r in platform.stream(CHATML))
    assert "Paris" in text


def test_shipped_lora_adapter_changes_the_answer_through_the_router(platform):
    question = "<|im_start|>user\nWhat is the capital of Italy?<|im_end|>\n<|im_start|>assistant\n"
    base = "".join(r.as_numpy("text_output")[0].decode() for r in platform.stream(question))
    french = "".join(r.as_numpy("text_output")[0].decode() for r in platform.stream(question, adapter="french"))
    assert base != french and "capitale" in french.lower()
    err = _grpc_error(platform, text=question, adapter="klingon")  # unknown adapter: NOT_FOUND naming the known ones
    assert "NOT_FOUND" in err and "french" in err
