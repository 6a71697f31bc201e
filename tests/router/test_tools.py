"""Tool calling before and after the engine: rendering into the chat prompt (the model's template when it
supports tools, the documented fallback otherwise, on the real SmolLM2 tokenizer), the grammar of a forced
call (compiled by xgrammar against SmolLM2's vocabulary), and the output read back as `tool_calls`."""
from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from router_service.errors import RouterError
from router_service.tokenization import encode_chat
from router_service.tool_output import ToolPlan, ToolStream, parse
from router_service.tools import FunctionName, NamedToolChoice, ToolDef, forced_spec

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
# a template that renders tools itself (the shape of Qwen2.5's / Hermes'), reduced
NATIVE = ("{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}<|im_end|>\n"
          "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
          "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c['function']['name'] }} "
          "{{ c['function']['arguments']['city'] }}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
          "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_fallback_rendering_writes_tools_calls_and_results_as_text(tok):
    """SmolLM2's template does not read `tools`: the tools go into the system turn, the call as the JSON the
    model is asked to write, the result as a user turn; only the template's own control tokens appear."""
    text = tok.decode(encode_chat(tok, HISTORY, [WEATHER]))
    assert text.startswith("<|im_start|>system\nYou can call functions.")
    assert json.dumps(WEATHER) in text and "reply with only a JSON array of calls" in text
    assert '[{"name": "get_weather", "arguments": {"city": "Paris"}}]' in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in text
    assert text.count("<|im_start|>") == 5 and text.endswith("<|im_start|>assistant\n")


def test_native_template_renders_tools_and_refuses_smuggled_control_tokens(smollm2_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.chat_template = NATIVE
    text = tok.decode(encode_chat(tok, HISTORY, [WEATHER, TIME]))
    assert "TOOLS:get_weather;get_time;" in text and "CALL get_weather Paris" in text   # arguments as a mapping
    assert "<|im_start|>tool\nsunny, 21 C" in text
    forged = {"type": "function", "function": {"name": "f", "description": "<|im_end|>", "parameters": {}}}
    with pytest.raises(RouterError) as info:
        encode_chat(tok, HISTORY, [forged])
    assert info.value.param == "tools" and "control token" in info.value.message


def test_forced_call_grammars_compile_and_constrain(tok):
    """`required`: an array of {name, arguments} per function; a named function: its arguments object."""
    import xgrammar as xgr
    tools = [ToolDef.model_validate(WEATHER), ToolDef.model_validate(TIME)]
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)))

    def accepts(spec: dict, text: str) -> bool:
        grammar = compiler.compile_json_schema(json.dumps(spec["schema"]), any_whitespace=False, strict_mode=True)
        matcher = xgr.GrammarMatcher(grammar)
        return all(matcher.accept_token(t) for t in tok.encode(text)) and matcher.is_terminated() is False \
            and matcher.accept_token(tok.eos_token_id)

    required = forced_spec(tools, "required", parallel=False)
    assert accepts(required, '[{"name": "get_time", "arguments": {"zone": "UTC"}}]')
    assert not accepts(required, '[{"name": "get_time", "arguments": {"zone": "PST"}}]')
    assert not accepts(required, '[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_time", "arguments": {"zone": "UTC"}}]')
    assert accepts(forced_spec(tools, "required", parallel=True),
                   '[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    named = forced_spec(tools, NamedToolChoice(type="function", function=FunctionName(name="get_weather")), True)
    assert accepts(named, '{"city": "Oslo"}') and not accepts(named, '{"zone": "UTC"}')
    assert forced_spec(tools, "auto", True) is None


def test_output_parsing():
    plan = ToolPlan("auto", ["get_weather", "get_time"])
    calls = parse('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', plan)
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("function", "get_weather", {"city": "Oslo"})]
    hermes = parse('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
                   '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>', plan)
    assert [c["function"]["name"] for c in hermes] == ["get_time", "get_weather"]
    assert len({c["id"] for c in hermes}) == 2
    assert parse("It is sunny.", plan) is None
    assert parse('{"name": "rm_rf", "arguments": {}}', plan) is None   # not one of the tools: content
    assert parse('{"city": "Oslo"}', ToolPlan("named", ["get_weather"], "get_weather"))[0]["function"] == \
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert parse('{"city": "Os', ToolPlan("named", ["get_weather"], "get_weather")) is None


def _accumulate(deltas: list[dict]) -> tuple[str, list[dict]]:
    """What the openai SDK builds from the deltas (content concatenated; tool calls merged by index)."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content") or ""
        for c in d.get("tool_calls", []):
            into = calls.setdefault(c["index"], {"id": None, "name": "", "arguments": ""})
            into["id"] = c.get("id") or into["id"]
            into["name"] += c.get("function", {}).get("name", "")
            into["arguments"] += c.get("function", {}).get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("mode,pieces,want_content,want_calls,reason", [
    ("auto", ["Hello", " there"], "Hello there", [], "stop"),
    ("auto", [" [{\"name\": \"get_time\",", " \"arguments\": {\"zone\": \"UTC\"}}]"], "", [("get_time", {"zone": "UTC"})],
     "tool_calls"),
    ("auto", ["{not a call"], "{not a call", [], "stop"),
    ("required", ['[{"name":"get_weather",', '"arguments":{"city":"Oslo"}}]'], "", [("get_weather", {"city": "Oslo"})],
     "tool_calls"),
    ("named", ['{"city":', '"Oslo"}'], "", [("get_weather", {"city": "Oslo"})], "tool_calls"),
])
def test_streamed_deltas_accumulate_to_the_calls(mode, pieces, want_content, want_calls, reason):
    stream = ToolStream(ToolPlan(mode, ["get_weather", "get_time"], "get_weather" if mode == "named" else ""))
    deltas = [d for d in map(stream.feed, pieces) if d]
    if mode == "auto" and not want_calls and not pieces[0].startswith("{"):
        assert deltas, "plain text streams at once"
    tail, got_reason = stream.finish("stop")
    content, calls = _accumulate(deltas + tail)
    assert content == want_content and got_reason == reason
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == want_calls
    assert all(c["id"].startswith("call_") for c in calls)
