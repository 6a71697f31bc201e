"""Bounds of the OpenAI sampling fields (logprobs, penalties, logit_bias, min_p, min_tokens, stop_token_ids):
one definition, checked by the router before routing (a 400 naming the field) and again by the engine for
callers that reach a replica directly."""
from __future__ import annotations

import json
import math
import re

MAX_SPEC_BYTES = 65_536     # a structured-output schema or pattern, as JSON
# What makes xgrammar's compile slow is bounded repetition: each distinct string length bound (minLength /
# maxLength) costs ~0.7-1.9 s of one core here, each distinct `{m,n}` quantifier of a pattern ~0.1 s, so a
# 64 KB schema of distinct bounds would hold a replica's compile thread for many minutes. Bounded per spec:
MAX_LENGTH_BOUNDS = 8
MAX_QUANTIFIERS = 32
_QUANTIFIER = re.compile(r"(?<!\\)\{\s*\d*\s*,?\s*\d*\s*\}")

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300        # entries (OpenAI's own limit)
MAX_STOP_TOKEN_IDS = 16


def check_params(p, vocab: int) -> str:
    """'' when every sampling field of `p` (the engine's SamplingParams or the router's GenerateRequest: the
    same attribute names) is within its bounds, else the problem: field, value, what is allowed."""
    def bad(x: float, lo: float, hi: float) -> bool:
        return not (math.isfinite(x) and lo <= x <= hi)
    if not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS:
        return f"top_logprobs: {p.top_logprobs} is out of range; allowed: 0..{MAX_TOP_LOGPROBS}"
    for name in ("presence_penalty", "frequency_penalty"):
        if bad(getattr(p, name), -2.0, 2.0):
            return f"{name}: {getattr(p, name)} is out of range; allowed: -2..2"
    if bad(p.repetition_penalty, 1e-3, 10.0):
        return f"repetition_penalty: {p.repetition_penalty} is out of range; allowed: (0, 10], 1 = off"
    if bad(p.min_p, 0.0, 1.0):
        return f"min_p: {p.min_p} is out of range; allowed: 0..1"
    if len(p.logit_bias) > MAX_LOGIT_BIAS:
        return f"logit_bias: {len(p.logit_bias)} entries; at most {MAX_LOGIT_BIAS}"
    for tok, bias in p.logit_bias.items():
        if not 0 <= tok < vocab:
            return f"logit_bias: token id {tok} is out of range; allowed: 0..{vocab - 1}"
        if bad(bias, -100.0, 100.0):
            return f"logit_bias: bias {bias} of token {tok} is out of range; allowed: -100..100"
    if getattr(p, "guided", None) is not None:
        problem = spec_problem(p.guided)
        if problem:
            return problem
    if p.min_tokens < 0 or (p.max_tokens is not None and p.min_tokens > p.max_tokens):
        return f"min_tokens: {p.min_tokens} must be between 0 and max_tokens ({p.max_tokens})"
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(not 0 <= t < vocab for t in p.stop_token_ids):
        return f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids in 0..{vocab - 1}"
    return ""


def spec_problem(spec) -> str:
    """'' if `spec` is a well-formed guided spec, else what is wrong (checked by the router and the engine)."""
    if not isinstance(spec, dict) or spec.get("type") not in ("json_object", "json_schema", "regex"):
        return "response_format: type must be one of json_object, json_schema, regex"
    try:
        size = len(json.dumps(spec))
    except (ValueError, RecursionError):
        return "response_format: the schema cannot be encoded as JSON"
    if size > MAX_SPEC_BYTES:
        return f"response_format: the schema or pattern is larger than {MAX_SPEC_BYTES} bytes"
    if spec["type"] == "json_schema" and not isinstance(spec.get("schema"), dict):
        return "response_format: json_schema needs a `schema` object"
    if spec["type"] == "regex" and not isinstance(spec.get("pattern"), str):
        return "response_format: regex needs a `pattern` string"
    return _cost_problem(spec.get("schema") if spec["type"] == "json_schema" else {"pattern": spec.get("pattern")})


def _cost_problem(schema) -> str:
    """The compile-cost bounds (MAX_LENGTH_BOUNDS, MAX_QUANTIFIERS) over a schema's nodes."""
    length_bounds: set[tuple] = set()
    quantifiers: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if "minLength" in node or "maxLength" in node:
                length_bounds.add((str(node.get("minLength")), str(node.get("maxLength"))))
            if isinstance(node.get("pattern"), str):
                quantifiers.update(_QUANTIFIER.findall(node["pattern"]))
            stack.extend(v for k, v in node.items() if k not in ("enum", "const", "default", "examples"))
    if len(length_bounds) > MAX_LENGTH_BOUNDS:
        return (f"response_format: {len(length_bounds)} distinct string length bounds (minLength/maxLength); at "
                f"most {MAX_LENGTH_BOUNDS} per schema (each costs the grammar compiler about a second)")
    if len(quantifiers) > MAX_QUANTIFIERS:
        return (f"response_format: {len(quantifiers)} distinct repetition bounds ({{m,n}}) in patterns; at most "
                f"{MAX_QUANTIFIERS} per schema or regex")
    return ""
