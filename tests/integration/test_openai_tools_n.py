"""Tools and `n` with the stock `openai` SDK against the running platform (real SmolLM2): a tool-call round
trip with tool_choice="required", a named tool choice streamed as the deltas the SDK accumulates, and n=4
choices billed as 4 completions with the prompt once (response usage and the usage events in DuckDB), and the
router's prompt-token counter counting an n=3 request's prompt once, as billed."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.processes import wait_until

MODEL = "smollm2-135m"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "EST"]}},
                   "required": ["zone"], "additionalProperties": False}}}


def _billed(platform, request_id: str, n: int) -> list[tuple] | None:
    """The usage rows of an `n` request (choice 1 is `request_id`, choice i `request_id-i`), once all n are in."""
    from usage.store import connect
    with connect(platform.data_dir / "usage.duckdb", read_only=True) as con:
        rows = con.execute("SELECT request_id, prompt_tokens, completion_tokens FROM usage_events WHERE "
                           "request_id = ? OR request_id LIKE ? ORDER BY request_id",
                           [request_id, request_id + "-%"]).fetchall()
    return rows if len(rows) == n else None


def _prompt_counter(platform) -> float:
    """fleet_router_prompt_tokens_total of MODEL, every tier, as the router's /metrics shows it now."""
    page = httpx.get(f"{platform.http_url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(page) if f.name == "fleet_router_prompt_tokens"
               for s in f.samples if s.name.endswith("_total") and s.labels.get("model") == MODEL)


@pytest.fixture(scope="module")
def client(platform):
    return openai.OpenAI(base_url=f"{platform.http_url}/v1", api_key=platform.api_key, max_retries=0, timeout=120)


def test_tool_call_round_trip_with_required(client):
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                           tool_choice="required", parallel_tool_calls=False, max_tokens=48,
                                           temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    assert set(args) == ({"city"} if call.function.name == "get_weather" else {"zone"})
    # the same call streamed: the SDK accumulates the deltas into the same tool call
    with client.chat.completions.stream(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=48, temperature=0) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(call.function.name, call.function.arguments)]
    # the assistant's call and the tool's result go back in the history; the model answers in text
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees Celsius."}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice="none",
                                            max_tokens=24, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens - 200   # the history was rendered, tools not


def test_named_tool_choice_streams_id_name_then_argument_fragments(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What time is it in Berlin?"}], tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=24, temperature=0,
        stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    head, *fragments = [d[0] for d in deltas]
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_time"
    assert fragments and all(f.index == 0 and f.id is None for f in fragments)
    arguments = (head.function.arguments or "") + "".join(f.function.arguments for f in fragments)
    assert json.loads(arguments)["zone"] in ("UTC", "CET", "EST")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_n_choices_are_billed_as_n_completions_with_the_prompt_once(client, platform):
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    one = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=1.0, seed=5)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=1.0, seed=5, n=4,
                                         logprobs=True)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert len({c.message.content for c in out.choices}) > 1, "each choice has its own seed"
    per_choice = [len(c.logprobs.content) for c in out.choices]
    assert out.usage.completion_tokens == sum(per_choice) and out.usage.prompt_tokens == one.usage.prompt_tokens

    rows = wait_until(lambda: _billed(platform, out.id, 4), 120, "the 4 usage rows in DuckDB (router -> Kafka -> loader)")
    assert [r[1] for r in rows] == [one.usage.prompt_tokens, 0, 0, 0]
    assert sum(r[2] for r in rows) == out.usage.completion_tokens
    # streamed, with a JSON constraint: every choice is valid JSON, chunks carry their choice's index
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give a JSON object describing a cat."}], max_tokens=60,
        temperature=0.7, seed=1, n=3, stream=True, stream_options={"include_usage": True},
        response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                             "age": {"type": "integer", "minimum": 0, "maximum": 30}},
            "required": ["name", "age"], "additionalProperties": False}}}))
    texts, reasons = ["", "", ""], [None, None, None]
    for c in chunks[:-1]:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            reasons[ch.index] = ch.finish_reason or reasons[ch.index]
    assert reasons == ["stop"] * 3 and all(set(json.loads(t)) == {"name", "age"} for t in texts)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 3 * 5


def test_the_prompt_token_counter_counts_an_n_request_prompt_once_as_billed(client, platform):
    before = _prompt_counter(platform)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a river."}],
                                         max_tokens=4, temperature=1.0, seed=3, n=3)
    # the router counts a choice's tokens just before it spools its usage event: all 3 billed => all 3 counted
    rows = wait_until(lambda: _billed(platform, out.id, 3), 120, "the 3 usage rows in DuckDB")
    billed = sum(r[1] for r in rows)
    assert billed == out.usage.prompt_tokens > 0 and [r[1] for r in rows] == [billed, 0, 0]
    assert _prompt_counter(platform) - before == billed, "the prompt of an n=3 request counted once, as billed"
